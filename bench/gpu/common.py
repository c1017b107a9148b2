"""Shared by the GPU bench helpers: random-weight models made from a config on the device (one
transformers model and kvseal's engine over the same weights, nothing written to disk), and the
JSON results under $OUT."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedTokenizerFast  # noqa: E402

from kvseal.config import EngineArgs, ModelConfig  # noqa: E402
from kvseal.engine.engine import LLMEngine  # noqa: E402
from kvseal.models.loader import LoadedModel, model_from_state_dict  # noqa: E402

# The shapes the issue names: Llama-3-8B and Llama-3.2-1B (random weights, bf16 on the GPU), and
# a tiny one for the CPU dry run.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=False),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False),
}


def out_dir() -> Path:
    path = Path(os.environ.get("OUT") or ROOT / "out-gpu")
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(name: str, data: Any) -> None:
    (out_dir() / name).write_text(json.dumps(data, indent=2, default=str))
    print(json.dumps(data, default=str)[:2000], flush=True)


def shape_config(shape: str, max_positions: int = 4096) -> LlamaConfig:
    return LlamaConfig(**SHAPES[shape], max_position_embeddings=max_positions, rms_norm_eps=1e-5,
                       eos_token_id=1, bos_token_id=2)


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with one word per id ("w0".."wN"), so any sampled id decodes."""
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w1", bos_token="w2", unk_token="w0")


@dataclass
class Pair:
    """One random-weight model as transformers runs it and as kvseal's engine runs it."""

    hf: Any
    loaded: LoadedModel
    config: ModelConfig


def random_pair(hf_config: PretrainedConfig, device: str, dtype: torch.dtype, seed: int = 0) -> Pair:
    """transformers' model of `hf_config` with random weights made on `device`, and kvseal's
    model packed from the same tensors (a copy: both stay usable)."""
    torch.manual_seed(seed)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    config = ModelConfig.from_hf(hf_config)
    state = {k: v for k, v in hf.state_dict().items() if "rotary_emb" not in k}
    model = model_from_state_dict(config, state, dtype, f"random {config.architecture}")
    loaded = LoadedModel(model, config, word_tokenizer(config.vocab_size), f"random-{config.architecture}",
                         Path("random"))
    return Pair(hf, loaded, config)


def engine_for(pair: Pair, device: str, dtype: torch.dtype, **kwargs: Any) -> LLMEngine:
    dtype_name = str(dtype).removeprefix("torch.")
    return LLMEngine(EngineArgs(device=device, dtype=dtype_name, native="off", **kwargs), loaded=pair.loaded)


def environment() -> dict[str, Any]:
    import transformers
    import triton

    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
                            "transformers": transformers.__version__, "python": sys.version.split()[0],
                            "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        info |= {"gpu": torch.cuda.get_device_name(), "gpu_total_gib": total / 2**30, "gpu_free_gib": free / 2**30}
    return info
