"""The frontend's open-files limit, and the cap on HTTP connections kept under it.

Every HTTP connection holds a file descriptor, and so do the engine links, the audit log (opened
again after every rotation), the grammar workers' pipes and the logs. Clients that hold many
connections open must not take the last of them: an audit log that cannot be opened withholds
every answer (I8). So the frontend raises its soft RLIMIT_NOFILE to the hard limit at start, as
vLLM's frontend does, and serves at most `--max-connections` connections at once (default: the
limit less `FDS_KEPT`); one past that is answered 503 and closed (`server.uvicorn_server`).
"""

from __future__ import annotations

import resource

from kvseal.errors import ConfigError

FDS_KEPT = 256  # descriptors kept from connections: engine links, audit log, grammar workers, logs, model files
_MOST_OPEN_FILES = 1 << 20  # the soft limit asked for when the hard one is unlimited


def open_files_allowed() -> int:
    """The most files this process can be allowed to open: its hard RLIMIT_NOFILE."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _MOST_OPEN_FILES if hard == resource.RLIM_INFINITY else int(hard)


def check_max_connections(max_connections: int | None) -> None:
    """ConfigError for a --max-connections this process cannot hold beside `FDS_KEPT` descriptors."""
    if max_connections is None:
        return
    allowed = open_files_allowed()
    if max_connections < 1 or max_connections + FDS_KEPT > allowed:
        raise ConfigError(f"--max-connections must be from 1 to {max(1, allowed - FDS_KEPT)}: this process may "
                          f"open {allowed} files (ulimit -Hn) and keeps {FDS_KEPT} of them from connections; got "
                          f"{max_connections}")


def raise_open_files_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit where it is lower; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = open_files_allowed()
    if soft == resource.RLIM_INFINITY or soft >= target:
        return target if soft == resource.RLIM_INFINITY else int(soft)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return int(soft)
    return target


def connection_cap(max_connections: int | None, open_files: int) -> int:
    """--max-connections, or by default what `open_files` leaves beside `FDS_KEPT` (at least 1)."""
    return max_connections if max_connections is not None else max(1, open_files - FDS_KEPT)
