"""Reasoning output on chat completions, as vLLM's `--reasoning-parser qwen3` / `deepseek_r1`.

Thinking models write their reasoning between `<think>` and `</think>`, then the answer. With a
reasoning parser the reasoning goes to the message's `reasoning` (and `reasoning_content`, its
earlier name, which clients still read) and only the answer to `content`. The reasoning is open
from the start when the output begins with `<think>` (Qwen3 up to its 2507 releases) or when
the prompt ends inside an open `<think>` (DeepSeek-R1's template, Qwen3.5's); it ends at the
first `</think>`, and an output cut before it is all reasoning. Otherwise (Qwen3 with
`enable_thinking: false`, whose template closes the block in the prompt) the output is all
content. Both parsers read the same markers, so they share this code.

A structured output (response_format, guided_*, a forced tool call) constrains the answer, not
the reasoning, as vLLM's does: the markers must be tokens of the model's vocabulary (thinking
models have them), and the engine masks nothing until the `</think>` token
(`types.ReasoningGate`, `structured/matching.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvseal.errors import ConfigError

REASONING_PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningMarkers:
    """The model's `<think>` and `</think>` tokens."""

    start_token_id: int
    end_token_id: int


def reasoning_markers(parser: str | None, tokenizer: Any) -> ReasoningMarkers | None:
    """The markers' token ids for `--reasoning-parser` (None without one). Raises ConfigError
    where the model writes a marker in more than one token: its grammar could not tell where
    the reasoning ends (vLLM's parsers refuse such a model at start-up too)."""
    if parser is None:
        return None
    ids = [tokenizer.encode(marker, add_special_tokens=False) for marker in (START, END)]
    for marker, marker_ids in zip((START, END), ids):
        if len(marker_ids) != 1 or tokenizer.decode(marker_ids) != marker:  # (an unknown word reads as <unk>)
            raise ConfigError(f"--reasoning-parser {parser} needs {START} and {END} to be tokens of the model's "
                              f"vocabulary, as thinking models have them; this tokenizer writes {marker} as "
                              f"{tokenizer.convert_ids_to_tokens(marker_ids)}")
    return ReasoningMarkers(ids[0][0], ids[1][0])


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Whether a prompt ending in `prompt_tail` leaves a `<think>` block open for the output."""
    return prompt_tail.rfind(START) > prompt_tail.rfind(END)


def split_reasoning(text: str, open_at_start: bool) -> tuple[str | None, str]:
    """(reasoning, or None when the output has none; content) of a whole output."""
    stream = ReasoningStream(open_at_start)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    return (reasoning + more_reasoning if stream.has_reasoning else None), content + more_content


class ReasoningStream:
    """One streamed choice: each text delta in, its (reasoning, content) parts out. A possible
    beginning of a marker at the end of what arrived is held back until the next delta (or the
    end) shows whether it is one."""

    def __init__(self, open_at_start: bool) -> None:
        self._text = ""
        self._sent = 0
        self._state = "reasoning" if open_at_start else "start"
        self.has_reasoning = open_at_start

    def feed(self, new_text: str) -> tuple[str, str]:
        self._text += new_text
        if self._state == "start":
            if START.startswith(self._text):  # still could be the start marker
                return "", ""
            if self._text.startswith(START):
                self._state, self._sent, self.has_reasoning = "reasoning", len(START), True
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._text.find(END, self._sent)
            if end < 0:
                safe = _before_partial(self._text, END, self._sent)
                reasoning, self._sent = self._text[self._sent:safe], safe
                return reasoning, ""
            reasoning = self._text[self._sent:end]
            self._state, self._sent = "content", end + len(END)
            content, self._sent = self._text[self._sent:], len(self._text)
            return reasoning, content
        content, self._sent = self._text[self._sent:], len(self._text)
        return "", content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the choice has ended: an unfinished reasoning block is
        reasoning; a short output that might have begun a marker is content."""
        rest, self._sent = self._text[self._sent:], len(self._text)
        return (rest, "") if self._state == "reasoning" else ("", rest)


def _before_partial(text: str, marker: str, start: int) -> int:
    """Where a possible beginning of `marker` at the end of `text` starts (len(text) if none), not before `start`."""
    for size in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[-size:]):
            return len(text) - size
    return len(text)
