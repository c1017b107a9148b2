"""An engine whose loop dies of an unexpected error exits non-zero, so that whatever supervises
it restarts it: it must not stay alive serving nothing. The audit's malformed decode key once
ended prefill's loop with a ZMQ socket left open, and the process then hung for ever in
`Context.term()`; the test-only fault reproduces that shape (a link's setup fails with an error
nothing expects, its socket left open) from a well-formed `PrefillMsg`."""

from __future__ import annotations

import secrets
from pathlib import Path

from pd_servers import PREFILL_FLAGS, PdEngine
from processes import WAIT_DEADLINE_S, free_port
from rogue import Rogue

from kvseal.disagg.msgs import PrefillMsg
from kvseal.messages.convert import params_to_msg
from kvseal.types import SamplingParams

PROMPT = list(range(5, 13))  # 8 tokens and the first output token: 3 pages of 4


def test_an_engine_whose_loop_dies_exits_non_zero_instead_of_hanging(marker_dir: Path, tmp_path: Path) -> None:
    prefill = PdEngine("prefill", marker_dir, tmp_path, PREFILL_FLAGS, faults="break_peer_link_setup")
    prefill.start().wait_ready()
    assert prefill.proc is not None
    keys = prefill.keys
    frontend = Rogue(prefill.address, keys.pair("frontend"), keys.pair("prefill").public, handshake_ivl_ms=10_000)
    try:
        assert frontend.handshake() == "succeeded"
        nowhere = f"127.0.0.1:{free_port()}"  # the push fails; telling decode needs a link: the fault
        frontend.send(PrefillMsg("r-1", "alice", PROMPT, params_to_msg(SamplingParams(max_tokens=2)),
                                 secrets.token_hex(16), nowhere, keys.pair("decode").public, "decode", nowhere,
                                 secrets.token_bytes(32), [0, 1, 2]))
        status = prefill.proc.wait(timeout=WAIT_DEADLINE_S)  # hung in Context.term() before the fix
    finally:
        frontend.close()
        prefill.kill()
    assert status != 0
    assert "test fault: the link to" in prefill.log()
