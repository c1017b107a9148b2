"""Files and folders only their owner may change: the rule kvseal holds what it trusts on disk to.

A file or folder passes when no user but its owner may write it (no group or other write bit)
and its owner is this user or root, as OpenSSH requires of `authorized_keys`. Engine link key
files and their folders (`disagg.link_keys`), the GGUF conversion cache (`model_files`) and the
native kernels' build cache (`ops.native_build`) are held to it: another local user who could
write one could change what every tenant is served (an allow-list, the weights, the code)
without anyone noticing. A cache that breaks it is given up for a private stand-in of the
process (`give_up_cache`), the same for both caches.
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

from kvseal.errors import ConfigError

__all__ = ["UnsafeFile", "give_up_cache", "make_owner_only_folders", "refuse_unsafe", "stand_in"]

logger = logging.getLogger("kvseal")
# a cache folder this process gave up -> its private stand-in (`give_up_cache`)
_stand_ins: dict[Path, Path] = {}


class UnsafeFile(ConfigError):
    """A file or folder that a user other than its owner may change, or that is owned by neither
    this user nor root."""


def refuse_unsafe(path: Path, what: str, stake: str) -> None:
    """Raise UnsafeFile naming `path`, why and the fix, if a user other than its owner may write it
    or its owner is neither this user nor root; `what` opens the message, `stake` says what such a
    user could do ("put their own key there"). Follows links; the folders above are not checked."""
    st = path.stat()
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise UnsafeFile(f"{what} {path} can be written by users other than its owner (mode {mode:o}), who "
                         f"could {stake}; make it writable by its owner only: chmod go-w {path}")
    if st.st_uid not in (os.getuid(), 0):
        raise UnsafeFile(f"{what} {path} is owned by user id {st.st_uid}, neither this user ({os.getuid()}) nor "
                         f"root, who could {stake}; give it to this user: chown {os.getuid()} {path}")


def make_owner_only_folders(top: Path, bottom: Path, what: str, stake: str) -> None:
    """Make the folders from `top` down to `bottom` (inside it) where missing, each one 0700
    whatever the umask (the folders above `top` with the umask's mode), and refuse_unsafe each of
    them. OSError where one cannot be made (a file in the way, no permission)."""
    folders = [top]
    for part in bottom.relative_to(top).parts:
        folders.append(folders[-1] / part)
    for folder in folders:
        try:
            folder.mkdir(mode=0o700, parents=folder == top)
            os.chmod(folder, 0o700)  # the umask may have taken bits of the owner's too
        except FileExistsError:  # there before, or made meanwhile by another process
            if not folder.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "a file where a folder must be", str(folder)) from None
        refuse_unsafe(folder, what, stake)


def give_up_cache(cache: Path, why: Exception, what: str, instead: str, prefix: str) -> Path:
    """Stop using the cache folder `cache` in this process (it, or a folder above it, breaks the
    rule or cannot be made or written): its private stand-in, a folder made (0700) in the
    temporary folder at the first call, with a warning naming `what` the cache is, why, what is
    done `instead` in the stand-in and the fix, and removed when the process exits."""
    if cache not in _stand_ins:
        _stand_ins[cache] = Path(tempfile.mkdtemp(prefix=prefix))
        atexit.register(shutil.rmtree, _stand_ins[cache], ignore_errors=True)
        logger.warning("%s %s is not used: %s. %s %s instead, for this process only (again at every start): make "
                       "the cache this user's alone, or set XDG_CACHE_HOME to a folder only this user may write",
                       what, cache, why, instead, _stand_ins[cache])
    return _stand_ins[cache]


def stand_in(cache: Path) -> Path | None:
    """The private stand-in of a cache folder this process gave up (`give_up_cache`), else None."""
    return _stand_ins.get(cache)
