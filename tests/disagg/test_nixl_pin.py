"""NIXL is an optional extra. The one workaround of its internals (`kvseal.disagg.nixl.progress_delay`)
rests on the pinned version: the extra pins it, and that version's agent is built the way the
workaround assumes."""

from __future__ import annotations

import importlib.metadata
import inspect
import sys
import tomllib
from pathlib import Path

import pytest
from transports import needs_nixl

from kvseal.disagg.config import NodeConfig
from kvseal.disagg.link_keys import EngineLinkKeys, KeyPair
from kvseal.disagg.nixl import NIXL_PINNED
from kvseal.errors import ConfigError

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


def test_without_the_extra_the_nixl_transport_is_refused_at_start_up_naming_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before any model loads: NodeConfig is what `kvseal engine` and `serve --pd` build first."""
    monkeypatch.setitem(sys.modules, "nixl", None)  # Python's way of making a package absent
    keys = EngineLinkKeys(KeyPair.ephemeral("prefill"), (KeyPair.ephemeral("frontend").public_key(),))
    with pytest.raises(ConfigError, match=r"pip install 'kvseal\[nixl\]'"):
        NodeConfig("prefill", "127.0.0.1:9", "nixl", link_keys=keys)
    assert NodeConfig("prefill", "127.0.0.1:9", "tcp-stream", link_keys=keys).kv_transport == "tcp-stream"
