"""I2: start-up refuses a pool that cannot hold one full-length request; `kvseal plan`."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvseal import ConfigError
from kvseal.capacity import KvCapacity, parse_bytes
from kvseal.cli import main
from kvseal.config import EngineArgs

INCIDENT_DIMS = ["--num-layers", "64", "--num-kv-heads", "8", "--head-dim", "128", "--tp", "8", "--dtype", "bf16"]


def test_parse_bytes() -> None:
    assert parse_bytes("64GiB") == 64 * 2**30
    assert parse_bytes("500MB") == 500 * 10**6
    assert parse_bytes(1234) == 1234
    with pytest.raises(ConfigError, match="cannot read"):
        parse_bytes("lots")


def test_capacity_arithmetic() -> None:
    cap = KvCapacity.for_dims(num_layers=30, num_kv_heads=3, head_dim=64, element_bytes=2, page_size=16)
    assert cap.bytes_per_token == 2 * 30 * 3 * 64 * 2
    cap = cap.with_memory(10 * cap.page_bytes + 1)
    assert (cap.num_pages, cap.pool_tokens) == (10, 160)
    assert cap.with_tokens(161).num_pages == 11


def test_plan_refuses_the_incident_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    # 681,280 tokens x 32,768 bytes per token (64 layers, 1 KV head per rank, dim 128, bf16).
    rc = main(["plan", *INCIDENT_DIMS, "--kv-memory", str(681_280 * 32_768), "--max-model-len", "1048576"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "681,280 tokens" in out and "32,768" in out and "REFUSED" in out
    assert "1048576" in out and "max_model_len=auto" in out


def test_plan_accepts_twice_the_context(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", *INCIDENT_DIMS, "--kv-memory", "64GiB", "--max-model-len", "1048576", "--kv-headroom", "2"])
    out = capsys.readouterr().out
    assert rc == 0 and "2,097,152 tokens" in out and "OK" in out


def test_plan_reads_config_json_without_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 100, "hidden_size": 1024,
        "intermediate_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    }))
    rc = main(["plan", "--model", str(tmp_path), "--kv-memory", "1GiB", "--max-model-len", "32768"])
    out = capsys.readouterr().out
    assert rc == 0 and f"{2 * 24 * 2 * 64 * 2:,}" in out


def _config_folder(folder: Path, **extra: Any) -> Path:
    """A model folder of config.json alone (no weights: plan reads none), 256 positions."""
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, **extra,
    }))
    return folder


def test_plan_resolves_max_model_len_as_serve_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No --max-model-len: the model's; auto: clamped to the pool; each printed with where it came from."""
    model = str(_config_folder(tmp_path))
    assert main(["plan", "--model", model, "--kv-cache-tokens", "1024"]) == 0
    out = capsys.readouterr().out
    assert "256 (the model's max_position_embeddings)" in out and "OK" in out
    assert main(["plan", "--model", model, "--kv-cache-tokens", "100", "--max-model-len", "auto"]) == 0
    out = capsys.readouterr().out  # 100 tokens are 7 pages of 16: 112 tokens, as the engine's pool
    assert "112 (auto: the model allows 256, the pool holds 112 tokens" in out and "OK" in out


@pytest.mark.parametrize(("extra", "flags"), [
    ({}, ["--max-model-len", "100000"]),  # beyond the model's positions
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 64}, []),
])
def test_plan_refuses_the_max_model_len_serve_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      extra: dict[str, Any], flags: list[str]) -> None:
    """The same refusal as serve's start-up, word for word, and exit 2; plan used to print OK."""
    from kvseal.models.loader import plan_config

    model = _config_folder(tmp_path, **extra)
    args = ["--kv-cache-tokens", "200000", *flags]
    assert main(["plan", "--model", str(model), *args]) == 2
    captured = capsys.readouterr()
    with pytest.raises(ConfigError) as serve:
        EngineArgs(model=str(model), kv_cache_tokens=200000,
                   max_model_len=int(flags[1]) if flags else None).resolve(plan_config(model))
    assert f"kvseal: error: {serve.value}\n" in captured.err and "OK" not in captured.out


def test_plan_plans_for_the_default_model(capsys: pytest.CaptureFixture[str]) -> None:
    """No --model: serve's default model, as --help says; plan used to refuse."""
    from kvseal.model_files import default_model_path

    assert main(["plan", "--max-model-len", "2048", "--kv-cache-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert f"{default_model_path()} (the default model)" in out and "2,048 (--max-model-len)" in out


def test_plan_with_dimensions_alone_needs_a_max_model_len(capsys: pytest.CaptureFixture[str]) -> None:
    """No model to take the default from: a flag error that says what to give, never a guess."""
    assert main(["plan", "--num-layers", "2", "--num-kv-heads", "1", "--head-dim", "4"]) == 2
    assert "give --max-model-len N, or --model in place of the dimensions" in capsys.readouterr().err


def test_startup_refuses_small_pool_naming_both_numbers(make_llm: Callable[..., Any]) -> None:
    with pytest.raises(ConfigError) as info:
        make_llm(kv_cache_tokens=100, max_model_len=200)
    message = str(info.value)
    assert "100 tokens" in message and "200" in message and "bytes per token" in message
    assert "max_model_len=auto" in message


def test_headroom_is_enforced(make_llm: Callable[..., Any]) -> None:
    with pytest.raises(ConfigError, match="headroom 2.0"):
        make_llm(kv_cache_tokens=256, max_model_len=200, kv_headroom=2.0)


def test_auto_clamps_context_to_pool(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(kv_cache_tokens=100, max_model_len="auto")
    assert llm.engine.scheduler_config.max_model_len == 100
    assert llm.engine.limits.max_prompt_tokens == 100


def test_max_model_len_beyond_the_model_is_refused(make_llm: Callable[..., Any]) -> None:
    with pytest.raises(ConfigError, match="max_position_embeddings=256"):
        make_llm(kv_cache_tokens=1024, max_model_len=512)


@pytest.mark.parametrize(("kwargs", "said"), [
    (dict(page_size="16"), "page_size (--page-size) must be an integer; got '16'"),
    (dict(enable_prefix_caching="no"),
     "enable_prefix_caching (--enable-prefix-caching) must be true or false; got 'no'"),
    (dict(check_kv=1), "check_kv (--check-kv) must be true or false; got 1"),
    (dict(max_model_len=128.5), "max_model_len (--max-model-len) must be an integer or 'auto' or None; got 128.5"),
    (dict(kv_scrub="sometimes"), "kv_scrub (--kv-scrub) must be 'off' or 'free' or 'alloc'; got 'sometimes'"),
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1, got 0"),
    (dict(model=""), "model is empty"),
])
def test_arguments_of_the_wrong_type_are_refused_by_name(make_llm: Callable[..., Any], kwargs: dict[str, Any],
                                                         said: str) -> None:
    """Not run as something else (a string "no" was a true switch, 128.5 ran as 128) or failed deep inside."""
    with pytest.raises(ConfigError, match=re.escape(said)):
        make_llm(**kwargs)


def test_dtype_takes_torch_dtypes_and_the_flags_aliases() -> None:
    import torch
    assert EngineArgs(dtype=torch.float32).dtype == "float32"
    assert EngineArgs(dtype="bf16").dtype == "bfloat16" and EngineArgs(dtype="half").dtype == "float16"


@pytest.mark.parametrize("flags", [["--max-model-len", "-1"], ["--max-model-len", "0"],
                                   ["--max-model-len", "8", "--kv-cache-tokens", "0"],
                                   ["--max-model-len", "8", "--max-num-seqs", "0"],
                                   ["--max-model-len", "8", "--gpu-memory-utilization", "-1"]])
def test_plan_checks_its_flags_as_serve_does(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A value serve refuses is a kvseal: error (exit 2) in plan too, never an OK plan or a traceback."""
    assert main(["plan", "--num-layers", "2", "--num-kv-heads", "1", "--head-dim", "4", *flags]) == 2
    captured = capsys.readouterr()
    assert "kvseal: error:" in captured.err and "OK" not in captured.out


@pytest.mark.parametrize(("kwargs", "names"), [
    (dict(kv_headroom=float("nan")), ["kv_headroom", "nan"]),
    (dict(kv_headroom=float("inf")), ["kv_headroom", "inf"]),
    (dict(kv_headroom=0.5), ["kv_headroom", "0.5"]),
    (dict(kv_cache_tokens=-5), ["kv_cache_tokens", "-5"]),
    (dict(kv_cache_tokens=0), ["kv_cache_tokens", "got 0"]),
    (dict(kv_cache_tokens=None, kv_cache_memory=-1), ["negative", "-1"]),
    (dict(kv_cache_tokens=None, kv_cache_memory="-5GiB"), ["'-5GiB'"]),
    (dict(kv_cache_tokens=None, kv_cache_memory=100), ["kv_cache_memory=100 bytes holds no KV page"]),
    (dict(max_model_len=0), ["max_model_len", "got 0"]),
    (dict(max_model_len=-3), ["max_model_len", "got -3"]),
])
def test_bad_sizes_are_clear_config_errors(make_llm: Callable[..., Any], kwargs: dict[str, Any],
                                           names: list[str]) -> None:
    """Never a raw ValueError/OverflowError, never advice to lower max_model_len to 0."""
    with pytest.raises(ConfigError) as info:
        make_llm(**kwargs)
    message = str(info.value)
    assert all(name in message for name in names), message
    assert "max_model_len to 0" not in message


def test_a_pool_smaller_than_the_headroom_gives_no_zero_advice() -> None:
    cap = KvCapacity.for_dims(num_layers=2, num_kv_heads=1, head_dim=4, element_bytes=2, page_size=4).with_tokens(4)
    with pytest.raises(ConfigError) as info:
        cap.require_fits(8, headroom=5.0)
    assert "lower max_model_len" not in str(info.value) and "kv_cache_tokens >= 40" in str(info.value)
    with pytest.raises(ConfigError, match="kv_headroom must be a number from 1.0 to 10000"):
        cap.require_fits(8, headroom=float("inf"))


@pytest.mark.parametrize("argv", [["--kv-headroom", "nan"], ["--kv-headroom", "inf"], ["--kv-cache-tokens", "-5"]])
def test_plan_reports_bad_values_without_a_traceback(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", *INCIDENT_DIMS, "--kv-memory", "64GiB", "--max-model-len", "1024", *argv])
    captured = capsys.readouterr()
    said = captured.out + captured.err
    assert rc in (1, 2) and ("kvseal: error:" in said or "REFUSED:" in said)
    assert argv[0].removeprefix("--").replace("-", "_") in said and argv[1] in said
    assert "max_model_len to 0" not in said and "Traceback" not in said


@pytest.mark.parametrize("command", [["plan", *INCIDENT_DIMS, "--kv-memory", "64GiB", "--max-model-len", "100"],
                                     ["generate", "hi", "--model", "/no/such/model"]])
def test_a_huge_headroom_is_a_flag_error(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # 1e308 x max_model_len overflowed to infinity: an OverflowError traceback, not naming the flag
    assert main([*command, "--kv-headroom", "1e308"]) == 2
    assert "kvseal: error: kv_headroom must be a number from 1.0 to 10000" in capsys.readouterr().err


def test_plan_refuses_a_tp_the_kv_heads_cannot_be_replicated_over(capsys: pytest.CaptureFixture[str]) -> None:
    # the engine refuses tp > KV heads unless tp is a multiple of them; plan used to print OK
    dims = ["--num-layers", "2", "--head-dim", "128", "--kv-cache-memory", "1GiB", "--max-model-len", "10"]
    assert main(["plan", *dims, "--num-kv-heads", "2", "--tp", "3"]) == 2
    assert "kvseal: error: tensor_parallel_size=3 exceeds the model's 2 KV heads" in capsys.readouterr().err
    assert main(["plan", *dims, "--num-kv-heads", "2", "--tp", "4"]) == 0  # two replicas of each head
    assert main(["plan", *dims, "--num-kv-heads", "8", "--tp", "3"]) == 0  # split 3, 3, 2, as the engine does
