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
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Apply the model's chat template with the generation prompt (and `tools`, OpenAI tool
    definitions, for templates that render them); raise `InvalidParameter` (param "messages")
    when the model has no template or the template refuses the messages."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidParameter("this model has no chat template; send a plain-text prompt instead",
                               param="messages")
    try:
        ids = tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # jinja2 errors and raise_exception() calls in templates
        raise InvalidParameter(f"the model's chat template cannot render these messages: {exc}",
                               param="messages") from exc
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
