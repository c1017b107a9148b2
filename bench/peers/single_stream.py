"""Single-stream decode, side by side: llama.cpp (llama-cpp-python) on the Q4_1 GGUF and kvseal.

Usage:
  python bench/peers/single_stream.py --llama-python ~/.venvs/llama-cpp/bin/python \
      [--gguf PATH] [--prompt-len 256] [--output-len 128] [--threads 2] [--repeats 3] [--json out.json]

Each engine runs in its own fresh process (one after the other, alternating for --repeats
rounds), greedily decodes exactly --output-len tokens after the same --prompt-len-token prompt
(EOS ignored on both sides), after one unrecorded warm-up generation. Reported per run: prefill
seconds (prompt to first token) and decode tokens/s over the remaining tokens. kvseal runs with
this interpreter and its --kvseal-dtype (default: auto); llama.cpp uses the GGUF as quantized.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

LLAMA_CPP_CHILD = r"""
import json, sys, time
from llama_cpp import Llama
a = json.loads(sys.argv[1])
llm = Llama(model_path=a["gguf"], n_ctx=a["prompt_len"] + a["output_len"] + 8, n_threads=a["threads"],
            n_batch=512, verbose=False)
def run():
    llm.reset()
    t0 = time.perf_counter(); times = []
    for _ in llm.generate(a["prompt"], temp=0.0, top_k=1, reset=True):
        times.append(time.perf_counter())
        if len(times) == a["output_len"]:
            break
    return times[0] - t0, (a["output_len"] - 1) / (times[-1] - times[0])
run()
prefill_s, decode_tok_s = run()
import llama_cpp
print(json.dumps({"prefill_s": prefill_s, "decode_tok_s": decode_tok_s,
                  "llama_cpp": "llama-cpp-python " + llama_cpp.__version__}))
"""

KVSEAL_CHILD = r"""
import json, sys, time
import torch
from kvseal.llm import LLM
from kvseal.types import SamplingParams
a = json.loads(sys.argv[1])
torch.set_num_threads(a["threads"])
# no prefix cache: every generation prefills the whole prompt, as llama.cpp's child does after reset
llm = LLM(a["gguf"], dtype=a["dtype"], quantization=a.get("quantization", "none"),
          max_model_len=a["prompt_len"] + a["output_len"] + 8, enable_prefix_caching=False)
def run():
    # prefill alone (1 token), then the whole generation: decode rate from the difference
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    n = a["output_len"]
    full = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter(); llm.generate([a["prompt"]], one); t1 = time.perf_counter()
    llm.generate([a["prompt"]], full); t2 = time.perf_counter()
    prefill_s = t1 - t0
    return prefill_s, (n - 1) / ((t2 - t1) - prefill_s)
run()
prefill_s, decode_tok_s = run()
print(json.dumps({"prefill_s": prefill_s, "decode_tok_s": decode_tok_s}))
"""


def default_gguf() -> str:
    from kvseal.model_files import default_model_path

    return str(default_model_path())


def prompt_ids(gguf: str, prompt_len: int, seed: int) -> list[int]:
    from transformers import AutoTokenizer

    from kvseal.models.loader import convert_gguf

    tok = AutoTokenizer.from_pretrained(str(convert_gguf(Path(gguf))), local_files_only=True)
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    rng = random.Random(seed)
    return [rng.choice(vocab) for _ in range(prompt_len)]


def run_child(python: str, code: str, args: dict, timeout_s: float) -> dict:
    return _run([python, "-c", code, json.dumps(args)], timeout_s)


# llama.cpp through node-llama-cpp's prebuilt binaries (bench/peers/install_llama_cpp_node.sh)
LLAMA_CPP_NODE_RUNNER = Path(__file__).with_name("llama_cpp_node.mjs")


def run_llama_node(node_dir: str, args: dict, timeout_s: float) -> dict:
    """The child protocol of LLAMA_CPP_CHILD, run by node-llama-cpp installed in `node_dir`."""
    return _run(["node", str(LLAMA_CPP_NODE_RUNNER), node_dir, json.dumps(args)], timeout_s)


def _run(argv: list[str], timeout_s: float) -> dict:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-python", required=True, help="python of the venv with llama-cpp-python")
    p.add_argument("--gguf", default=None, help="GGUF file (default: kvseal's default model, Q4_1)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kvseal-dtype", default="auto")
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--json", type=Path, default=None)
    ns = p.parse_args()
    gguf = ns.gguf or default_gguf()
    args = {"gguf": gguf, "prompt": prompt_ids(gguf, ns.prompt_len, 0), "prompt_len": ns.prompt_len,
            "output_len": ns.output_len, "threads": ns.threads, "dtype": ns.kvseal_dtype}
    runs: dict[str, list[dict]] = {"llama.cpp": [], "kvseal": []}
    for i in range(ns.repeats):
        runs["llama.cpp"].append(run_child(ns.llama_python, LLAMA_CPP_CHILD, args, ns.timeout_s))
        runs["kvseal"].append(run_child(sys.executable, KVSEAL_CHILD, args, ns.timeout_s))
        print(f"round {i + 1}: " + "  ".join(f"{k} {v[-1]['decode_tok_s']:.1f} tok/s" for k, v in runs.items()),
              flush=True)
    for name, rs in runs.items():
        print(f"{name:10s} decode tok/s median {statistics.median(r['decode_tok_s'] for r in rs):.1f} "
              f"(runs {', '.join(format(r['decode_tok_s'], '.1f') for r in rs)}); prefill median "
              f"{statistics.median(r['prefill_s'] for r in rs) * 1000:.0f} ms")
    if ns.json is not None:
        ns.json.write_text(json.dumps({"args": {k: v for k, v in args.items() if k != "prompt"}, "runs": runs,
                                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
