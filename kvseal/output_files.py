"""Output files of commands that run for a while (`bench serve --result-json`, `canary --report`).

They are checked before the run, so a path the result could not be written to is refused up
front instead of losing the result after minutes of work.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvseal.errors import KvsealError


def check_output_file(path: str | Path, flag: str, *, make_folder: bool = False) -> None:
    """Raise KvsealError unless `path` can be written: not a folder, its folder there (made,
    parents included, when `make_folder`) and writable, the file itself writable if it exists.
    Writes no file."""
    path = Path(path)
    if path.is_dir():
        raise KvsealError(f"{flag} {path} is a folder; give the path of a file to write")
    folder = path.parent
    if make_folder:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise KvsealError(f"{flag} {path}: cannot make its folder {folder}: {exc.strerror or exc}") from exc
    if not folder.is_dir():
        raise KvsealError(f"{flag} {path}: its folder {folder} does not exist; make it first or give another path")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise KvsealError(f"{flag} {path} is not writable; give a path you may write")
