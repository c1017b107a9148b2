"""Model loading refuses what it cannot load, naming the file and what is supported."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvseal import ModelLoadError
from kvseal.cli import main
from kvseal.model_files import resolve_model_path
from kvseal.models.loader import load_model


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path(tmp_path / "nope")


def test_folder_without_model_files(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_path(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_model_path(tmp_path / "weights.bin")


def test_corrupt_weights_name_the_file(llama_dir: Path, tmp_path: Path) -> None:
    model = _copy(llama_dir, tmp_path / "m")
    (model / "model.safetensors").write_bytes(b"this is not a safetensors file")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(str(model), torch.float32)


def test_missing_tensor_is_named(llama_dir: Path, tmp_path: Path) -> None:
    model = _copy(llama_dir, tmp_path / "m")
    state = load_file(str(model / "model.safetensors"))
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, str(model / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.layers.1.self_attn.k_proj.weight"):
        load_model(str(model), torch.float32)


def test_unsupported_architecture_lists_supported(llama_dir: Path, tmp_path: Path) -> None:
    model = _copy(llama_dir, tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(str(model), torch.float32)


def test_cli_generate_prints_the_completion(llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--model", str(llama_dir), "--dtype", "float32", "--kv-cache-tokens", "512",
               "--max-tokens", "3", "w10 w11 w12"])
    out = capsys.readouterr().out.strip()
    assert rc == 0 and len(out.split()) == 3 and all(w.startswith("w") for w in out.split())


def test_cli_generate_takes_the_sampling_flags(llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--stop, --min-tokens, --ignore-eos, --top-k and --top-p reach the request: greedy output
    cut at its third word by --stop, and the same output from top-k 1 sampling."""
    base = ["generate", "--model", str(llama_dir), "--dtype", "float32", "--kv-cache-tokens", "512", "w10 w11 w12"]
    assert main([*base, "--max-tokens", "6", "--ignore-eos", "--min-tokens", "6"]) == 0
    words = capsys.readouterr().out.split()
    assert len(words) == 6
    assert main([*base, "--max-tokens", "6", "--ignore-eos", "--stop", words[2], "--stop", "w9999"]) == 0
    assert capsys.readouterr().out.split() == words[:words.index(words[2])]
    assert main([*base, "--max-tokens", "6", "--ignore-eos", "--temperature", "1", "--top-k", "1",
                 "--top-p", "0.5"]) == 0
    assert capsys.readouterr().out.split() == words
    assert main([*base, "--top-k", "-2"]) == 2
    assert "invalid top_k" in capsys.readouterr().err


def test_cli_generate_rejects_an_over_long_prompt(llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--model", str(llama_dir), "--dtype", "float32", "--kv-cache-tokens", "64",
               "--max-model-len", "64", " ".join(f"w{i}" for i in range(10, 80))])
    assert rc == 2 and "maximum context length is 64" in capsys.readouterr().err


def test_reading_a_config_leaves_transformers_model_loading_unimported(llama_dir: Path) -> None:
    """An engine reads its model's config without importing transformers' activation functions
    (and, with them, its model-loading code and torch.distributed.tensor: a second of every
    engine start), while the config validators that check an activation's name still check it."""
    probe = (
        "import sys\n"
        "from kvseal.models.loader import folder_config\n"
        f"assert folder_config({str(llama_dir)!r}).architecture == 'LlamaForCausalLM'\n"
        "assert 'transformers.activations' not in sys.modules, 'activations imported'\n"
        "assert 'torch.distributed.tensor' not in sys.modules, 'torch.distributed.tensor imported'\n"
        "from transformers.utils.type_validators import ACT2FN\n"
        "assert 'silu' in ACT2FN and 'no-such-activation' not in ACT2FN and len(ACT2FN) > 0\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
