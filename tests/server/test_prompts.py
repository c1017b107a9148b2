"""Prompt encoding at the front door: fair across tenants, and logprob bytes/offsets that are
the tokens' real bytes (a byte-level BPE tokenizer splits an emoji across tokens)."""

from __future__ import annotations

import asyncio

from tiny_models import make_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvseal.admission import AdmissionLimits
from kvseal.messages.msgs import TokenLogprobsMsg
from kvseal.server.logprobs import TextOffsets, chat_logprobs, completion_logprobs
from kvseal.server.prompts import PromptEncoder

LIMITS = AdmissionLimits(max_model_len=512, kv_cache_tokens=2048, vocab_size=512)
TEXT = "héllo 🙂 wörld 🙂🙂 ok"


def test_one_tenants_queue_does_not_delay_another_tenant() -> None:
    """Jobs are served round-robin by tenant: bob's one prompt runs right after the job alice
    already has running, not after all of alice's queue (a single FIFO would run it last)."""
    encoder = PromptEncoder(make_tokenizer())
    finished: list[str] = []

    async def encode(tenant: str, index: int) -> None:
        await encoder.completion_ids("w5 " * 50, tenant, LIMITS, may_truncate=False)
        finished.append(f"{tenant}{index}")

    async def scenario() -> None:
        await asyncio.gather(*[encode("alice", i) for i in range(4)], encode("bob", 0))

    asyncio.run(scenario())
    encoder.close()
    assert finished == ["alice0", "bob0", "alice1", "alice2", "alice3"]


def _byte_level_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world", "ok ok ok"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_logprob_bytes_rebuild_the_text_and_offsets_line_up() -> None:
    encoder = PromptEncoder(_byte_level_tokenizer())
    ids = encoder.tokenizer.encode(TEXT)
    assert any(encoder.token_text(i) == "\ufffd" for i in ids)  # the emoji is split across tokens
    lps = [TokenLogprobsMsg(i, -0.5, [(i, -0.5)]) for i in ids]

    content = chat_logprobs(lps, encoder.token_text, encoder.token_bytes)["content"]
    assert b"".join(bytes(entry["bytes"]) for entry in content).decode("utf-8") == TEXT
    assert [e["top_logprobs"][0]["bytes"] for e in content] == [e["bytes"] for e in content]

    offsets = TextOffsets(encoder.token_bytes)  # streamed in two pieces: offsets continue
    first = completion_logprobs(lps[:5], encoder.token_text, offsets)["text_offset"]
    rest = completion_logprobs(lps[5:], encoder.token_text, offsets)["text_offset"]
    text_offset = first + rest
    assert text_offset[0] == 0 and text_offset == sorted(text_offset)
    for index, token_id in enumerate(ids):
        piece = encoder.token_bytes(token_id)
        starts_a_character = piece[0] & 0xC0 != 0x80
        if starts_a_character and (decoded := piece.decode("utf-8", errors="ignore")):
            assert TEXT[text_offset[index]:].startswith(decoded)

