"""Prompts to token ids, shared by the offline API, the engine and the HTTP frontend.

One implementation, so a prompt given to `LLM.chat` and the same messages sent to
`/v1/chat/completions` become the same token ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvseal.errors import ConfigError, InvalidParameter


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """A plain-text prompt, with the tokenizer's special tokens (e.g. BOS) as the model expects
    (vLLM's `add_special_tokens`, true by default for text: false leaves them out)."""
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


@dataclass(frozen=True)
class ChatOptions:
    """How a conversation is rendered besides its messages and tools (vLLM's chat fields): the
    generation prompt, or the final (assistant) message left open for the model to continue, and
    extra variables for the template (`chat_template_kwargs`, e.g. Qwen3's `enable_thinking`)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: tuple[tuple[str, Any], ...] = ()
    # vLLM's: also the tokenizer's special tokens around the rendered text (the template usually
    # writes BOS itself, hence false by default)
    add_special_tokens: bool = False

    @classmethod
    def of(cls, add_generation_prompt: bool = True, continue_final_message: bool = False,
           template_kwargs: Mapping[str, Any] | None = None, add_special_tokens: bool = False) -> ChatOptions:
        """Raise `InvalidParameter` for both a generation prompt and an open final message, or a
        template variable that would stand for one of apply_chat_template's own arguments."""
        if add_generation_prompt and continue_final_message:
            raise InvalidParameter("continue_final_message leaves the last message open for the model; it cannot "
                                   "be combined with add_generation_prompt: send add_generation_prompt=false",
                                   param="continue_final_message")
        if template_kwargs is not None and not (isinstance(template_kwargs, Mapping)
                                                and all(isinstance(k, str) for k in template_kwargs)):
            raise InvalidParameter(f"chat_template_kwargs must be a mapping of template variable names to values, "
                                   f"got {type(template_kwargs).__name__}", param="chat_template_kwargs")
        kwargs = dict(template_kwargs or {})
        reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_VARIABLES)
        if reserved:
            raise InvalidParameter(f"chat_template_kwargs may not set {reserved}: the request's own fields do",
                                   param="chat_template_kwargs")
        return cls(add_generation_prompt, continue_final_message, tuple(sorted(kwargs.items())), add_special_tokens)


DEFAULT_CHAT = ChatOptions()  # the generation prompt, no open final message, no template variables

# apply_chat_template's own arguments, and the variables it passes the template itself
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "bos_token", "eos_token", "unk_token", "pad_token",
    "raise_exception", "strftime_now",
})


def load_chat_template(source: str) -> str:
    """vLLM's `--chat-template`: a file holding a Jinja chat template, or the template itself
    (a value with `{`, `}` or a newline in it that names no file; `\n`-style escapes in it are
    read as the characters they stand for). Raises ConfigError for a value that is neither
    (`check_chat_template` tries the template itself once the tokenizer is loaded)."""
    import codecs
    from pathlib import Path

    path = Path(source)
    try:
        template = path.read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:
        if not any(c in source for c in "{}\n"):
            raise ConfigError(f"--chat-template {source!r} names no readable file ({exc}) and is not a "
                              f"template") from None
        template = codecs.decode(source, "unicode_escape")
    return template


def check_chat_template(tokenizer: Any, template: str) -> None:
    """Render one user message with `template`, as every chat request will: a ConfigError, so a
    server never starts with a template that fails every request."""
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template, tokenize=False,
                                      add_generation_prompt=True)
    except Exception as exc:  # jinja2's syntax and rendering errors, raise_exception() in the template
        raise ConfigError(f"--chat-template cannot render a conversation: {exc}") from None


def render_chat(tokenizer: Any, conversation: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None, *, chat_template: str | None = None,
                options: ChatOptions = DEFAULT_CHAT) -> list[int]:
    """Apply the model's chat template (or `chat_template`, a Jinja template given by the offline
    caller) as `options` say (and `tools`, OpenAI tool definitions, for templates that render
    them); raise `InvalidParameter` (param "messages") when there is no template or the template
    refuses the messages."""
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise InvalidParameter("this model has no chat template; send a plain-text prompt instead",
                               param="messages")
    try:
        ids = tokenizer.apply_chat_template(conversation, tools=tools, chat_template=chat_template,
                                            add_generation_prompt=options.add_generation_prompt,
                                            continue_final_message=options.continue_final_message,
                                            tokenize=not options.add_special_tokens, **dict(options.template_kwargs))
    except Exception as exc:  # jinja2 errors and raise_exception() calls in templates
        raise InvalidParameter(f"the model's chat template cannot render these messages: {exc}",
                               param="messages") from exc
    if options.add_special_tokens:  # the rendered text, tokenized with the tokenizer's special tokens
        return encode_text(tokenizer, ids)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
