"""The tensor-parallel ranks' shared secret: made per engine on one node, a key file across nodes.

Every rank proves it holds this secret before the group carries anything (`rank_auth.py`).
On one node rank 0 makes a fresh one at every start and hands it to the worker ranks it starts
on their stdin pipe (`read_secret`): never argv (any local user reads /proc/PID/cmdline) and
never the environment (inherited by whatever a rank starts). Across nodes, node 0's engine and
every `kvseal tp-node` read the same key file (`--tp-key-file`), which
`kvseal keys tp-key FILE` writes with mode 0600; one readable by group or others is refused,
as ssh refuses such a private key.

No torch here: `kvseal keys tp-key` runs without it.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from typing import BinaryIO

from kvseal.errors import ConfigError

KEY_BYTES = 32  # HMAC-SHA256's block-sized key: 256 bits of randomness
TP_KEY_HINT = "make one with `kvseal keys tp-key FILE` and copy it (mode 0600) to every node"


def new_secret() -> bytes:
    """A fresh secret for one engine's ranks (one node: lives only in rank 0's and its ranks' memory)."""
    return secrets.token_bytes(KEY_BYTES)


def engine_secret(key_file: str | None, nnodes: int) -> bytes:
    """Rank 0's secret: the operator's key file when given (required across nodes), else a fresh one."""
    if key_file is not None:
        return load_tp_key(key_file)
    if nnodes > 1:
        raise ConfigError(f"--nnodes {nnodes} needs --tp-key-file: ranks on other nodes prove they hold the "
                          f"same key before they get any step; {TP_KEY_HINT}")
    return new_secret()


def load_tp_key(path: str | Path, flag: str = "--tp-key-file") -> bytes:
    """The key in `path` (64 hex digits); refused when missing, malformed, or readable by others."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{flag}: no key file at {path}; {TP_KEY_HINT}")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise ConfigError(f"{flag} {path} is readable or writable by other users (mode {mode:o}); the ranks' key "
                          f"must be its owner's only: chmod 600 {path}")
    text = path.read_text(encoding="ascii", errors="replace").strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise ConfigError(f"{flag} {path} does not hold a tensor-parallel key ({2 * KEY_BYTES} hex digits); "
                          f"{TP_KEY_HINT}")
    return key


def write_tp_key(path: str | Path) -> Path:
    """Write a fresh key to `path`, created with mode 0600 (never readable by others, not even for
    an instant: the mode is set by the call that creates it); never overwrites a file."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError as exc:
        raise ConfigError(f"{path} exists already; a key is never overwritten (remove it first, and copy the "
                          f"new one to every node)") from exc
    except OSError as exc:
        raise ConfigError(f"cannot write keys to {path}: {exc.strerror or exc} (its folder must exist and be "
                          f"writable)") from exc
    with os.fdopen(fd, "w", encoding="ascii") as out:
        out.write(new_secret().hex() + "\n")
    return path


def read_secret(stream: BinaryIO) -> bytes:
    """A worker rank's secret, written by the process that started it on its stdin, then closed."""
    data = stream.read(KEY_BYTES + 1)
    if len(data) != KEY_BYTES:
        raise ConfigError(f"a tensor-parallel worker rank reads its {KEY_BYTES}-byte key on stdin and got "
                          f"{len(data)} bytes; it is started by the engine or `kvseal tp-node`, not by hand")
    return data
