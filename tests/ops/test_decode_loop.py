"""Decode-only steps in one native call (`ops/native_decode_loop.py`, `csrc/decode_loop.c`) against
the per-layer native forward it replaces: bit-equal logits for every weight kind, dtype and architecture it runs,
the same KV writes and write records, and a slot outside the pool refused with nothing written.
Skipped without a C compiler (neither native path exists there); the bfloat16 loop (tile
linears) only where this CPU and build run them (AMX or AVX512-BF16)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from built_kernels import HAS_TILES, native_ops, needs_kernels

from kvseal.types import SamplingParams

pytestmark = needs_kernels

PROMPTS = [list(range(20, 32)), list(range(50, 90)), [7, 8], list(range(100, 117))]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
NEEDS_TILES = pytest.mark.skipif(not HAS_TILES, reason="the bfloat16 loop runs tile linears; none here")
DTYPES = ["float32", pytest.param("bfloat16", marks=NEEDS_TILES)]


def _without_loop(llm: Any) -> Any:
    model = llm.engine.runner.model
    model._decode_loop, model._decode_loop_built = None, True  # the per-layer native forward only
    return llm


def _count_loop_steps(llm: Any, method: str = "run") -> list[int]:
    """Wrap the model's loop so each step that ran in it (decode-only: `run`; with fresh
    chunks: `run_fresh`) is counted by its rows."""
    loop = llm.engine.runner.model.decode_loop()
    assert loop is not None
    calls: list[int] = []
    run = getattr(loop, method)

    def counted(h: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(h.shape[0])
        return run(h, *args)

    setattr(loop, method, counted)
    return calls


@pytest.mark.parametrize("arch, quantization, dtype", [
    ("llama", "none", "float32"), ("qwen2", "none", "float32"), ("mistral", "none", "float32"),
    ("llama", "bf16", "float32"), ("llama", "int8", "float32"),
    pytest.param("llama", "none", "bfloat16", marks=NEEDS_TILES),
    pytest.param("qwen2", "none", "bfloat16", marks=NEEDS_TILES)])
def test_loop_equals_the_per_layer_native_forward(make_llm: Callable[..., Any], tiny_model_dirs: dict[str, Path],
                                                  arch: str, quantization: str, dtype: str) -> None:
    """Tokens and logprobs bit-equal (qwen2: q/k/v biases; int8: scales; bf16: widened panels;
    bfloat16: tile linears), with prefill chunks and decode-only steps mixed in the same run."""
    model = str(tiny_model_dirs[arch])
    llm = make_llm(model=model, quantization=quantization, dtype=dtype)
    calls = _count_loop_steps(llm)
    looped = llm.generate(PROMPTS, PARAMS)
    assert calls and max(calls) == len(PROMPTS), "decode-only steps of every prompt ran in the loop"
    plain = _without_loop(make_llm(model=model, quantization=quantization, dtype=dtype)).generate(PROMPTS, PARAMS)
    for a, b in zip(looped, plain):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs  # exact: the same kernels in the same order


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_test_kernels_loop_equals_their_per_layer_ops(make_llm: Callable[..., Any], dtype: str) -> None:
    """The same with the forward on the tests' own kernels (`built_kernels`: in
    tests/ops/test_sanitizers.py built with ASan and UBSan, so the loop runs under them too)."""
    outputs = []
    for loop in (True, False):
        llm = make_llm(dtype=dtype)
        llm.engine.runner.model.use_ops(native_ops())
        if loop:
            calls = _count_loop_steps(llm)
        else:
            _without_loop(llm)
        outputs.append(llm.generate(PROMPTS, PARAMS))
    assert calls and max(calls) == len(PROMPTS)
    for a, b in zip(*outputs):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_models_the_loop_does_not_run_keep_the_per_layer_forward(make_llm: Callable[..., Any],
                                                                  tiny_model_dirs: dict[str, Path]) -> None:
    qk_norm = make_llm(model=str(tiny_model_dirs["qwen3"])).engine.runner.model
    assert qk_norm.decode_loop() is None  # per-head q/k norms
    llama = make_llm().engine.runner.model
    assert llama.decode_loop() is not None
    llama.model.layers[1].mlp.down_proj = torch.nn.Linear(64, 64)  # a linear without panels
    assert llama._build_decode_loop() is None
    assert make_llm(native="off").engine.runner.model.decode_loop() is None  # the torch ops have none


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)))  # a poisoned (NaN) slot equals itself


def _assert_same_pools(looped: Any, plain: Any) -> None:
    """Both engines' pools hold the same K/V, and their write records (the coverage the next
    step's isolation check reads) agree layer by layer."""
    for layer in range(len(looped.kv.pool.k)):
        assert _same(looped.kv.pool.k[layer], plain.kv.pool.k[layer])
        assert _same(looped.kv.pool.v[layer], plain.kv.pool.v[layer])
    assert torch.equal(looped.kv.records.prefix, plain.kv.records.prefix)


@pytest.mark.parametrize("dtype", DTYPES)
def test_loop_writes_and_records_what_the_per_layer_forward_does(make_llm: Callable[..., Any], dtype: str) -> None:
    """After the same steps, both engines' pools hold the same K/V and their write records
    (the coverage the next step's isolation check reads) agree layer by layer."""
    engines = []
    for loop in (True, False):
        llm = make_llm(dtype=dtype)
        if not loop:
            _without_loop(llm)
        engine = llm.engine
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, PARAMS)
        for _ in range(6):  # the prompts' prefills, then decode-only steps
            engine.step()
        engines.append(engine)
    _assert_same_pools(*engines)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_slot_outside_the_pool_is_refused_and_nothing_is_written_or_recorded(make_llm: Callable[..., Any],
                                                                                dtype: str) -> None:
    from kvseal.engine.batch import build_forward_batch
    from kvseal.models.attention import AttentionPlan

    engine = make_llm(dtype=dtype).engine
    engine.add_request("r0", PROMPTS[0], PARAMS)
    engine.step()  # the prefill; the next step is a decode
    model, pool = engine.runner.model, engine.kv.pool
    batch = build_forward_batch(engine.scheduler.schedule().chunks, engine.kv).batch
    plan = AttentionPlan.build(batch, pool, model.config.num_heads, model.ops)
    loop = model.decode_loop()
    assert plan.decode is not None and plan.is_decode_only and loop is not None and loop.takes(plan.decode.plan)
    h = model.model.embed_tokens(batch.input_ids).contiguous()
    cos, sin = (t.reshape(t.shape[0], -1).contiguous() for t in model.rope.cos_sin(batch.positions, h.dtype))
    before = [t.clone() for t in (*pool.k, *pool.v)]
    recorded: list[int] = []

    class Spy:
        def on_layer_write(self, layer: int, slots: torch.Tensor) -> None:
            recorded.append(layer)

        def on_layers_write(self, num_layers: int, slots: torch.Tensor) -> None:
            recorded.extend(range(num_layers))

    observer, pool.observer = pool.observer, Spy()
    try:
        loop.run(h, cos, sin, batch.slot_mapping.clone(), plan.decode.plan, pool)  # the real slot: all recorded
        assert recorded == list(range(len(pool.k)))
        recorded.clear()
        before = [t.clone() for t in (*pool.k, *pool.v)]
        with pytest.raises(IndexError, match="outside the pool"):
            loop.run(h, cos, sin, torch.tensor([pool.num_slots], dtype=torch.int64), plan.decode.plan, pool)
    finally:
        pool.observer = observer
    assert recorded == [], "no layer recorded as written"
    assert all(_same(a, b) for a, b in zip(before, (*pool.k, *pool.v)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_one_token_prefill_chunk_in_a_loop_step_is_not_sampled(make_llm: Callable[..., Any], dtype: str) -> None:
    """One-token prefill chunks past a prompt's first position are decode rows to the attention,
    so a step of them and decodes runs in the loop, but only the chunk that ends a prompt is
    sampled: the logits must be those of the sampled rows, in order. The long prompt comes first,
    so its unsampled row is ahead of the others' sampled ones."""
    prompts = [list(range(30, 42)), [5, 6], [7, 8], [9, 10]]
    sizes = dict(max_num_batched_tokens=4, max_prefill_chunk_tokens=1)
    llm = make_llm(dtype=dtype, **sizes)
    logits_rows: list[tuple[int, int]] = []
    model = llm.engine.runner.model
    loop = model.decode_loop()
    assert loop is not None
    run = loop.run

    def counted(h: torch.Tensor, *args: Any) -> torch.Tensor:
        logits_rows.append((h.shape[0], int(model._step_batch.logits_indices.numel())))
        return run(h, *args)

    forward = model.forward

    def remembered(batch: Any, pool: Any) -> torch.Tensor:
        model._step_batch = batch
        return forward(batch, pool)

    loop.run = counted  # type: ignore[method-assign]
    model.forward = remembered  # type: ignore[method-assign]
    looped = llm.generate(prompts, PARAMS)
    assert any(0 < sampled < rows for rows, sampled in logits_rows), "a loop step had an unsampled row"
    plain = _without_loop(make_llm(dtype=dtype, **sizes)).generate(prompts, PARAMS)
    for a, b in zip(looped, plain):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


# ---- steps of fresh prefill chunks only (`run_fresh`, kvseal_prefill_layers_bf16) ----

FRESH_SIZES = dict(dtype="bfloat16", max_num_batched_tokens=256, max_prefill_chunk_tokens=256)
EQUAL_PROMPTS = [list(range(20, 44)), list(range(60, 84)), list(range(100, 124))]  # one step, one group of three


@pytest.fixture(scope="module")
def head_dim_64(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A head dim the prefill attention kernel takes on AMX too (the tiny models' 16 it leaves to SDPA there)."""
    from tiny_models import make_tiny_model

    return str(make_tiny_model("llama_head_dim_64", tmp_path_factory.mktemp("head-dim-64")))


@NEEDS_TILES
@pytest.mark.parametrize("prompts", [
    EQUAL_PROMPTS, [list(range(30, 70))], [list(range(5, 17)), list(range(40, 60))],
    [list(range(5, 29)), list(range(40, 53)), list(range(70, 94)), [3]],  # 24, 13, 24, 1: three groups, one split
    [[(7 * i + j) % 500 + 3 for j in range(100)] for i in range(3)]])  # 300 rows: o/down_proj with the norm fused
def test_fresh_prefill_steps_in_the_loop_equal_the_per_layer_forward(make_llm: Callable[..., Any], head_dim_64: str,
                                                                     prompts: list[list[int]]) -> None:
    """Prompts prefilled in one step (equal ones: one group of chunks; unequal ones: a group per
    length, the chunks of a length not all side by side), one prompt alone: in the loop, tokens
    and logprobs bit-equal to the per-layer forward."""
    sizes = {**FRESH_SIZES, "max_num_batched_tokens": 512, "max_prefill_chunk_tokens": 512, "kv_cache_tokens": 1024}
    llm = make_llm(model=head_dim_64, **sizes)
    calls = _count_loop_steps(llm, "run_fresh")
    looped = llm.generate(prompts, PARAMS)
    assert calls == [sum(map(len, prompts))], "the prefill step in the loop"
    plain = _without_loop(make_llm(model=head_dim_64, **sizes)).generate(prompts, PARAMS)
    for a, b in zip(looped, plain):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


@NEEDS_TILES
def test_a_long_prompts_chunks_run_in_the_loop(make_llm: Callable[..., Any], head_dim_64: str) -> None:
    """A long prompt's first chunk is fresh but not sampled (its step returns no logits), the
    next chunks continue the cached prefix (the last one sampled): all in the loop, the same
    tokens and logprobs as the per-layer forward."""
    sizes = {**FRESH_SIZES, "max_num_batched_tokens": 16, "max_prefill_chunk_tokens": 16}
    prompt = [list(range(40, 76))]
    llm = make_llm(model=head_dim_64, **sizes)
    calls = _count_loop_steps(llm, "run_fresh")
    looped = llm.generate(prompt, PARAMS)
    assert calls == [16, 16, 4]
    plain = _without_loop(make_llm(model=head_dim_64, **sizes)).generate(prompt, PARAMS)
    assert looped[0].token_ids == plain[0].token_ids and looped[0].logprobs == plain[0].logprobs


def test_a_float32_model_keeps_fresh_prefills_per_layer(make_llm: Callable[..., Any], head_dim_64: str) -> None:
    loop = make_llm(model=head_dim_64).engine.runner.model.decode_loop()
    assert loop is not None and not loop.fresh_prefill  # the prefill loop runs tile linears only


@NEEDS_TILES
def test_fresh_loop_writes_and_records_what_the_per_layer_forward_does(make_llm: Callable[..., Any],
                                                                        head_dim_64: str) -> None:
    engines = []
    for loop in (True, False):
        llm = make_llm(model=head_dim_64, **FRESH_SIZES)
        calls = _count_loop_steps(llm, "run_fresh") if loop else None
        if not loop:
            _without_loop(llm)
        engine = llm.engine
        for i, prompt in enumerate(EQUAL_PROMPTS):
            engine.add_request(f"r{i}", prompt, PARAMS)
        engine.step()  # the prefill, every prompt in one group
        assert calls is None or calls == [72]
        engines.append(engine)
    _assert_same_pools(*engines)


@NEEDS_TILES
def test_the_fresh_loop_refuses_rows_outside_the_step_and_slots_outside_the_pool(make_llm: Callable[..., Any],
                                                                                  head_dim_64: str) -> None:
    from kvseal.engine.batch import build_forward_batch
    from kvseal.models.attention import AttentionPlan

    engine = make_llm(model=head_dim_64, **FRESH_SIZES).engine
    engine.add_request("r0", EQUAL_PROMPTS[0], PARAMS)
    model, pool = engine.runner.model, engine.kv.pool
    batch = build_forward_batch(engine.scheduler.schedule().chunks, engine.kv).batch
    plan = AttentionPlan.build(batch, pool, model.config.num_heads, model.ops)
    loop = model.decode_loop()
    assert plan.decode is None and len(plan.fresh) == 1 and loop is not None \
        and loop.takes_fresh(plan.fresh, plan.prefills, None)
    h = model.model.embed_tokens(batch.input_ids).contiguous()
    cos, sin = model.rope.cos_sin_rows(batch.positions, h.dtype, max(batch.context_lens))
    before = [t.clone() for t in (*pool.k, *pool.v)]
    rows = h.shape[0]
    with pytest.raises(IndexError, match="outside the step"):  # a sampled row past the step's rows
        loop.run_fresh(h.clone(), cos, sin, batch.slot_mapping, plan.fresh, [], None, torch.tensor([rows]), pool)
    bad_slots = batch.slot_mapping.clone()
    bad_slots[-1] = pool.num_slots
    with pytest.raises(IndexError, match="outside the pool"):
        loop.run_fresh(h.clone(), cos, sin, bad_slots, plan.fresh, [], None, batch.logits_indices, pool)
    assert all(_same(a, b) for a, b in zip(before, (*pool.k, *pool.v))), "nothing written"
    assert int(engine.kv.records.prefix.max()) == 0, "no layer recorded as written"


def _wave(llm: Any, params: SamplingParams) -> dict[str, Any]:
    """Two prompts prefilled, then two more while the first two decode (decode rows first, then
    one fresh group: the loop's mixed step), all run to the end; the outputs by request id."""
    engine, outputs = llm.engine, {}
    for i, prompt in enumerate(EQUAL_PROMPTS[:2]):
        engine.add_request(f"a{i}", prompt, params)
    for out in engine.step():
        outputs[out.request_id] = out
    engine.add_request("b0", list(range(200, 224)), params)
    engine.add_request("b1", list(range(300, 324)), params)
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    return outputs


@NEEDS_TILES
def test_a_step_of_decode_rows_then_fresh_chunks_runs_in_the_loop(make_llm: Callable[..., Any],
                                                                  head_dim_64: str) -> None:
    """The next prompts of a wave start while the first ones decode: the step's decode rows
    come first, then one group of fresh chunks. In the loop (decode attention over the pool for
    the first rows, prefill attention over their own rows for the rest), tokens and logprobs
    bit-equal to the per-layer forward."""
    llm = make_llm(model=head_dim_64, **FRESH_SIZES)
    calls = _count_loop_steps(llm, "run_fresh")
    looped = _wave(llm, PARAMS)
    assert calls == [48, 2 + 48], "the first prefill alone, then two decode rows and two chunks"
    plain = _wave(_without_loop(make_llm(model=head_dim_64, **FRESH_SIZES)), PARAMS)
    assert looped.keys() == plain.keys()
    for request_id, out in looped.items():
        assert out.token_ids == plain[request_id].token_ids and out.logprobs == plain[request_id].logprobs


SPLIT_SIZES = {**FRESH_SIZES, "max_num_batched_tokens": 40, "max_prefill_chunk_tokens": 40}
SPLIT_PROMPTS = [list(range(20, 44)), list(range(60, 84)), list(range(100, 124))]  # 24 tokens each


def _split_wave(engine: Any, params: SamplingParams, steps: int | None = None) -> dict[str, Any]:
    """Three 24-token prompts under a 40-token budget: the first step prefills one whole and the
    first 16 tokens of the next (two fresh groups); the second decodes the first, continues the
    split one after its cached 16 (a span) and prefills the third (a fresh chunk). Runs `steps`
    steps, or to the end; the outputs by request id."""
    outputs = {}
    for i, prompt in enumerate(SPLIT_PROMPTS):
        engine.add_request(f"s{i}", prompt, params)
    done = 0
    while engine.has_unfinished() and (steps is None or done < steps):
        for out in engine.step():
            outputs[out.request_id] = out
        done += 1
    return outputs


@NEEDS_TILES
def test_a_step_of_decode_rows_a_continued_chunk_and_fresh_chunks_runs_in_the_loop(
        make_llm: Callable[..., Any], head_dim_64: str) -> None:
    """A wave whose budget splits a prompt: its continuation (attending to its cached prefix
    through its own pages) rides in the loop with the decode rows and the next fresh prompt.
    Tokens, logprobs, pool contents and write records equal to the per-layer forward."""
    looped_llm = make_llm(model=head_dim_64, **SPLIT_SIZES)
    calls = _count_loop_steps(looped_llm, "run_fresh")
    looped = _split_wave(looped_llm.engine, PARAMS)
    assert calls[:2] == [24 + 16, 1 + 8 + 24], "both prefill steps in the loop"
    plain_llm = _without_loop(make_llm(model=head_dim_64, **SPLIT_SIZES))
    plain = _split_wave(plain_llm.engine, PARAMS)
    assert looped.keys() == plain.keys() == {"s0", "s1", "s2"}
    for request_id, out in looped.items():
        assert out.token_ids == plain[request_id].token_ids and out.logprobs == plain[request_id].logprobs
    engines = []
    for loop in (True, False):
        llm = make_llm(model=head_dim_64, **SPLIT_SIZES)
        if not loop:
            _without_loop(llm)
        _split_wave(llm.engine, PARAMS, steps=2)
        engines.append(llm.engine)
    _assert_same_pools(*engines)


@NEEDS_TILES
def test_the_loop_refuses_a_continued_chunk_whose_prefix_pages_leave_the_pool(make_llm: Callable[..., Any],
                                                                              head_dim_64: str) -> None:
    import dataclasses

    from kvseal.engine.batch import build_forward_batch
    from kvseal.models.attention import AttentionPlan

    engine = make_llm(model=head_dim_64, **SPLIT_SIZES).engine
    _split_wave(engine, PARAMS, steps=1)
    model, pool = engine.runner.model, engine.kv.pool
    batch = build_forward_batch(engine.scheduler.schedule().chunks, engine.kv).batch
    plan = AttentionPlan.build(batch, pool, model.config.num_heads, model.ops)
    loop = model.decode_loop()
    assert loop is not None and len(plan.prefills) == 1 and plan.decode is not None
    span = plan.prefills[0]
    h = model.model.embed_tokens(batch.input_ids).contiguous()
    cos, sin = model.rope.cos_sin_rows(batch.positions, h.dtype, max(batch.context_lens))
    before = [t.clone() for t in (*pool.k, *pool.v)]
    records = engine.kv.records.prefix.clone()
    for pages in (torch.full_like(span.pages, pool.num_pages), torch.full_like(span.pages, -1)):
        bad = dataclasses.replace(span, pages=pages)
        with pytest.raises(IndexError, match="outside the pool"):
            loop.run_fresh(h.clone(), cos, sin, batch.slot_mapping, plan.fresh, [bad], plan.decode.plan,
                           batch.logits_indices, pool)
    with pytest.raises(IndexError, match="outside the step"):  # a span over the decode row
        loop.run_fresh(h.clone(), cos, sin, batch.slot_mapping, plan.fresh,
                       [dataclasses.replace(span, token_start=0, token_end=span.token_end - span.token_start)],
                       plan.decode.plan, batch.logits_indices, pool)
    assert all(_same(a, b) for a, b in zip(before, (*pool.k, *pool.v))), "nothing written"
    assert torch.equal(engine.kv.records.prefix, records), "no layer recorded as written"
