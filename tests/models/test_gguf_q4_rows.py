"""One-row decode steps over a GGUF's Q4_1 blocks (`--gguf-q4-rows`, `csrc/linear_q4.c`): a tiny
random llama written as a Q4_1 GGUF with the gguf package's writer (its tokenizer the default
model's), and the default model itself, generate the same tokens with the same logprobs, bit for
bit, with the blocks and without them (the bfloat16 weights' tiles), at batch size 1.

On the AVX512-BF16 engine the tests also check that the blocks were held and read (the decode
loop's table points at them); on AMX, that they were not held (the row kernels decline there), so
both runs read the tiles; without tile linears, that the model loads and answers either way."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from built_kernels import KERNELS

from kvseal import LLM, SamplingParams
from kvseal.model_files import default_model_path, gguf_cache_dir
from kvseal.ops.native_linears import TileLinear

HIDDEN, HEADS, KV_HEADS, INTER, LAYERS, VOCAB = 64, 2, 1, 96, 2, 320
STEPS = 6


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


def _add_byte_tokenizer(writer: Any) -> None:
    """A small byte-level BPE tokenizer (no merges): a token per byte, two special tokens, the rest
    of the vocabulary unused words."""
    import gguf

    tokens = ["<|endoftext|>", "<|im_start|>", *_byte_symbols()]
    tokens += [f"unused{i}" for i in range(VOCAB - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * (VOCAB - 2))
    writer.add_token_merges([])
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(0)


def write_tiny_q4_1_gguf(path: Path, seed: int = 0) -> Path:
    """A random 2-layer llama whose decoder linears are Q4_1 (norms and the tied embedding float32)."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    head_dim = HIDDEN // HEADS
    for name, value in (("block_count", LAYERS), ("context_length", 256), ("embedding_length", HIDDEN),
                        ("feed_forward_length", INTER), ("attention.head_count", HEADS),
                        ("attention.head_count_kv", KV_HEADS), ("vocab_size", VOCAB),
                        ("rope.dimension_count", head_dim)):
        writer.add_uint32(f"llama.{name}", value)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    _add_byte_tokenizer(writer)

    def linear(name: str, n_out: int, k_in: int, n_head: int | None = None) -> None:
        w = rng.normal(0, 0.25, (n_out, k_in)).astype(np.float32)
        w = _permute(w, n_head) if n_head is not None else w
        writer.add_tensor(name, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1),
                          raw_dtype=gguf.GGMLQuantizationType.Q4_1)

    writer.add_tensor("token_embd.weight", rng.normal(0, 0.05, (VOCAB, HIDDEN)).astype(np.float32))
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


def generate(model: str, prompts: list[list[int]], q4_rows: bool,
             steps: int) -> tuple[list[list[int]], list[list[float]], int]:
    """Greedy tokens and their logprobs, each prompt alone (batch size 1), and how many decoder
    linears held Q4_1 blocks."""
    llm = LLM(model=model, dtype="bfloat16", gguf_q4_rows=q4_rows, kv_cache_tokens=512, max_model_len=256,
              max_num_seqs=1)
    try:
        params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, logprobs=3)
        outs = [llm.generate([{"prompt_token_ids": p}], params)[0] for p in prompts]  # type: ignore[list-item]
        held = sum(1 for m in llm.engine.runner.model.modules() if isinstance(m, TileLinear) and m.q4_1 is not None)
        llm.engine.check_integrity()
    finally:
        llm.engine.close()
    return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs], held


def check_equal_both_ways(model: str, prompts: list[list[int]], num_linears: int, steps: int) -> None:
    tokens_on, logprobs_on, held_on = generate(model, prompts, True, steps)
    tokens_off, logprobs_off, held_off = generate(model, prompts, False, steps)
    assert held_off == 0
    assert held_on == (num_linears if rows_engine() == "avx512" else 0)
    assert tokens_on == tokens_off
    assert logprobs_on == logprobs_off  # bit for bit: float equality of every logprob


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The tiny Q4_1 GGUF, and its converted folder in the user's cache removed afterwards."""
    path = write_tiny_q4_1_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf")
    try:
        yield path
    finally:
        shutil.rmtree(gguf_cache_dir(path), ignore_errors=True)


def test_a_tiny_q4_1_gguf_decodes_the_same_with_and_without_its_blocks(tiny_gguf: Path) -> None:
    prompts = [[1, 100, 200, 300], [5, 6, 7]]
    check_equal_both_ways(str(tiny_gguf), prompts, 4 * LAYERS, STEPS)


@pytest.mark.slow
def test_the_default_model_decodes_the_same_with_and_without_its_blocks() -> None:
    check_equal_both_ways(str(default_model_path()), [[1, 504, 3458, 282, 4649, 314]], 4 * 30, 8)


def test_the_blocks_read_back_as_the_conversions_weights(tiny_gguf: Path) -> None:
    """read_q4_1_linears' rows are the loaded model's rows (q/k unpermuted, q/k/v and gate/up
    fused in the model's order): every row dequantizes to the converted bfloat16 weight."""
    from kvseal.models.gguf_blocks import dequantize_rows, read_q4_1_linears
    from kvseal.models.loader import load_model

    loaded = load_model(tiny_gguf, torch.bfloat16)
    blocks = read_q4_1_linears(tiny_gguf, loaded.config)
    assert blocks is not None and len(blocks) == LAYERS
    for layer, layer_blocks in zip(loaded.model.model.layers, blocks):
        for owner, attr in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
                            ("mlp", "down_proj")):
            weight = getattr(getattr(layer, owner), attr).weight
            assert torch.equal(dequantize_rows(layer_blocks[attr]), weight)


def test_the_blocks_are_kept_beside_the_converted_folder_and_read_from_there(
        tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GGUF is parsed for its blocks once (the reader parses the tokenizer's arrays too: ~2 s
    of every start for the default model); later starts load the kept blocks, the same bytes."""
    from kvseal.models import gguf_blocks
    from kvseal.models.loader import load_model

    config = load_model(tiny_gguf, torch.bfloat16).config
    kept = gguf_cache_dir(tiny_gguf) / gguf_blocks.BLOCKS_FILE
    kept.unlink(missing_ok=True)
    first = gguf_blocks.read_q4_1_linears(tiny_gguf, config)
    assert first is not None and kept.exists()

    def no_gguf(path: Path, config: Any) -> None:
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr(gguf_blocks, "_read_gguf_blocks", no_gguf)
    again = gguf_blocks.read_q4_1_linears(tiny_gguf, config)
    assert again is not None
    assert all(torch.equal(a[name], b[name]) for a, b in zip(first, again) for name in a)
    kept.write_bytes(b"damaged")  # a damaged file: the GGUF is read again (here: refused), never trusted
    with pytest.raises(AssertionError, match="parsed again"):
        gguf_blocks.read_q4_1_linears(tiny_gguf, config)


def _kept_file(tiny_gguf: Path) -> tuple[Path, Any, Any]:
    from kvseal.models import gguf_blocks
    from kvseal.models.loader import load_model

    config = load_model(tiny_gguf, torch.bfloat16).config
    kept = gguf_cache_dir(tiny_gguf) / gguf_blocks.BLOCKS_FILE
    kept.unlink(missing_ok=True)
    assert gguf_blocks.read_q4_1_linears(tiny_gguf, config) is not None and kept.exists()
    return kept, config, gguf_blocks


def test_a_kept_file_changed_anywhere_or_in_another_layout_is_replaced_from_the_gguf(tiny_gguf: Path) -> None:
    """One changed scale in a row the start-up spot check does not sample would change outputs:
    the digest written with the blocks refuses it; so are int8 tensors of the same bytes and a
    file of another format. Each time the GGUF is read again and the file written anew."""
    from safetensors.torch import load_file, save_file

    kept, config, gguf_blocks = _kept_file(tiny_gguf)
    first = gguf_blocks.read_q4_1_linears(tiny_gguf, config)
    meta = {"format": "kvseal-q4_1-blocks-1", "all_q4_1": "yes"}
    damaged = load_file(str(kept))
    damaged["0.o_proj"][5, 0, 1] ^= 0x40  # row 5's scale: not among the sampled rows
    as_int8 = {name: t.view(torch.int8) for name, t in load_file(str(kept)).items()}
    for tensors, metadata in ((damaged, meta | {"sha256": "0" * 64}), (as_int8, meta | {"sha256": "0" * 64}),
                              (load_file(str(kept)), {"format": "another-1"})):
        save_file(tensors, str(kept), metadata=metadata)
        again = gguf_blocks.read_q4_1_linears(tiny_gguf, config)
        assert again is not None and all(torch.equal(a[n], b[n]) for a, b in zip(first, again) for n in a)
        assert gguf_blocks._load_blocks(kept, config.num_layers) is not None  # written anew


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
    assert gguf_blocks.read_q4_1_linears(tiny_gguf, config) is not None
    assert not kept.exists()
