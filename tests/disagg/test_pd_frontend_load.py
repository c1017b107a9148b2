"""The PD frontend's summed load: pages scrubbed (I7) is counted over every engine instance it
heard from, so it does not drop when an engine goes down or restarts with its count at 0, and
the scrub mode names each role's policy where the engines differ."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from processes import free_port

from kvseal.disagg.frontend import PdClient, scrub_policy
from kvseal.disagg.link_keys import EngineEndpoint, KeyPair
from kvseal.disagg.msgs import EngineInfoMsg, PdStatsMsg, Role
from kvseal.messages.msgs import EngineStatsMsg


@pytest.fixture
def client() -> Iterator[PdClient]:
    engines = [EngineEndpoint(f"127.0.0.1:{free_port()}", KeyPair.ephemeral(role).public) for role in ("p", "d")]
    pd = PdClient(engines[:1], engines[1:], "/tokenizer", KeyPair.ephemeral("frontend"))
    yield pd
    asyncio.run(pd.shutdown(timeout_s=0))


def _stats(instance_id: str, role: Role, num_pages_scrubbed: int, num_violations: int = 0) -> PdStatsMsg:
    engine = EngineStatsMsg(0, 0, 0, 64, 0, num_violations, num_pages_scrubbed)
    return PdStatsMsg(instance_id, role, engine, 64, 0, 0, 0, 0.0, {}, 0, {}, 0)


def test_pages_scrubbed_sums_engines_and_never_drops(client: PdClient) -> None:
    prefill, decode = client.links
    prefill.is_up = decode.is_up = True
    client._on_msg(prefill, _stats("prefill-1", "prefill", 5, num_violations=1))
    client._on_msg(decode, _stats("decode-1", "decode", 3))
    client._on_msg(prefill, _stats("prefill-1", "prefill", 8, num_violations=1))
    load = client.load()
    assert (load.num_pages_scrubbed, load.num_isolation_violations) == (11, 1)
    client._engine_down(prefill, "test: the prefill engine went away")
    assert client.load().num_pages_scrubbed == 11, "a down engine's scrubbed pages stay counted"
    prefill.is_up = True
    client._on_msg(prefill, _stats("prefill-2", "prefill", 2))  # restarted: counts from 0 again
    assert client.load().num_pages_scrubbed == 13


def _info(role: Role, policy: str) -> EngineInfoMsg:
    return EngineInfoMsg(role, "127.0.0.1:1", f"{role}-1", 1, "m", "/m", "llama", 64, 256, 512, 4, 64,
                         "layout", "tcp", policy)


def test_the_scrub_policy_names_each_role_where_they_differ() -> None:
    assert scrub_policy([_info("prefill", "free"), _info("decode", "free")]) == "free"
    assert scrub_policy([_info("prefill", "free"), _info("decode", "off")]) == "decode=off,prefill=free"
