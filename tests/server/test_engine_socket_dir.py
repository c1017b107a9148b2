"""I9 on the colocated link: the frontend and its engine talk over IPC sockets in a folder only
the server's user may enter, so no other local user can connect to them (file permissions are
that link's authentication; see `kvseal/engine/launcher.py`)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvseal.config import EngineArgs
from kvseal.engine.launcher import EngineProcess


def test_the_engine_sockets_live_in_a_folder_only_this_user_may_enter(tmp_path: Path) -> None:
    old_umask = os.umask(0)  # a permissive umask must not widen it
    try:
        engine = EngineProcess(EngineArgs(model=str(tmp_path)), "INFO")
    finally:
        os.umask(old_umask)
    try:
        folder = Path(engine.addresses.to_engine.removeprefix("ipc://")).parent
        assert Path(engine.addresses.from_engine.removeprefix("ipc://")).parent == folder
        info = folder.stat()
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    finally:
        engine.cleanup()
    assert not folder.exists()
