"""The PD command line: `kvseal serve --pd` runs one engine of each role and the frontend in
one command and equals colocated generation; bad PD flags are refused before anything starts."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest
from pd_servers import ENGINE_FLAGS, LinkKeyFiles, Proc
from processes import free_port
from transports import NIXL

from kvseal import LLM, SamplingParams
from kvseal.cli import main
from kvseal.disagg.topology import num_usable_cores, pd_threads

FLAGS = [*ENGINE_FLAGS, "--kv-cache-tokens", "1024", "--max-model-len", "512"]


@pytest.fixture
def decode_keys(tmp_path: Path) -> list[str]:
    """The key flags a decode engine needs (every engine link is authenticated)."""
    keys = LinkKeyFiles.in_folder(tmp_path)
    return keys.engine_flags("decode")


@pytest.mark.parametrize(("argv", "what"), [
    (["serve", "--prefill", "127.0.0.1:9"], "--decode"),  # no --decode
    (["serve", "--decode", "127.0.0.1:9"], "--prefill"),  # no --prefill
    (["serve", "--pd", "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:10"], "--pd starts its own"),
    (["serve", "--prefill", "nonsense", "--decode", "127.0.0.1:9"], "not HOST:PORT"),
    (["engine", "--role", "decode", "--listen", "127.0.0.1"], "--listen"),  # no port
    # digits `str.isdigit` takes but `int` does not (a ValueError's traceback before)
    (["engine", "--role", "decode", "--listen", "127.0.0.1:\u00b2"], "--listen"),
    (["serve", "--prefill", "127.0.0.1:\u00b2", "--decode", "127.0.0.1:9"], "not HOST:PORT"),
    (["engine", "--role", "decode", "--listen", "127.0.0.1:9", "--reservation-timeout-s", "0"],
     "--reservation-timeout-s"),
])
def test_bad_pd_flags_are_refused_before_anything_starts(argv: list[str], what: str, decode_keys: list[str],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, *decode_keys] if argv[0] == "engine" else argv) == 2
    err = capsys.readouterr().err
    assert "kvseal: error:" in err and what in err, err


@pytest.mark.parametrize(("argv", "flag"), [
    (["engine", "--role", "decode", "--listen", "127.0.0.1:9", "--threads", "0"], "--threads"),
    (["serve", "--pd", "--pd-threads", "0,1"], "--pd-threads"),
    (["serve", "--pd", "--pd-threads", "2"], "--pd-threads"),
    (["serve", "--pd", "--pd-threads", "\u00b2,1"], "--pd-threads"),
    (["serve", "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:10", "--pd-threads", "1,1"], "--pd-threads"),
])
def test_bad_thread_counts_are_refused_naming_the_flag(argv: list[str], flag: str, decode_keys: list[str],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, *decode_keys] if argv[0] == "engine" else argv) == 2
    assert f"kvseal: error: {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("kv_transport", ["tcp-stream", NIXL])  # tcp: in-process tests
def test_serve_pd_runs_both_roles_and_equals_colocated(tmp_path: Path, kv_transport: str) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent.parent / "server"))
    from tiny_server_model import make_server_model

    model = make_server_model(tmp_path / "tiny")
    port = free_port()
    argv = ["serve", "--pd", "--model", str(model), "--port", str(port), "--kv-transport", kv_transport, *FLAGS]
    server = Proc("serve-pd", argv, tmp_path).start()
    url = f"http://127.0.0.1:{port}"
    try:
        server.wait_until_healthy(url)
        prompt = "w100 w101 w102 w7 w8 w9 w10 w11 w12 w13"
        body = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0},
                          timeout=60).json()
        assert body["choices"][0]["finish_reason"] == "length"
        llm = LLM(str(model), kv_cache_tokens=1024, max_model_len=512, page_size=4, dtype="float32")
        expected = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].text
        assert body["choices"][0]["text"] == expected
    finally:
        assert server.terminate() == 0
    engine_pids = [int(p) for p in re.findall(r"engine \(pid (\d+)\)", server.log())]
    assert len(engine_pids) == 2
    # the two engines split the cores (auto) instead of each running one thread per core
    threads = dict(re.findall(r"role=(prefill|decode) .*torch threads (\d+)", server.log()))
    assert (int(threads["prefill"]), int(threads["decode"])) == pd_threads("auto", num_usable_cores())
    for pid in engine_pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # both engines exited with the frontend


@pytest.mark.parametrize(("num_cores", "expected"), [(1, (1, 1)), (2, (1, 1)), (3, (2, 1)), (16, (8, 8))])
def test_pd_threads_auto_never_oversubscribes(num_cores: int, expected: tuple[int, int]) -> None:
    assert pd_threads("auto", num_cores) == expected
    assert pd_threads("3,2", num_cores) == (3, 2)  # explicit counts are taken as given
