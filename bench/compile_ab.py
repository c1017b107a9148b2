"""torch.compile of the decoder against the eager forward: decode step time and compile time.

An experiment, not a serving path: the engine runs eagerly. This script answers "would
torch.compile (Inductor, CPU) make a decode step faster, and what would it cost at start-up?"
with three variants of the default model's forward, swapped into one engine in one process
and timed alternately (same pool, same workload, same load):

- `eager`: the engine's forward with the torch ops (`--native off`: float32 linears
  oneDNN-packed, `kvseal/ops/torch_linears.py`).
- `layer`: one compiled graph shared by all 30 layers (weights are graph inputs), RMSNorm /
  RoPE / residuals / SiLU*up fused by Inductor. The pool write and paged attention (with the
  KV write records and checks) run outside the graph as an opaque custom op; so do the packed
  linears (Inductor lowers oneDNN linears only for weights frozen into the graph).
- `frozen`: the whole layer stack as one graph with `freezing=True` (weights become constants
  and Inductor packs the linears itself), attention again an opaque op. Freezing bypasses
  Inductor's FX graph cache, so this variant compiles in full at every start-up.

For each concurrency c, c requests of --prompt-len random tokens are prefilled, then
--steps decode steps are timed one by one; the median ms per step is reported per variant and
repeat, with the ratio eager / variant (above 1: the variant is faster). The order of the
variants rotates each repeat and each variant gets its own prompts, so no variant decodes
over pages another one left in the prefix cache. Compile time is the
wall time of the first prefill and first decode step under each compiled variant. Greedy
tokens of a fixed prompt are compared with eager's.

    python bench/compile_ab.py --threads 1 --reps 3
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python bench/compile_ab.py ...   # cold compile
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import random
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from kvseal import SamplingParams
from kvseal.config import EngineArgs
from kvseal.engine.engine import LLMEngine
from kvseal.kvcache.pool import KVPool
from kvseal.models.attention import AttentionPlan, paged_attention
from kvseal.models.llama import CausalLM, DecoderLayer
from kvseal.models.loader import load_model
from kvseal.models.rope import RotaryEmbedding
from kvseal.ops import NewTokens, TorchOps
from kvseal.ops.torch_linears import PackedLinear
from kvseal.types import ForwardBatch

# --- opaque ops: what stays outside the compiled graph ---------------------------------------

_scope: tuple[ForwardBatch, AttentionPlan, KVPool] | None = None
_OPS = TorchOps()


@contextlib.contextmanager
def attention_scope(batch: ForwardBatch, plan: AttentionPlan, pool: KVPool) -> Iterator[None]:
    global _scope
    _scope = (batch, plan, pool)
    try:
        yield
    finally:
        _scope = None


_LIBRARY = torch.library.Library("kvseal_bench", "DEF")
_LIBRARY.define("packed_linear(Tensor x, Tensor packed_weight, Tensor? bias) -> Tensor")


# custom_op, not the Library API: with it the layer index stays symbolic (one graph, 30 layers)
@torch.library.custom_op("kvseal_bench::layer_attention", mutates_args=())
def layer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """The eager layer's pool write (records included) and paged attention, unchanged."""
    assert _scope is not None, "layer_attention outside attention_scope"
    batch, plan, pool = _scope
    pool.write(layer, batch.slot_mapping, k, v)
    return paged_attention(NewTokens(q, k, v, None), pool, layer, plan, _OPS).contiguous()


def _packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


_LIBRARY.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")


@layer_attention.register_fake
def _layer_attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return q.new_empty(q.shape)


@torch.library.register_fake("kvseal_bench::packed_linear", lib=_LIBRARY)
def _packed_linear_shape(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed_weight.shape[0]))


# --- the layer, written against the opaque ops ------------------------------------------------

def _linear(linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(linear, PackedLinear):
        return torch.ops.kvseal_bench.packed_linear(x, linear.packed_weight, linear.bias)
    return linear(x)


def decoder_layer(layer: DecoderLayer, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                  index: int) -> torch.Tensor:
    """`DecoderLayer.forward` for a Llama layer without q/k norm; h: [num_tokens, hidden]."""
    attn, n = layer.self_attn, h.shape[0]
    qkv = _linear(attn.qkv_proj, layer.input_layernorm(h))
    qk = RotaryEmbedding.apply(qkv[:, :attn.q_size + attn.kv_size].view(n, -1, attn.head_dim), (cos, signed_sin))
    q, k = qk.split([attn.num_heads, attn.num_kv_heads], dim=1)
    v = qkv[:, attn.q_size + attn.kv_size:].view(n, attn.num_kv_heads, attn.head_dim)
    out = torch.ops.kvseal_bench.layer_attention(q, k, v, index)
    h = h + _linear(attn.o_proj, out.reshape(n, -1))
    gate, up = _linear(layer.mlp.gate_up_proj, layer.post_attention_layernorm(h)).chunk(2, dim=-1)
    return h + _linear(layer.mlp.down_proj, F.silu(gate) * up)


def all_layers(model: CausalLM, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    for index, layer in enumerate(model.model.layers):
        assert isinstance(layer, DecoderLayer)
        h = decoder_layer(layer, h, cos, signed_sin, index)
    return h


LayersFn = Callable[[CausalLM, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def per_layer(compiled: Callable[..., torch.Tensor]) -> LayersFn:
    def run(model: CausalLM, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(model.model.layers):
            h = compiled(layer, h, cos, signed_sin, index)
        return h
    return run


def install(model: CausalLM, run_layers: LayersFn) -> CausalLM:
    """Replace `model.forward` by `CausalLM.forward` with its layers run by `run_layers`."""
    @torch.inference_mode()
    def forward(batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        plan = AttentionPlan.build(batch, pool, model.config.num_heads, _OPS)
        h = model.model.embed_tokens(batch.input_ids)
        cos, signed_sin = model.rope.cos_sin(batch.positions, h.dtype)
        with attention_scope(batch, plan, pool):
            h = run_layers(model, h, cos, signed_sin)
        return model.lm_head(model.model.norm(h[batch.logits_indices])).float()

    model.forward = forward  # type: ignore[method-assign]
    return model


# --- timing ------------------------------------------------------------------------------------

def decode_step_ms(engine: LLMEngine, c: int, prompt_len: int, steps: int, seed: int) -> float:
    """Median wall ms of `steps` engine steps once c requests are prefilled and decoding."""
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=steps + 8, min_tokens=steps + 8, ignore_eos=True, temperature=0)
    for i in range(c):
        engine.add_request(f"ab{seed}-{c}-{i}", [rng.randrange(100, 40000) for _ in range(prompt_len)], params)
    for _ in range(-(-c * prompt_len // 512) + 2):  # prefill (at most 512 tokens a step), then two more
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(1000 * (time.perf_counter() - start))
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times)


def greedy_tokens(engine: LLMEngine, tag: str) -> list[int]:
    prompt = engine.tokenizer.encode("The capital of France is")
    engine.add_request(f"greedy-{tag}", prompt, SamplingParams(max_tokens=24, temperature=0))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens = list(out.token_ids)
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["eager", "layer", "frozen"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    max_c = max(args.concurrency)
    loaded = load_model(None, torch.float32)
    unpacked = copy.deepcopy(loaded.model) if "frozen" in args.variants else None
    engine = LLMEngine(EngineArgs(dtype="float32", max_model_len=args.prompt_len + 2 * args.steps + 64,
                                  kv_cache_tokens=max_c * (args.prompt_len + 2 * args.steps + 64),
                                  max_num_seqs=max_c, native="off"), loaded)
    eager = engine.runner.model
    models: dict[str, CausalLM] = {"eager": eager}
    if "layer" in args.variants:  # the engine's packed model, a second forward over it
        packed_twin = copy.copy(eager)
        models["layer"] = install(packed_twin, per_layer(torch.compile(decoder_layer, dynamic=True, fullgraph=True)))
    if unpacked is not None:
        frozen = torch.compile(all_layers, dynamic=True, fullgraph=True, options={"freezing": True})
        models["frozen"] = install(unpacked, frozen)
    results: dict[str, Any] = {"threads": torch.get_num_threads(), "compile_s": {}, "greedy_equal": {}, "runs": []}
    reference: list[int] = []
    for name in args.variants:
        engine.runner.model = models[name]
        start = time.perf_counter()
        decode_step_ms(engine, 1, args.prompt_len, 2, seed=1)  # compiles: a prefill, then one token
        decode_step_ms(engine, 2, args.prompt_len, 2, seed=2)  # and several tokens
        results["compile_s"][name] = round(time.perf_counter() - start, 1)
        tokens = greedy_tokens(engine, name)
        reference = reference or tokens
        results["greedy_equal"][name] = tokens == reference
    for rep in range(args.reps):
        for c in args.concurrency:
            row: dict[str, Any] = {"rep": rep, "concurrency": c}
            order = args.variants[rep % len(args.variants):] + args.variants[:rep % len(args.variants)]
            for name in order:  # rotated each repeat; distinct prompts per variant (no prefix-cache hits)
                engine.runner.model = models[name]
                seed = 10_000 * args.variants.index(name) + 100 * rep + c
                row[f"{name}_ms"] = round(decode_step_ms(engine, c, args.prompt_len, args.steps, seed), 2)
            for name in args.variants[1:]:
                row[f"eager/{name}"] = round(row["eager_ms"] / row[f"{name}_ms"], 3)
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
    results["loadavg"] = os.getloadavg()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
