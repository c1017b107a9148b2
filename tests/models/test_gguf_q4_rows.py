"""One-row decode steps over a GGUF's blocks (`--gguf-q4-rows`: the decoder linears' Q4_1 blocks,
`csrc/linear_q4.c`, and the lm_head's Q8_0 blocks, `csrc/linear_q8.c`): tiny random llamas written as
GGUFs with the gguf package's writer (their tokenizer a byte-level one of the test's), and the
default model itself, generate the same tokens with the same logprobs, bit for bit, with the blocks
and without them (the bfloat16 weights' tiles), at batch size 1. The tiny files: Q4_1 linears with
a float32 head, with a tied Q8_0 head (a vocabulary that is not a multiple of 16), float32 linears
with a Q8_0 head (the head's blocks are taken on their own), and an untied Q8_0 `output.weight`.

On the AVX512-BF16 engine the tests also check that the blocks were held and read (the decode
loop's table points at the Q4_1 ones); on AMX, that they were not held (the row kernels decline
there), so both runs read the tiles; without tile linears, that the model loads and answers either
way."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from built_kernels import KERNELS, native_ops

from kvseal import LLM, SamplingParams
from kvseal.model_files import default_model_path, gguf_cache_dir
from kvseal.ops.native_linears import TileLinear

HIDDEN, HEADS, KV_HEADS, INTER, LAYERS, VOCAB = 64, 2, 1, 96, 2, 320
STEPS = 6
PROMPTS = [[1, 100, 200, 300], [5, 6, 7]]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row interleave (convert_hf_to_gguf's), which the loader undoes."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte 0-255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte], extra = chr(256 + extra), extra + 1
    return [symbols[b] for b in range(256)]


def _add_byte_tokenizer(writer: Any, vocab: int) -> None:
    """A small byte-level BPE tokenizer (no merges): a token per byte, two special tokens, the rest
    of the vocabulary unused words."""
    import gguf

    tokens = ["<|endoftext|>", "<|im_start|>", *_byte_symbols()]
    tokens += [f"unused{i}" for i in range(vocab - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * (vocab - 2))
    writer.add_token_merges([])
    writer.add_token_scores([0.0] * vocab)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(0)


@dataclass(frozen=True)
class TinyGguf:
    """What a tiny GGUF holds: its decoder linears' type, its head's (the tied embedding table's,
    or with `untied` an `output.weight` of that type beside a float32 table) and its vocabulary."""

    linears: str = "Q4_1"  # or "F32"
    head: str = "F32"  # or "Q8_0"
    untied: bool = False
    vocab: int = VOCAB


def write_tiny_gguf(path: Path, tiny: TinyGguf = TinyGguf(), seed: int = 0) -> Path:
    """A random 2-layer llama of `tiny`'s types (norms float32)."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    head_dim = HIDDEN // HEADS
    for name, value in (("block_count", LAYERS), ("context_length", 256), ("embedding_length", HIDDEN),
                        ("feed_forward_length", INTER), ("attention.head_count", HEADS),
                        ("attention.head_count_kv", KV_HEADS), ("vocab_size", tiny.vocab),
                        ("rope.dimension_count", head_dim)):
        writer.add_uint32(f"llama.{name}", value)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    _add_byte_tokenizer(writer, tiny.vocab)

    def add(name: str, w: np.ndarray, kind: str) -> None:
        if kind == "F32":
            writer.add_tensor(name, w)
            return
        quant = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, gguf.quants.quantize(w, quant), raw_dtype=quant)

    def linear(name: str, n_out: int, k_in: int, n_head: int | None = None) -> None:
        w = rng.normal(0, 0.25, (n_out, k_in)).astype(np.float32)
        add(name, _permute(w, n_head) if n_head is not None else w, tiny.linears)

    table = rng.normal(0, 0.05, (tiny.vocab, HIDDEN)).astype(np.float32)
    add("token_embd.weight", table, "F32" if tiny.untied else tiny.head)
    if tiny.untied:
        add("output.weight", rng.normal(0, 0.05, (tiny.vocab, HIDDEN)).astype(np.float32), tiny.head)
    writer.add_tensor("output_norm.weight", (1 + rng.normal(0, 0.1, HIDDEN)).astype(np.float32))
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + rng.normal(0, 0.1, HIDDEN)).astype(np.float32))
        linear(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN, HEADS)
        linear(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN, KV_HEADS)
        linear(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        linear(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        linear(f"blk.{i}.ffn_gate.weight", INTER, HIDDEN)
        linear(f"blk.{i}.ffn_up.weight", INTER, HIDDEN)
        linear(f"blk.{i}.ffn_down.weight", HIDDEN, INTER)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def rows_engine() -> str:
    """Which engine a one-row step's linears run on here: avx512 (the blocks), amx or none (the tiles, or torch)."""
    if KERNELS is None or KERNELS.tile_engine == KERNELS.TILES_NONE:
        return "none"
    return "amx" if KERNELS.tile_engine == KERNELS.TILES_AMX else "avx512"


@dataclass(frozen=True)
class Generated:
    tokens: list[list[int]]
    logprobs: list[list[float]]
    held_q4_1: int  # decoder linears that held Q4_1 blocks
    held_q8_0: bool  # whether the lm_head held Q8_0 blocks


def generate(model: str, prompts: list[list[int]], q4_rows: bool, steps: int) -> Generated:
    """Greedy tokens and their logprobs, each prompt alone (batch size 1), and which linears held
    blocks."""
    llm = LLM(model=model, dtype="bfloat16", gguf_q4_rows=q4_rows, kv_cache_tokens=512, max_model_len=256,
              max_num_seqs=1)
    try:
        params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, logprobs=3)
        outs = [llm.generate([{"prompt_token_ids": p}], params)[0] for p in prompts]  # type: ignore[list-item]
        model_ = llm.engine.runner.model
        held = sum(1 for m in model_.modules() if isinstance(m, TileLinear) and m.q4_1 is not None)
        head = model_.lm_head
        llm.engine.check_integrity()
    finally:
        llm.engine.close()
    return Generated([o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs], held,
                     isinstance(head, TileLinear) and head.q8_0 is not None)


def check_equal_both_ways(model: str, prompts: list[list[int]], num_q4_1: int, steps: int,
                          q8_0_head: bool = False) -> None:
    """The same tokens and logprobs with the blocks and without, and the blocks held (on the
    AVX512-BF16 engine: num_q4_1 decoder linears', and the head's where `q8_0_head`) or not."""
    on, off = generate(model, prompts, True, steps), generate(model, prompts, False, steps)
    assert off.held_q4_1 == 0 and not off.held_q8_0
    rows_run = rows_engine() == "avx512"
    assert on.held_q4_1 == (num_q4_1 if rows_run else 0)
    assert on.held_q8_0 == (q8_0_head and rows_run)
    assert on.tokens == off.tokens
    assert on.logprobs == off.logprobs  # bit for bit: float equality of every logprob


@contextmanager
def tiny_file(directory: Path, tiny: TinyGguf) -> Iterator[Path]:
    """A tiny GGUF, and its converted folder in the user's cache removed afterwards."""
    path = write_tiny_gguf(directory / f"tiny.{tiny.linears}.{tiny.head}{'.untied' if tiny.untied else ''}.gguf",
                           tiny)
    try:
        yield path
    finally:
        shutil.rmtree(gguf_cache_dir(path), ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The tiny GGUF of Q4_1 linears and a Q8_0 head tied to the embedding table, 333 outputs (a
    last panel of 13)."""
    with tiny_file(tmp_path_factory.mktemp("gguf"), TinyGguf(head="Q8_0", vocab=333)) as path:
        yield path


def test_a_tiny_gguf_decodes_the_same_with_and_without_its_blocks(tiny_gguf: Path) -> None:
    check_equal_both_ways(str(tiny_gguf), PROMPTS, 4 * LAYERS, STEPS, q8_0_head=True)


@pytest.mark.parametrize("tiny", [TinyGguf(), TinyGguf(linears="F32", head="Q8_0"),
                                  TinyGguf(head="Q8_0", untied=True, vocab=333)],
                         ids=["float32-head", "float32-linears", "untied-head"])
def test_each_kind_of_blocks_is_taken_on_its_own(tmp_path: Path, tiny: TinyGguf) -> None:
    """The Q4_1 linears' blocks with a float32 head; the Q8_0 head's without Q4_1 linears (float32
    ones); and the head's from an untied `output.weight`."""
    with tiny_file(tmp_path, tiny) as path:
        check_equal_both_ways(str(path), PROMPTS, 4 * LAYERS if tiny.linears == "Q4_1" else 0, STEPS,
                              q8_0_head=tiny.head == "Q8_0")


@pytest.mark.slow
def test_the_default_model_decodes_the_same_with_and_without_its_blocks() -> None:
    """Its 120 Q4_1 decoder linears and its tied Q8_0 head."""
    check_equal_both_ways(str(default_model_path()), [[1, 504, 3458, 282, 4649, 314]], 4 * 30, 8, q8_0_head=True)


def same_blocks(a: Any, b: Any) -> bool:
    """Whether two `GgufBlocks` hold the same bytes."""
    layers_equal = all(torch.equal(x[n], y[n]) for x, y in zip(a.layers, b.layers) for n in x)
    return len(a.layers) == len(b.layers) and layers_equal and torch.equal(a.head, b.head)


def test_the_blocks_read_back_as_the_conversions_weights(tiny_gguf: Path) -> None:
    """read_gguf_blocks' rows are the loaded model's rows (q/k unpermuted, q/k/v and gate/up
    fused in the model's order; the head's in the vocabulary's): every row dequantizes to the
    converted bfloat16 weight."""
    from kvseal.models.gguf_blocks import dequantize_rows, read_gguf_blocks
    from kvseal.models.loader import load_model

    loaded = load_model(tiny_gguf, torch.bfloat16)
    blocks = read_gguf_blocks(tiny_gguf, loaded.config)
    assert blocks.layers is not None and len(blocks.layers) == LAYERS and blocks.head is not None
    for layer, layer_blocks in zip(loaded.model.model.layers, blocks.layers):
        for owner, attr in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
                            ("mlp", "down_proj")):
            weight = getattr(getattr(layer, owner), attr).weight
            assert torch.equal(dequantize_rows(layer_blocks[attr]), weight)
    assert torch.equal(dequantize_rows(blocks.head), loaded.model.lm_head.weight)


def test_the_blocks_are_kept_beside_the_converted_folder_and_read_from_there(
        tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GGUF is parsed for its blocks once (the reader parses the tokenizer's arrays too: ~2 s
    of every start for the default model); later starts load the kept blocks, the same bytes."""
    from kvseal.models import gguf_blocks
    from kvseal.models.loader import load_model

    config = load_model(tiny_gguf, torch.bfloat16).config
    kept = gguf_cache_dir(tiny_gguf) / gguf_blocks.BLOCKS_FILE
    kept.unlink(missing_ok=True)
    first = gguf_blocks.read_gguf_blocks(tiny_gguf, config)
    assert first.layers is not None and first.head is not None and kept.exists()

    def no_gguf(path: Path, config: Any) -> None:
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr(gguf_blocks, "_read_gguf_blocks", no_gguf)
    assert same_blocks(first, gguf_blocks.read_gguf_blocks(tiny_gguf, config))
    kept.write_bytes(b"damaged")  # a damaged file: the GGUF is read again (here: refused), never trusted
    with pytest.raises(AssertionError, match="parsed again"):
        gguf_blocks.read_gguf_blocks(tiny_gguf, config)


def _kept_file(tiny_gguf: Path) -> tuple[Path, Any, Any]:
    from kvseal.models import gguf_blocks
    from kvseal.models.loader import load_model

    config = load_model(tiny_gguf, torch.bfloat16).config
    kept = gguf_cache_dir(tiny_gguf) / gguf_blocks.BLOCKS_FILE
    kept.unlink(missing_ok=True)
    assert not gguf_blocks.read_gguf_blocks(tiny_gguf, config).is_empty and kept.exists()
    return kept, config, gguf_blocks


def test_a_kept_file_changed_anywhere_or_in_another_layout_is_replaced_from_the_gguf(tiny_gguf: Path) -> None:
    """One changed scale in a row the start-up spot check does not sample would change outputs:
    the digest written with the blocks refuses it; so are int8 tensors of the same bytes and a
    file of another format. Each time the GGUF is read again and the file written anew."""
    from safetensors.torch import load_file, save_file

    kept, config, gguf_blocks = _kept_file(tiny_gguf)
    first = gguf_blocks.read_gguf_blocks(tiny_gguf, config)
    meta = {"format": gguf_blocks._BLOCKS_FORMAT, "all_q4_1": "yes", "q8_0_head": "yes"}
    damaged, damaged_head = load_file(str(kept)), load_file(str(kept))
    damaged["0.o_proj"][5, 0, 1] ^= 0x40  # row 5's scale: not among the sampled rows
    damaged_head["lm_head"][7, 1, 1] ^= 0x40  # row 7's scale: not among the sampled rows either
    as_int8 = {name: t.view(torch.int8) for name, t in load_file(str(kept)).items()}
    for tensors, metadata in ((damaged, meta | {"sha256": "0" * 64}),
                              (damaged_head, meta | {"sha256": gguf_blocks._digest(load_file(str(kept)))}),
                              (as_int8, meta | {"sha256": "0" * 64}),
                              (load_file(str(kept)), {"format": "another-1"})):
        save_file(tensors, str(kept), metadata=metadata)
        assert same_blocks(first, gguf_blocks.read_gguf_blocks(tiny_gguf, config))
        assert not gguf_blocks._load_blocks(kept, config.num_layers).is_empty  # written anew


def test_a_kept_file_of_the_q4_1_only_format_is_read_again_with_the_head(tiny_gguf: Path) -> None:
    """A file an older kvseal kept (format -1: the Q4_1 linears alone, its digest right) is not
    taken for a file without a head: the GGUF is read again, the head with it, and the file
    replaced."""
    from safetensors.torch import load_file, save_file

    kept, config, gguf_blocks = _kept_file(tiny_gguf)
    first = gguf_blocks.read_gguf_blocks(tiny_gguf, config)
    linears = {name: t for name, t in load_file(str(kept)).items() if name != "lm_head"}
    save_file(linears, str(kept), metadata={"format": "kvseal-q4_1-blocks-1", "all_q4_1": "yes",
                                            "sha256": gguf_blocks._digest(linears)})
    again = gguf_blocks.read_gguf_blocks(tiny_gguf, config)
    assert again.head is not None and same_blocks(first, again)
    assert gguf_blocks._load_blocks(kept, config.num_layers).head is not None  # written anew, with the head


def test_a_cache_that_cannot_be_written_leaves_the_blocks_read_from_the_gguf(
        tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only or full cache (safetensors raises its own error, no OSError) is said in the log;
    the engine starts with the blocks read from the GGUF."""
    from safetensors import SafetensorError

    kept, config, gguf_blocks = _kept_file(tiny_gguf)
    kept.unlink()

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise SafetensorError("Error while serializing: I/O error: Read-only file system (os error 30)")

    monkeypatch.setattr("safetensors.torch.save_file", refuse)
    assert not gguf_blocks.read_gguf_blocks(tiny_gguf, config).is_empty
    assert not kept.exists()


@pytest.mark.parametrize("damaged", ["head", "linears"])
def test_blocks_that_do_not_dequantize_to_the_weights_are_not_held(tiny_gguf: Path, damaged: str) -> None:
    """The spot check before the blocks are held (sampled rows, the first among them): a part one
    of whose sampled rows is not the weight's is not held; the other part still is."""
    from kvseal.models.gguf_blocks import GgufBlocks, read_gguf_blocks
    from kvseal.models.loader import load_model
    from kvseal.parallel.worker import finish_model

    if KERNELS is None:
        pytest.skip("no C compiler: the native kernels are not built")
    loaded = load_model(tiny_gguf, torch.bfloat16)
    blocks = read_gguf_blocks(tiny_gguf, loaded.config)
    assert blocks.layers is not None and blocks.head is not None
    if damaged == "head":
        head = blocks.head.clone()
        head[0, 0, 2] ^= 1  # row 0's first q: one more or one less
        blocks = GgufBlocks(blocks.layers, head)
    else:
        layers = [dict(layer) for layer in blocks.layers]
        layers[1]["down_proj"] = layers[1]["down_proj"].clone()
        layers[1]["down_proj"][0, 0, 4] ^= 1  # row 0's first nibble
        blocks = GgufBlocks(layers, blocks.head)
    model = finish_model(loaded.model, torch.bfloat16, "none", native_ops(), 1, blocks)
    rows_run = rows_engine() == "avx512"
    held_q4_1 = sum(1 for m in model.modules() if isinstance(m, TileLinear) and m.q4_1 is not None)
    assert held_q4_1 == (4 * LAYERS if rows_run and damaged != "linears" else 0)
    head_held = isinstance(model.lm_head, TileLinear) and model.lm_head.q8_0 is not None
    assert head_held == (rows_run and damaged != "head")
