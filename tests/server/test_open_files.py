"""The frontend's open-files limit and its connection cap (kvseal/server/open_files.py)."""

from __future__ import annotations

import resource

import pytest

from kvseal.errors import ConfigError
from kvseal.server.config import ServerConfig
from kvseal.server.open_files import (
    FDS_KEPT,
    check_max_connections,
    connection_cap,
    open_files_allowed,
    raise_open_files_limit,
)


def test_a_cap_the_process_cannot_hold_beside_its_own_descriptors_is_refused_at_start() -> None:
    allowed = open_files_allowed()
    check_max_connections(allowed - FDS_KEPT)
    for bad in (0, allowed - FDS_KEPT + 1):
        with pytest.raises(ConfigError, match=f"--max-connections must be from 1 to {allowed - FDS_KEPT}"):
            ServerConfig(max_connections=bad)


def test_the_soft_limit_is_raised_to_the_hard_one_and_the_default_cap_keeps_descriptors_back() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        if hard != resource.RLIM_INFINITY and hard > 512:
            resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
        open_files = raise_open_files_limit()
        assert open_files == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if hard != resource.RLIM_INFINITY:
            assert open_files == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert connection_cap(None, open_files) == open_files - FDS_KEPT
    assert connection_cap(None, 100) == 1 and connection_cap(7, open_files) == 7
