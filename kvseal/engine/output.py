"""Per-request output state: incremental detokenization and stop conditions.

Text is decoded incrementally (a few prompt tokens of context, then only new tokens), held
back while it ends in an incomplete UTF-8 sequence, and, while stop strings are possible,
held back by (longest stop string - 1) characters so a stream never shows part of a stop
string that later matches. A matched stop string is cut from the text, or with
`include_stop_str_in_output` (vLLM's) kept and only what follows it cut (nothing is held back
then: a partial match would be shown in the end anyway). A request ended by a token (EOS, one of
`stop_token_ids`, or the stop token that completes its grammar) has that token's text left out,
as vLLM's detokenizer leaves it out, unless `include_stop_str_in_output`: it matters for a stop
token that is not special, or any with `skip_special_tokens=False`. The token stays in the ids.
A request with a grammar (structured output) finishes when its grammar is complete.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvseal.structured.matching import accept_token, is_complete
from kvseal.types import FinishReason, Request, RequestOutput

_CONTEXT_TOKENS = 5
GRAMMAR_REFUSED_TOKEN = "grammar_refused_token"


def text_decoder(tokenizer: Any, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """ids -> text, as `tokenizer.decode(ids, skip_special_tokens=...)` (special tokens skipped
    unless a request asks for them: vLLM's `skip_special_tokens=False`). A Hugging Face fast
    tokenizer that does no clean-up of the text decodes in its Rust backend directly: the same
    string, without the wrapper's ~5 us of Python a call (two calls a token for every running
    request, every step)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if getattr(tokenizer, "clean_up_tokenization_spaces", True) is False and callable(getattr(backend, "decode", None)):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)  # type: ignore[union-attr]
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class OutputState:
    def __init__(self, request: Request, decode: Callable[[list[int]], str], eos_token_ids: tuple[int, ...]) -> None:
        """decode: ids -> text, special tokens skipped or not as the request asks (`text_decoder`)."""
        self.request = request
        self._decode = decode
        self._eos = set(eos_token_ids)
        self._ids = request.prompt_token_ids[-_CONTEXT_TOKENS:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self._num_emitted_chars = 0
        self._num_reported_tokens = 0
        assert request.params.max_tokens is not None, "max_tokens=None is resolved when the engine admits a request"
        self._max_tokens = request.params.max_tokens
        self._holdback = (0 if request.params.include_stop_str_in_output
                          else max((len(s) for s in request.params.stop), default=1) - 1)

    def append_token(self, token: int) -> None:
        """Record a sampled token; finish the request if it meets a stop condition."""
        request = self.request
        request.output_token_ids.append(token)
        request.note_token()
        self._ids.append(token)
        delta = self._decode_delta()
        self.text += delta
        if request.grammar is not None and self._check_grammar(token):
            self._drop_stop_token_text(delta)
            return
        if request.num_output_tokens >= request.params.min_tokens:
            self._check_stop(token, delta)
        if request.finish_reason is None and request.num_output_tokens >= self._max_tokens:
            request.finish_reason = FinishReason.LENGTH

    def _check_grammar(self, token: int) -> bool:
        """Advance the grammar; True if that ended the request (complete, or a refused token)."""
        request = self.request
        if not accept_token(request, token):  # the mask allows only accepted tokens: an engine bug
            request.finish_reason, request.stop_reason = FinishReason.ABORT, GRAMMAR_REFUSED_TOKEN
            return True
        if is_complete(request):
            request.finish_reason, request.stop_reason = FinishReason.STOP, None
            return True
        return False

    def _decode_delta(self) -> str:
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix):]

    def _check_stop(self, token: int, delta: str) -> None:
        request, params = self.request, self.request.params
        if token in params.stop_token_ids:
            request.finish_reason, request.stop_reason = FinishReason.STOP, token
        elif token in self._eos and not params.ignore_eos:
            request.finish_reason, request.stop_reason = FinishReason.STOP, None
        else:
            self._check_stop_strings(len(delta))
            return
        self._drop_stop_token_text(delta)

    def _drop_stop_token_text(self, delta: str) -> None:
        """The text of the token that ended the request leaves the output (it has not been
        reported yet: it was decoded this step), unless the request asked to keep it."""
        request = self.request
        if request.finish_reason is FinishReason.STOP and delta and not request.params.include_stop_str_in_output:
            self.text = self.text[:len(self.text) - len(delta)]

    def _check_stop_strings(self, num_new_chars: int) -> None:
        for stop in self.request.params.stop:
            index = self.text.find(stop, max(0, len(self.text) - num_new_chars - len(stop) + 1))
            if index >= 0:
                self.text = self.text[:index + len(stop) if self.request.params.include_stop_str_in_output else index]
                self.request.finish_reason, self.request.stop_reason = FinishReason.STOP, stop
                return

    def report(self, finished: bool, error: str | None = None, error_code: str | None = None,
               num_kv_tokens_written: int = 0) -> RequestOutput:
        """The increment since the previous report (text is held back per the module doc)."""
        request = self.request
        visible = len(self.text) if finished else max(self._num_emitted_chars, len(self.text) - self._holdback)
        new_text = self.text[self._num_emitted_chars:visible]
        new_tokens = request.output_token_ids[self._num_reported_tokens:]
        self._num_emitted_chars, self._num_reported_tokens = visible, request.num_output_tokens
        logprobs = request.output_logprobs if request.params.logprobs is not None else None
        return RequestOutput(
            request_id=request.request_id, tenant=request.tenant, prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids), text=self.text[:visible], new_token_ids=new_tokens,
            new_text=new_text, finished=finished, finish_reason=request.finish_reason,
            stop_reason=request.stop_reason, logprobs=logprobs, error=error, error_code=error_code,
            num_pages_reserved=request.max_num_pages, num_kv_tokens_written=num_kv_tokens_written,
            num_cached_tokens=request.num_cached_tokens,
            prompt_token_logprobs=None if request.needs_prompt_logprobs else request.prompt_logprobs,
            timing=request.timing() if finished else None,
        )
