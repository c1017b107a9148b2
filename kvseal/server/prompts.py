"""Prompts to token ids with the model's own tokenizer and chat template (for I1 at the door).

The frontend tokenizes exactly as the engine does (`LLMEngine.tokenize`, `LLM.chat`), so the
count it admits is the count the engine re-checks.

Tokenization is bounded and fair:
- A prompt that cannot fit is refused before it is tokenized (unless the request asked for
  truncation): a token covers at most `max_token_chars` characters, so a text with more than
  `max_prompt_tokens * max_token_chars` characters besides whitespace has too many tokens, and a token-id list
  longer than `max_prompt_tokens` is too long as it is. Big bodies are pre-scanned for an
  over-long token-id list before the full JSON parse (which holds the GIL while it builds
  every int).
- Tokenization runs off the event loop in two lanes (`fair_lane.FairLane`), each one worker
  thread fed by per-tenant queues served round-robin (the second with its own copy of the
  tokenizer, made on first use: a fast tokenizer is not safe to encode with from two threads at once). Prompts within
  the bound above go to the first lane, where a tenant with a long queue delays another
  tenant's prompt by at most the one job already running, and that job is bounded. Prompts
  over the bound, which only a request asking for truncation gets past the door
  (`truncate_prompt_tokens`: tokenized whole, then cut), go to the second: one of them can
  take seconds (15 MB of text: ~10 s), and it never holds up the bounded ones.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from collections.abc import Callable
from typing import Any

import msgspec

from kvseal.admission import AdmissionLimits
from kvseal.errors import ContextLengthExceeded, InvalidParameter
from kvseal.prompting import DEFAULT_CHAT, ChatOptions, check_chat_template, encode_text, render_chat
from kvseal.server.fair_lane import FairLane
from kvseal.server.front_door import check_context, is_checking

logger = logging.getLogger("kvseal.server")

CompletionPrompt = str | list[int] | list[str] | list[list[int]]
MAX_PROMPTS = 128  # prompts in one completions request (each is admitted, and counted, on its own)
PRESCAN_BODY_BYTES = 64 * 1024  # bodies at least this big are pre-scanned for long token-id lists
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class _Lane:
    """A `FairLane` of tokenizer jobs, `fn(tokenizer, arg)`. With `own_copy`, the lane's thread
    copies the tokenizer before its first job and uses only that copy."""

    def __init__(self, tokenizer: Any, name: str, own_copy: bool = False) -> None:
        self._source = tokenizer
        self._tokenizer = None if own_copy else tokenizer
        self._lane = FairLane(name)

    async def run(self, tenant: str, fn: Callable[[Any, Any], Any], arg: Any) -> Any:
        return await self._lane.run(tenant, self._call, fn, arg)

    def _call(self, fn: Callable[[Any, Any], Any], arg: Any) -> Any:
        """In the lane's thread."""
        if self._tokenizer is None:
            self._tokenizer = copy.deepcopy(self._source)  # ~0.15 s for a 49K vocabulary, once
        return fn(self._tokenizer, arg)

    def close(self) -> None:
        """Stop the worker; jobs still queued are cancelled."""
        self._lane.close()


class PromptEncoder:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.max_token_chars = _longest_token_chars(tokenizer)
        self._byte_decoder = _byte_level_decoder(tokenizer)
        self._lane = _Lane(tokenizer, "kvseal-tokenizer")
        self._long_lane = _Lane(tokenizer, "kvseal-tokenizer-long", own_copy=True)
        self._token_texts: dict[int, str] = {}

    @classmethod
    def load(cls, tokenizer_path: str, chat_template: str | None = None) -> PromptEncoder:
        """`chat_template` (`--chat-template`) replaces the model's; ConfigError if it cannot
        render a conversation."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
        if chat_template is not None:
            check_chat_template(tokenizer, chat_template)
            tokenizer.chat_template = chat_template
        return cls(tokenizer)

    async def completion_prompts(self, prompt: CompletionPrompt, tenant: str, limits: AdmissionLimits,
                                 may_truncate: bool, add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each prompt of a completions request (a string, token ids, or a list of
        up to `MAX_PROMPTS` of either), tokenized one after another in the tenant's turn; each
        as `completion_ids`."""
        return [await self._ids_of(one, tenant, limits, may_truncate, add_special_tokens)
                for one in prompt_list(prompt)]

    async def completion_ids(self, prompt: CompletionPrompt, tenant: str, limits: AdmissionLimits,
                             may_truncate: bool, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a completions prompt (text with the tokenizer's special tokens unless
        `add_special_tokens` is false); `ContextLengthExceeded` before tokenizing one that cannot
        fit (unless `may_truncate`)."""
        return await self._ids_of(_single_prompt(prompt), tenant, limits, may_truncate, add_special_tokens)

    async def _ids_of(self, single: str | list[int], tenant: str, limits: AdmissionLimits,
                      may_truncate: bool, add_special_tokens: bool = True) -> list[int]:
        if isinstance(single, list):
            if not may_truncate:
                check_context(len(single), 0, limits)
            return single
        num_chars = num_visible_chars(single)
        if not may_truncate:
            self._check_chars(num_chars, limits)
        encode = encode_text if add_special_tokens else _encode_plain
        return await self._lane_for(num_chars, limits).run(tenant, encode, single)

    async def chat_ids(self, conversation: list[dict[str, Any]], tenant: str, limits: AdmissionLimits,
                       may_truncate: bool, tools: list[dict[str, Any]] | None = None,
                       options: ChatOptions = DEFAULT_CHAT) -> list[int]:
        """`tools` (OpenAI tool definitions) go to the chat template, which may render them;
        either way they count against the prompt limit (`_check_tools_fit`). The template
        variables of `options` count with the messages' characters (a template may render them)."""
        tools_json = _tools_json(tools)
        num_tools_chars = num_visible_chars(tools_json)
        num_chars = num_tools_chars + sum(num_visible_chars(_text_of(m)) for m in conversation) + \
            num_visible_chars(json.dumps(dict(options.template_kwargs), ensure_ascii=False))
        # the template only adds tokens around the contents; truncation may cut the messages, not the tools
        self._check_chars(num_tools_chars if may_truncate else num_chars, limits)
        ids = await self._lane_for(num_chars, limits).run(tenant, _apply_chat_template,
                                                          (conversation, tools, options))
        if tools:
            await self._check_tools_fit(conversation, tools_json, tenant, limits, may_truncate, options)
        return ids

    async def _check_tools_fit(self, conversation: list[dict[str, Any]], tools_json: str, tenant: str,
                               limits: AdmissionLimits, may_truncate: bool, options: ChatOptions) -> None:
        """Tool definitions count against the prompt limit as if the template rendered them
        (as JSON) after the messages, whether it does or not: a required or named call's
        grammar is built from them, and a template that leaves them out must not make them free.
        A template that renders them has them in the prompt as well, where `admit` counts them."""
        if not is_checking():
            return
        num_tool_tokens = len(await self._lane.run(tenant, _encode_plain, tools_json))
        num_message_tokens = 0 if may_truncate else len(
            await self._lane.run(tenant, _apply_chat_template, (conversation, None, options)))
        limit = limits.max_prompt_tokens
        if num_message_tokens + num_tool_tokens <= limit:
            return
        raise ContextLengthExceeded(
            f"The tool definitions count as {num_tool_tokens} tokens against the prompt limit, and the messages "
            f"have {num_message_tokens}; prompts may have at most {limit} tokens, tool definitions included. "
            f"Send fewer or smaller tools, or shorten the messages.",
            num_prompt_tokens=num_message_tokens + num_tool_tokens, max_tokens=0,
            max_model_len=limits.max_model_len, kv_cache_tokens=limits.kv_cache_tokens)

    async def decode(self, token_ids: list[int], tenant: str) -> str:
        """Token ids back to text (special tokens kept), on the tokenizer thread."""
        return str(await self._lane.run(tenant, _decode, token_ids))

    def token_text(self, token_id: int) -> str:
        """The text of one token, as logprobs report it."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = str(self.tokenizer.decode([token_id]))
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes: for byte-level BPE a token may hold part of a UTF-8
        character, so joining the bytes of a text's tokens rebuilds the text's UTF-8."""
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_decoder is not None and all(c in self._byte_decoder for c in piece):
                return bytes(self._byte_decoder[c] for c in piece)
            fallback = _BYTE_FALLBACK.fullmatch(piece)  # SentencePiece byte fallback, e.g. <0xF0>
            if fallback is not None:
                return bytes([int(fallback.group(1), 16)])
        return self.token_text(token_id).encode("utf-8")

    def close(self) -> None:
        """Stop the tokenizer workers; jobs still queued are cancelled."""
        self._lane.close()
        self._long_lane.close()

    def _check_chars(self, num_chars: int, limits: AdmissionLimits) -> None:
        limit = limits.max_prompt_tokens
        if num_chars <= limit * self.max_token_chars or not is_checking():
            return
        at_least = -(-num_chars // self.max_token_chars)
        raise ContextLengthExceeded(
            f"Your prompt has {num_chars} characters besides spaces and a token of this model covers at most "
            f"{self.max_token_chars}, so it has at least {at_least} tokens; prompts may have at most {limit} "
            f"tokens. Shorten the prompt, or set truncate_prompt_tokens.",
            num_prompt_tokens=at_least, max_tokens=0, max_model_len=limits.max_model_len,
            kv_cache_tokens=limits.kv_cache_tokens)

    def _lane_for(self, num_chars: int, limits: AdmissionLimits) -> _Lane:
        """The long lane for a text over the character bound (let in only to be truncated)."""
        return self._lane if num_chars <= limits.max_prompt_tokens * self.max_token_chars else self._long_lane


def _encode_plain(tokenizer: Any, text: str) -> list[int]:
    """A piece of text as it would be inside a prompt: no special tokens added."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def _apply_chat_template(tokenizer: Any, args: tuple[list[dict[str, Any]], list[dict[str, Any]] | None,
                                                     ChatOptions]) -> list[int]:
    conversation, tools, options = args
    return render_chat(tokenizer, conversation, tools, options=options)


def _decode(tokenizer: Any, token_ids: list[int]) -> str:
    return str(tokenizer.decode(token_ids))


def check_token_list_before_parsing(data: bytes, limits: AdmissionLimits) -> None:
    """Refuse a big body whose `prompt` is a token-id list longer than the prompt limit, from
    a scan that builds no ints (`ContextLengthExceeded`); anything else is left to the parser."""
    fields = _prescanned_fields(data)
    if fields is None or "truncate_prompt_tokens" in fields:
        return
    num_ids_at_most = _token_list_length_at_most(fields, "prompt")
    if num_ids_at_most is not None and num_ids_at_most > limits.max_prompt_tokens:
        check_context(num_ids_at_most, 0, limits)


def prescan_token_list(data: bytes, field: str) -> int | None:
    """For a big body: at most how many ids the flat token-id list `field` holds (exact for a
    list of ints), counted without building them; None for a small body or any other shape."""
    fields = _prescanned_fields(data)
    return None if fields is None else _token_list_length_at_most(fields, field)


def _prescanned_fields(data: bytes) -> dict[str, msgspec.Raw] | None:
    """The top-level fields of a body of at least `PRESCAN_BODY_BYTES`, each left unparsed."""
    if len(data) < PRESCAN_BODY_BYTES:
        return None
    try:
        return msgspec.json.decode(data, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None  # the full parse reports it


def _token_list_length_at_most(fields: dict[str, msgspec.Raw], field: str) -> int | None:
    """At most how many ids the longest token-id list of `field` holds: the list itself, or
    the longest of a list of lists (several prompts, each admitted on its own)."""
    raw = bytes(fields.get(field, b""))
    if not raw.startswith(b"[") or b'"' in raw:
        return None
    if not raw[1:].lstrip().startswith(b"["):
        return raw.count(b",") + 1
    return max(part.lstrip(b", \t\r\n[").count(b",") + 1 for part in raw[1:].split(b"]"))


def _tools_json(tools: list[dict[str, Any]] | None) -> str:
    """Tool definitions as compact JSON (how templates render them with `tojson`); "" for none."""
    return json.dumps(tools, separators=(",", ":"), ensure_ascii=False) if tools else ""


def _text_of(message: dict[str, Any]) -> str:
    """A message's text content ("" for one without, e.g. an assistant turn of tool calls).
    Counting less text only weakens the pre-check's lower bound; it never refuses more."""
    content = message.get("content")
    return content if isinstance(content, str) else ""


def num_visible_chars(text: str) -> int:
    """Characters other than spaces, tabs and newlines: some tokenizers drop those, none drops
    the others, so every one of them is covered by a token (C-speed counting, no per-char loop)."""
    return len(text) - text.count(" ") - text.count("\n") - text.count("\t")


def _longest_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token can stand for (computed once, at start-up).

    A piece's length bounds the characters it decodes to (byte-level BPE: one piece character
    per byte). Prompts are measured without spaces, tabs and newlines, which whitespace-
    splitting tokenizers drop; byte-level BPE and SentencePiece drop no character at all.
    """
    longest = 1
    for piece in tokenizer.get_vocab():
        longest = max(longest, len(piece))
    for added in getattr(tokenizer, "all_special_tokens", []):
        longest = max(longest, len(added))
    return longest


def _byte_level_decoder(tokenizer: Any) -> dict[str, int] | None:
    """GPT-2's printable-character → byte map, when the tokenizer is byte-level BPE."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    return {char: byte for byte, char in _byte_level_alphabet().items()}


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character map: printable Latin-1 bytes stand for themselves,
    the other bytes (controls, space, ...) for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    alphabet = {byte: chr(byte) for byte in printable}
    others = (byte for byte in range(256) if byte not in alphabet)
    for index, byte in enumerate(others):
        alphabet[byte] = chr(256 + index)
    return alphabet


def prompt_list(prompt: CompletionPrompt) -> list[str | list[int]]:
    """The prompts of a completions request: a string or token ids is one; a list of strings or
    of token-id lists is several (at most `MAX_PROMPTS`, a 400 otherwise), as OpenAI takes them."""
    if isinstance(prompt, str) or not prompt or not all(isinstance(p, str | list) for p in prompt):
        return [prompt]  # type: ignore[list-item]
    if len(prompt) > MAX_PROMPTS:
        raise InvalidParameter(f"got {len(prompt)} prompts; a request may send at most {MAX_PROMPTS}, send the "
                               f"rest in another request", param="prompt")
    return list(prompt)  # type: ignore[arg-type]


def _single_prompt(prompt: CompletionPrompt) -> str | list[int]:
    """The one prompt /tokenize takes: a string, token ids, or a one-element list of either."""
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) != 1:
            raise InvalidParameter(f"got {len(prompt)} prompts; kvseal takes one prompt per request, "
                                   f"send them as separate requests", param="prompt")
        return prompt[0]  # type: ignore[return-value]
    return prompt  # type: ignore[return-value]
