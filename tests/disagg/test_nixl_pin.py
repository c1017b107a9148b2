"""The one workaround of NIXL's internals (`kvseal.disagg.nixl.progress_delay`) rests on the pinned
version: the extra pins it, and that version's agent is built the way the workaround assumes."""

from __future__ import annotations

import importlib.metadata
import inspect
import tomllib
from pathlib import Path

from transports import needs_nixl

from kvseal.disagg.nixl import NIXL_PINNED

ROOT = Path(__file__).resolve().parents[2]


def test_the_nixl_extra_pins_the_version_the_workaround_was_written_for() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["nixl"] == [f"nixl=={NIXL_PINNED}"]


@needs_nixl
def test_the_pinned_nixl_builds_its_agent_as_the_workaround_assumes() -> None:
    from nixl._api import nixl_agent

    assert importlib.metadata.version("nixl") == NIXL_PINNED
    source = inspect.getsource(nixl_agent.__init__)
    assert "agent_config.pthrDelay = 0" in source  # no delay of its own, and no setting for one
    assert "self.agent = nixlBind.nixlAgent(agent_name, agent_config)" in source  # where the delay is set
