"""Every flag of serve, engine, generate and plan is a config dataclass field's (kvseal/flags.py):
defined once, the same name, type and default wherever it appears."""

from __future__ import annotations

import argparse

import pytest

from kvseal.cli import GenerateArgs, PlanArgs, build_parser, main
from kvseal.config import EngineArgs
from kvseal.disagg.config import EngineKeyFiles, NodeConfig, PdServeArgs
from kvseal.engine.supervisor import RestartPolicy
from kvseal.engine_args import engine_args_from
from kvseal.errors import ConfigError
from kvseal.flags import flag_fields
from kvseal.server.config import ServerConfig

CONFIGS = (EngineArgs, ServerConfig, PdServeArgs, NodeConfig, EngineKeyFiles, GenerateArgs, PlanArgs, RestartPolicy)
COMMANDS = ("serve", "engine", "generate", "plan")


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


def _flag_dests() -> set[str]:
    return {f.name for config in CONFIGS for f in flag_fields(config)}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_is_a_config_field(command: str) -> None:
    # (api_key: vLLM's --api-key, refused by name and never a setting: server/config.py; vllm_notes: vLLM's
    # flags without a kvseal setting, taken or refused by name: kvseal/vllm_compat.py)
    dests = {a.dest for a in _subparser(command)._actions} - {"help", "model_positional", "api_key", "vllm_notes"}
    assert dests <= _flag_dests(), f"flags of {command} defined outside a config dataclass: {dests - _flag_dests()}"


@pytest.mark.parametrize("command", COMMANDS)
def test_no_flag_is_defined_twice(command: str) -> None:
    options = [o for a in _subparser(command)._actions for o in a.option_strings]
    assert len(options) == len(set(options))


def test_plan_takes_serves_names_and_defaults() -> None:
    plan, serve = _subparser("plan"), _subparser("serve")
    serve_defaults = {a.dest: a.default for a in serve._actions if a.default != argparse.SUPPRESS}
    for action in plan._actions:
        if action.dest in serve_defaults and action.default != argparse.SUPPRESS:
            assert action.default == serve_defaults[action.dest], action.dest
    plan_options = {o for a in plan._actions for o in a.option_strings}
    assert {"--kv-cache-memory", "--dtype", "--kv-cache-tokens", "--page-size"} <= plan_options
    assert next(a.default for a in plan._actions if a.dest == "dtype") == "auto"


def test_plan_says_what_auto_assumes_and_kv_memory_still_works(capsys: pytest.CaptureFixture[str]) -> None:
    dims = ["--num-layers", "2", "--num-kv-heads", "1", "--head-dim", "4", "--max-model-len", "8"]
    assert main(["plan", *dims, "--kv-memory", "64KiB"]) == 0
    captured = capsys.readouterr()
    assert "--kv-memory is deprecated; use --kv-cache-memory" in captured.err
    assert "bfloat16 (2 bytes); auto: plan cannot probe" in captured.out
    assert main(["plan", *dims, "--kv-cache-memory", "64KiB", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "float32 (4 bytes)" in out and "auto" not in out


def test_serve_takes_the_model_as_a_positional_argument_or_as_model() -> None:
    parser = build_parser()
    assert engine_args_from(parser.parse_args(["serve", "/models/m"])).model == "/models/m"
    assert engine_args_from(parser.parse_args(["serve", "--model", "/models/m"])).model == "/models/m"
    with pytest.raises(Exception, match="given twice"):
        engine_args_from(parser.parse_args(["serve", "/models/a", "--model", "/models/b"]))


def test_the_engine_threads_flag_feeds_the_engine_and_the_node() -> None:
    ns = build_parser().parse_args(["engine", "--role", "prefill", "--listen", "127.0.0.1:9", "--threads", "3"])
    assert engine_args_from(ns).num_threads == 3 and ns.num_threads == 3


def test_llm_takes_the_field_names() -> None:
    names = {f.name for f in flag_fields(EngineArgs)}
    assert {"kv_cache_memory", "max_model_len", "num_threads", "enable_prefix_caching"} <= names


@pytest.mark.parametrize("flags", [["--threads", "100000"], ["--grammar-compile-workers", "100000"]])
def test_thread_and_worker_counts_have_a_ceiling(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # 100000 OpenMP threads crashed the process (SIGSEGV) instead of refusing the flag
    assert main(["generate", "hi", "--model", "/no/such/model", *flags]) == 2
    assert "from 1 to 1024" in capsys.readouterr().err


def test_pd_threads_have_a_ceiling() -> None:
    from kvseal.disagg.topology import pd_threads
    assert pd_threads("1024,1", 2) == (1024, 1)
    with pytest.raises(ConfigError, match="from 1 to 1024"):
        pd_threads("100000,1", 2)


@pytest.mark.parametrize("temperature", ["inf", "-inf", "nan", "-1"])
def test_generate_refuses_a_temperature_that_is_not_a_finite_number_ge_0(
        temperature: str, capsys: pytest.CaptureFixture[str]) -> None:
    # inf was accepted; refused before the model loads (the model path does not exist)
    assert main(["generate", "hi", "--model", "/no/such/model", f"--temperature={temperature}"]) == 2
    assert "kvseal: error: invalid temperature: must be a finite number >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["", "  "])
def test_serve_refuses_an_empty_served_model_name(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "/no/such/model", "--served-model-name", name, "--port", "0"]) == 2
    assert "kvseal: error: --served-model-name must name the model" in capsys.readouterr().err
