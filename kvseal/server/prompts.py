"""Prompts to token ids with the model's own tokenizer and chat template (for I1 at the door).

The frontend tokenizes exactly as the engine does (`LLMEngine.tokenize`, `LLM.chat`), so the
count it admits is the count the engine re-checks. Tokenization runs on one worker thread:
off the event loop, and never concurrently (fast tokenizers are not safe for that).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvseal.errors import InvalidParameter
from kvseal.prompting import encode_text, render_chat

CompletionPrompt = str | list[int] | list[str] | list[list[int]]


class PromptEncoder:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvseal-tokenizer")
        self._token_texts: dict[int, str] = {}

    @classmethod
    def load(cls, tokenizer_path: str) -> PromptEncoder:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True))

    async def completion_ids(self, prompt: CompletionPrompt) -> list[int]:
        single = _single_prompt(prompt)
        if isinstance(single, list):
            return single
        return await self._run(self._encode, single)

    async def chat_ids(self, conversation: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None) -> list[int]:
        """`tools` (OpenAI tool definitions) go to the chat template, which renders them."""
        return await self._run(self._apply_chat_template, (conversation, tools))

    async def decode(self, token_ids: list[int]) -> str:
        """Token ids back to text (special tokens kept), on the tokenizer thread."""
        return str(await self._run(self.tokenizer.decode, token_ids))

    def token_text(self, token_id: int) -> str:
        """The text of one token, as logprobs report it."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = str(self.tokenizer.decode([token_id]))
        return text

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Any, arg: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, arg)

    def _encode(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text)

    def _apply_chat_template(self, args: tuple[list[dict[str, Any]], list[dict[str, Any]] | None]) -> list[int]:
        return render_chat(self.tokenizer, *args)


def _single_prompt(prompt: CompletionPrompt) -> str | list[int]:
    """One prompt per request: a string, token ids, or a one-element list of either."""
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) != 1:
            raise InvalidParameter(f"got {len(prompt)} prompts; kvseal takes one prompt per request, "
                                   f"send them as separate requests", param="prompt")
        return prompt[0]  # type: ignore[return-value]
    return prompt  # type: ignore[return-value]
