"""Prompts to token ids, shared by the offline API, the engine and the HTTP frontend.

One implementation, so a prompt given to `LLM.chat` and the same messages sent to
`/v1/chat/completions` become the same token ids.
"""

from __future__ import annotations

from typing import Any

from kvseal.errors import InvalidParameter


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """A plain-text prompt, with the tokenizer's special tokens (e.g. BOS) as the model expects."""
    return list(tokenizer.encode(text, add_special_tokens=True))


def render_chat(tokenizer: Any, conversation: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None, *, chat_template: str | None = None,
                add_generation_prompt: bool = True) -> list[int]:
    """Apply the model's chat template (or `chat_template`, a Jinja template given by the offline
    caller) with the generation prompt unless told not to (and `tools`, OpenAI tool
    definitions, for templates that render them); raise `InvalidParameter` (param "messages")
    when there is no template or the template refuses the messages."""
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise InvalidParameter("this model has no chat template; send a plain-text prompt instead",
                               param="messages")
    try:
        ids = tokenizer.apply_chat_template(conversation, tools=tools, chat_template=chat_template,
                                            add_generation_prompt=add_generation_prompt, tokenize=True)
    except Exception as exc:  # jinja2 errors and raise_exception() calls in templates
        raise InvalidParameter(f"the model's chat template cannot render these messages: {exc}",
                               param="messages") from exc
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
