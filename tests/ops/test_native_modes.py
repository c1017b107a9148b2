"""`--native auto|require|off`: which ops an engine runs, and what happens without a compiler.

The compiler is `$CC` (else `cc`), a setting the start-up log names; pointing it at a file that
does not exist stands for a host without one. `require` then fails start-up with the reason (the
missing compiler, by name), `auto` warns and serves with the torch ops, and `off` never runs a
compiler and serves with the torch ops: end to end, offline and through `kvseal serve`, the same
greedy tokens as the native kernels."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from built_kernels import KERNELS
from processes import LoggedProcess, free_port, kvseal_argv

from kvseal import ConfigError, SamplingParams
from kvseal.cli import main as cli_main
from kvseal.config import EngineArgs
from kvseal.ops import TorchOps, select_ops
from kvseal.ops.native_backend import NativeOps
from kvseal.ops.native_build import BuildConfig

MISSING = "/nonexistent/kvseal-test-cc"
PROMPTS = [list(range(20, 32)), list(range(50, 90)), [7, 8]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_the_compiler_is_cc_or_dollar_cc_and_says_which(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", MISSING)
    assert BuildConfig.from_environment().compiler == MISSING
    assert f"compiler {MISSING} (from $CC)" in BuildConfig.from_environment().describe()
    monkeypatch.delenv("CC")
    assert "(from $CC)" not in BuildConfig.from_environment().describe()


def test_require_without_a_compiler_fails_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", MISSING)
    with pytest.raises(ConfigError, match=f"--native require: .*{MISSING}.*did not run") as failed:
        select_ops("require")
    assert "--native off" in str(failed.value), "the message says what to do"


def test_auto_without_a_compiler_warns_and_runs_the_torch_ops(monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CC", MISSING)
    with caplog.at_level(logging.WARNING, logger="kvseal"):
        ops = select_ops("auto")
    assert isinstance(ops, TorchOps)
    assert any(MISSING in record.getMessage() and "ops: torch" in record.getMessage() for record in caplog.records)


def test_off_runs_no_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", MISSING)
    assert isinstance(select_ops("off"), TorchOps)


def test_a_bad_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="native must be one of auto, require, off; got 'on'"):
        EngineArgs(native="on")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="native must be one of"):
        select_ops("on")  # type: ignore[arg-type]


def test_require_fails_engine_start_up_offline_and_from_the_cli(make_llm: Callable[..., Any],
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CC", MISSING)
    with pytest.raises(ConfigError, match=MISSING):
        make_llm(native="require")
    assert cli_main(["generate", "--native", "require", "hi"]) == 2
    assert MISSING in capsys.readouterr().err


def test_off_serves_offline_with_the_native_kernels_tokens(make_llm: Callable[..., Any],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", MISSING)  # off: no compiler is ever asked for
    torch_llm = make_llm(native="off")
    assert isinstance(torch_llm.engine.ops, TorchOps)
    torch_out = torch_llm.generate(PROMPTS, GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in torch_out)
    torch_llm.engine.check_integrity()
    if KERNELS is None:
        return
    monkeypatch.delenv("CC")
    native_llm = make_llm(native="require")
    assert isinstance(native_llm.engine.ops, NativeOps)
    assert [o.token_ids for o in native_llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in torch_out]


def _serve(llama_dir: Path, tmp_path: Path, native: str) -> tuple[LoggedProcess, str]:
    port = free_port()
    argv = kvseal_argv(["serve", "--model", str(llama_dir), "--port", str(port), "--native", native,
                        "--kv-cache-tokens", "512", "--page-size", "4", "--dtype", "float32", "--threads", "1"])
    return LoggedProcess(f"kvseal serve --native {native}", argv, tmp_path / f"serve-{native}.log"), \
        f"http://127.0.0.1:{port}"


def test_serve_with_native_off_answers_and_require_without_a_compiler_does_not_start(
        llama_dir: Path, tmp_path: Path, make_llm: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", MISSING)
    server, url = _serve(llama_dir, tmp_path, "off")
    server.spawn()
    try:
        server.wait_until_healthy(url)
        body = {"model": "m", "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"{url}/v1/completions", json={**body, "model": _model_id(url)}, timeout=60)
        assert answer.status_code == 200, answer.text
        text = answer.json()["choices"][0]["text"]
    finally:
        server.terminate()
    assert "ops=torch" in server.log()
    assert text == make_llm(native="off").generate([PROMPTS[1]], GREEDY)[0].text
    refused, _ = _serve(llama_dir, tmp_path, "require")
    refused.spawn()
    assert refused.proc is not None
    status = refused.proc.wait(timeout=180)
    assert status != 0 and MISSING in refused.log(), refused.log()[-2000:]


def _model_id(url: str) -> str:
    return str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])
