"""Prompt encoding at the front door: fair across tenants, and logprob bytes/offsets that are
the tokens' real bytes (a byte-level BPE tokenizer splits an emoji across tokens)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from char_model import make_char_tokenizer
from tiny_models import make_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvseal._testing.faults import Fault, inject
from kvseal.admission import AdmissionLimits
from kvseal.errors import ContextLengthExceeded
from kvseal.messages.msgs import TokenLogprobsMsg
from kvseal.prompting import ChatOptions
from kvseal.server.logprobs import TextOffsets, chat_logprobs, completion_logprobs
from kvseal.server.prompts import PromptEncoder
from kvseal.server.protocol import ChatCompletionRequest, CompletionRequest

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


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_prompt_over_the_bound_let_in_for_truncation_does_not_hold_up_others(route: str) -> None:
    """`truncate_prompt_tokens` lets a prompt past the character bound: tokenized whole, ~1.6 s
    here for a million words (15 MB: ~10 s). It runs in its own lane, so bob's ordinary prompt,
    sent after it, is done first (on one tokenizer thread it waited for the whole job)."""
    encoder = PromptEncoder(make_tokenizer())
    long_text = "w5 " * 1_000_000
    assert len(long_text) > LIMITS.max_prompt_tokens * encoder.max_token_chars  # over the bound
    finished: list[str] = []

    async def encode(tenant: str, text: str, may_truncate: bool) -> list[int]:
        if route == "chat":
            ids = await encoder.chat_ids([{"role": "user", "content": text}], tenant, LIMITS, may_truncate)
        else:
            ids = await encoder.completion_ids(text, tenant, LIMITS, may_truncate)
        finished.append(tenant)
        return ids

    async def scenario() -> list[int]:
        long = asyncio.create_task(encode("alice", long_text, may_truncate=True))
        await asyncio.sleep(0.05)  # alice's job is running
        await encode("bob", "w5 w6", may_truncate=False)
        return await long

    long_ids = asyncio.run(scenario())
    encoder.close()
    assert finished == ["bob", "alice"]
    assert long_ids.count(5) >= 1_000_000  # tokenized whole (the engine cuts it)


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



# ---- tool definitions count against the prompt limit ---------------------------------------

LOOKUP = {"type": "object", "properties": {"q": {"type": "string", "description": "x" * 300}}}
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}}]
CONVERSATION = [{"role": "user", "content": "hi"}]
ROOMY = AdmissionLimits(max_model_len=1024, kv_cache_tokens=2048, vocab_size=128)
TIGHT = AdmissionLimits(max_model_len=256, kv_cache_tokens=2048, vocab_size=128)  # the messages fit, the tools not


def _char_encoder(renders_tools: bool) -> PromptEncoder:
    """The character-level tokenizer; its template renders the tools, or (like many) leaves them out."""
    tokenizer = make_char_tokenizer()
    if not renders_tools:
        tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                                   "{% if add_generation_prompt %}<assistant>{% endif %}")
    return PromptEncoder(tokenizer)


async def _chat_ids(encoder: PromptEncoder, limits: AdmissionLimits,
                    tools: list[dict[str, Any]] | None) -> list[int]:
    return await encoder.chat_ids(CONVERSATION, "alice", limits, False, tools)


@pytest.mark.parametrize("renders_tools", [True, False])
def test_tool_definitions_count_against_the_prompt_limit(renders_tools: bool) -> None:
    """The tools count as if rendered, whether the template renders them or not: a required
    call's grammar is built from them, and a template that leaves them out must not make them free."""
    encoder = _char_encoder(renders_tools)

    async def scenario() -> None:  # one event loop: the encoder's queue lives on it
        with_tools = await _chat_ids(encoder, ROOMY, TOOLS)
        assert (len(with_tools) > TIGHT.max_prompt_tokens) == renders_tools  # only a rendering template shows them
        with pytest.raises(ContextLengthExceeded, match="tool definitions count as") as info:
            await _chat_ids(encoder, TIGHT, TOOLS)
        assert info.value.num_prompt_tokens > TIGHT.max_prompt_tokens
        assert len(await _chat_ids(encoder, TIGHT, None)) < TIGHT.max_prompt_tokens, "the messages alone fit"

    asyncio.run(scenario())
    encoder.close()


def test_the_tool_count_check_fails_without_the_front_door() -> None:
    encoder = _char_encoder(renders_tools=False)
    with inject(Fault.SKIP_FRONT_DOOR_ADMISSION), pytest.raises(pytest.fail.Exception):
        with pytest.raises(ContextLengthExceeded):
            asyncio.run(_chat_ids(encoder, TIGHT, TOOLS))
    encoder.close()


def test_the_prescan_bounds_each_token_id_prompt_on_its_own() -> None:
    """A big body's token-id prompts are pre-scanned one by one (each is admitted on its own):
    two that fit pass however many ids they hold together, one that cannot fit is refused."""
    import json

    from kvseal.server.prompts import PRESCAN_BODY_BYTES, check_token_list_before_parsing

    def body(*lengths: int) -> bytes:
        prompts = [[5] * n for n in lengths]
        data = json.dumps({"prompt": prompts if len(prompts) > 1 else prompts[0],
                           "pad": "x" * PRESCAN_BODY_BYTES}).encode()
        assert len(data) >= PRESCAN_BODY_BYTES
        return data

    check_token_list_before_parsing(body(500, 500, 500), LIMITS)  # 1,500 ids in all, each prompt fits
    check_token_list_before_parsing(body(512), LIMITS)
    for too_long in (body(513), body(10, 513), body(513, 10)):
        with pytest.raises(ContextLengthExceeded):
            check_token_list_before_parsing(too_long, LIMITS)


def _tokenizer_with_bos() -> PreTrainedTokenizerFast:
    from tokenizers import processors

    fast = make_tokenizer()
    bos = fast.convert_tokens_to_ids("<s>")
    fast.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                                          special_tokens=[("<s>", bos)])
    return fast


def test_add_special_tokens_as_vllm_takes_it_for_text_and_for_chat() -> None:
    """vLLM's field: a text prompt gets the tokenizer's BOS unless it is false; a chat prompt
    only when it is true (its template writes what it needs)."""
    tokenizer = _tokenizer_with_bos()
    bos = tokenizer.convert_tokens_to_ids("<s>")
    encoder = PromptEncoder(tokenizer)
    conversation = [{"role": "user", "content": "w10"}]

    async def scenario() -> tuple[list[int], ...]:
        return (await encoder.completion_ids("w5 w6", "t", LIMITS, may_truncate=False),
                await encoder.completion_ids("w5 w6", "t", LIMITS, may_truncate=False, add_special_tokens=False),
                await encoder.completion_prompts(["w5"], "t", LIMITS, False, add_special_tokens=False),  # type: ignore[arg-type]
                await encoder.chat_ids(conversation, "t", LIMITS, may_truncate=False),
                await encoder.chat_ids(conversation, "t", LIMITS, may_truncate=False,
                                       options=ChatOptions.of(add_special_tokens=True)))

    with_bos, without, listed, chat, chat_with_bos = asyncio.run(scenario())
    encoder.close()
    assert with_bos == [bos, 5, 6] and without == [5, 6] and listed == [[5]]
    assert chat[0] != bos and chat_with_bos == [bos, *chat]
    assert CompletionRequest.model_validate({"prompt": "x"}).add_special_tokens
    assert not ChatCompletionRequest.model_validate({"messages": conversation}).add_special_tokens
