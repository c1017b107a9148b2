"""vLLM's flags and LLM(...) arguments without a kvseal setting: taken with a start-up line that
says why nothing changes, or refused by name with what kvseal does instead (kvseal/vllm_compat.py)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import pytest

from kvseal.cli import build_parser
from kvseal.engine_args import engine_args_from
from kvseal.errors import ConfigError
from kvseal.server.config import ServerConfig
from kvseal.vllm_compat import VLLM_OPTIONS, vllm_argument_notes, vllm_notes

# A vLLM command line as its docs and deployment examples write them, with no kvseal setting among these
TAKEN = ["--trust-remote-code", "--enforce-eager", "--enable-chunked-prefill", "--disable-log-stats",
         "--disable-log-requests", "--enable-log-requests", "--no-enable-log-requests", "--swap-space", "4",
         "--download-dir", "/tmp/hub", "--revision", "main", "--load-format", "safetensors", "--kv-cache-dtype",
         "auto", "--tokenizer-mode", "auto", "--guided-decoding-backend", "xgrammar", "--scheduling-policy",
         "fcfs", "--max-logprobs", "20", "-pp", "1", "--data-parallel-size", "1", "--cpu-offload-gb", "0",
         "--max-seq-len-to-capture", "8192", "--disable-custom-all-reduce", "--disable-fastapi-docs",
         "--response-role", "assistant"]


def _serve(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_a_vllm_command_line_is_taken_and_each_flag_says_why_it_changes_nothing() -> None:
    ns = _serve(*TAKEN)
    notes = vllm_notes(ns)
    assert len(notes) == sum(arg.startswith("-") for arg in TAKEN)
    assert "vLLM's --trust-remote-code is taken and changes nothing: kvseal runs no code from a model folder" \
        in notes[0]
    assert any(note.startswith("vLLM's --swap-space 4 is taken") and "recomputes" in note for note in notes)
    assert any(note.startswith("vLLM's --no-enable-log-requests is taken") and "I8" in note for note in notes)
    assert engine_args_from(ns) == engine_args_from(_serve())  # nothing reached the engine's settings
    assert ServerConfig.from_namespace(ns) == ServerConfig.from_namespace(_serve())


@pytest.mark.parametrize(("argv", "said"), [
    (["--kv-cache-dtype", "fp8"], "vLLM's --kv-cache-dtype fp8 is not supported: the KV cache is kept in --dtype"),
    (["--pipeline-parallel-size", "2"], "--tensor-parallel-size only"),
    (["-dp", "2"], "one per replica"),
    (["--enable-lora"], "no LoRA adapters"),
    (["--no-enable-chunked-prefill"], "vLLM's --no-enable-chunked-prefill is not supported: kvseal always splits"),
    (["--speculative-config", '{"method": "ngram"}'], "no speculative decoding"),
    (["--max-logprobs", "50"], "fixed at 20"),
    (["--tokenizer-mode", "mistral"], "fast tokenizer"),
    (["--load-format", "pt"], "safetensors folders and .gguf files"),
    (["--scheduling-policy", "priority"], "no priorities"),
    (["--cpu-offload-gb", "4"], "every weight on the engine's device"),
])
def test_a_vllm_flag_kvseal_cannot_honour_stops_parsing_by_name(
        argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        _serve(*argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert said in err and "unrecognized arguments" not in err


def test_every_vllm_flag_is_hidden_from_help_and_none_shadows_a_kvseal_flag() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    kvseal_options = {o for a in serve._actions if a.dest != "vllm_notes" for o in a.option_strings}
    for option in VLLM_OPTIONS:
        assert option.flag not in kvseal_options
        assert option.flag not in serve.format_help()


def test_vllms_prefix_caching_switches_set_kvseals() -> None:
    assert engine_args_from(_serve()).enable_prefix_caching
    assert not engine_args_from(_serve("--no-enable-prefix-caching")).enable_prefix_caching
    assert not engine_args_from(_serve("--no-prefix-caching")).enable_prefix_caching
    assert engine_args_from(_serve("--no-prefix-caching", "--enable-prefix-caching")).enable_prefix_caching


def test_uvicorn_log_level_is_the_http_servers_and_defaults_to_the_log_level() -> None:
    assert ServerConfig.from_namespace(_serve()).uvicorn_log_level is None
    assert ServerConfig.from_namespace(_serve("--uvicorn-log-level", "warning")).uvicorn_log_level == "warning"


def test_llm_arguments_from_vllm_are_taken_or_refused_before_anything_loads() -> None:
    arguments: dict[str, Any] = {"trust_remote_code": True, "enforce_eager": True, "enable_chunked_prefill": None,
                                 "speculative_config": None, "enable_lora": False, "max_model_len": 64}
    notes = vllm_argument_notes(arguments)
    assert arguments == {"max_model_len": 64}  # kvseal's own argument stays for EngineArgs
    assert [note.split(" is taken")[0] for note in notes] == [
        "vLLM's trust_remote_code=True", "vLLM's enforce_eager=True", "vLLM's enable_chunked_prefill=None",
        "vLLM's speculative_config=None", "vLLM's enable_lora=False"]
    from kvseal import LLM
    for refused, said in (({"enable_chunked_prefill": False}, "enable_chunked_prefill=False is not supported: kvseal "
                                                              "always splits long prompts"),
                          ({"kv_cache_dtype": "fp8_e4m3"}, "kept in --dtype"),
                          ({"speculative_config": {"method": "ngram"}}, "no speculative decoding")):
        with pytest.raises(ConfigError, match=said):
            LLM("/nonexistent/model", **refused)  # refused by name before the missing model is noticed


def test_an_llm_made_with_vllms_usual_arguments_runs(make_llm: Callable[..., Any],
                                                     caplog: pytest.LogCaptureFixture) -> None:
    from kvseal import SamplingParams
    with caplog.at_level("INFO", logger="kvseal"):
        llm = make_llm(trust_remote_code=True, enforce_eager=True, swap_space=4, disable_log_stats=True)
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
        assert len(out.token_ids) == 4
    finally:
        llm.engine.close()
    assert "vLLM's trust_remote_code=True is taken and changes nothing" in caplog.text
