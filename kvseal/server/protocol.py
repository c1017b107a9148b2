"""Request bodies of the OpenAI API as kvseal accepts them (pydantic, strict, extra="forbid").

A field kvseal does not implement is rejected, never ignored: undeclared fields fail with
`extra_forbidden`. OpenAI's `n`, `presence_penalty`, `frequency_penalty`, `logit_bias`,
`response_format`, `echo` and vLLM's extensions `ignore_eos`, `min_tokens`, `top_k`,
`repetition_penalty`, `stop_token_ids`, `truncate_prompt_tokens`, `prompt_logprobs`,
`structured_outputs` and `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` are
honoured; `best_of` equal to `n`, chat's `store: false` and `metadata` ask for nothing and are taken
as vLLM takes them (any other `best_of`, and `store: true`, are refused). So are vLLM's fields at
the value that asks for nothing (`use_beam_search: false`, `priority: 0`,
`spaces_between_special_tokens: true`, `return_tokens_as_token_ids: false`, `return_token_ids:
false`, `bad_words: []`, and `length_penalty`, which only beam search reads); any other value
is refused, naming the field. As in vLLM's server, `logit_bias` values are clamped to [-100, 100],
`seed: -1` means unseeded and `truncate_prompt_tokens: -1` the most a prompt may have.

Every list and string has a bound, so no field makes the parser, the tokenizer, the grammar
compiler or the audit log work without limit (a bad value is a 400 naming the field and the
limit). The static bounds are here; prompt text and token ids are bounded by the engine's
prompt limit (I1, checked before tokenizing or parsing them: `kvseal.server.prompts`), and the
text the chat template renders besides the messages' contents by `kvseal.server.bounds`.
JSON nesting is bounded by the parser (a body nested deeper than its recursion limit is
`invalid_json`), the JSON text of tool call arguments by `MAX_ARGUMENTS_DEPTH`, and the whole
body by --max-body-bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from kvseal.prompting import ChatOptions
from kvseal.structured.schema import MAX_CHOICES, MAX_SCHEMA_CHARS, MAX_SCHEMA_DEPTH, MAX_TOOLS, json_depth
from kvseal.types import MAX_CACHE_SALT_CHARS, MAX_LOGPROBS, MAX_N

INT32_MAX = 2**31 - 1
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_TOKEN_ID_DIGITS = 10  # a logit_bias key: a token id below 2**31, in decimal
MAX_NAME_CHARS = 256  # model names, tool call ids and other identifiers a client sends
MAX_FUNCTION_NAME_CHARS = 64  # OpenAI's limit on function (and message author) names
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 256  # characters in one stop string
MAX_STOP_TOKEN_IDS = 64
MAX_ALLOWED_TOKEN_IDS = 262_144  # allowed_token_ids: more than any vocabulary kvseal serves
MAX_MESSAGES = 2048  # messages per chat request
MAX_CONTENT_PARTS = 1024  # parts of one message's content
MAX_DESCRIPTION_CHARS = 4096  # a tool's or a response schema's description
MAX_ARGUMENTS_DEPTH = MAX_SCHEMA_DEPTH  # objects and arrays nested in one tool call's arguments
MAX_TEMPLATE_KWARGS = 32  # chat_template_kwargs entries
MAX_TEMPLATE_KWARGS_CHARS = 4096  # chat_template_kwargs as JSON
MAX_METADATA = 16  # OpenAI's limits on a chat request's metadata: pairs, key and value characters
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
COMPLETION_MAX_TOKENS = 16  # /v1/completions' max_tokens when left out (OpenAI's and vLLM's)

Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
FunctionName = Annotated[str, Field(min_length=1, max_length=MAX_FUNCTION_NAME_CHARS)]
Description = Annotated[str, Field(max_length=MAX_DESCRIPTION_CHARS)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


def _unseeded(seed: int) -> int | None:
    """vLLM's seed -1: no seed."""
    return None if seed == -1 else seed


def _clamped_bias(bias: float) -> float:
    """vLLM's server clamps each bias to OpenAI's range rather than refusing it."""
    return min(100.0, max(-100.0, bias))


def _not_zero(value: int) -> int:
    if value == 0:
        raise ValueError("must be >= 1 (the prompt's last tokens to keep), or -1 for the most a prompt may have")
    return value


# vLLM's request fields kvseal takes at the value that asks for nothing: that value, and why another is refused
NOTHING_ASKED: dict[str, tuple[bool | int, str]] = {
    "use_beam_search": (False, "beam search is not implemented; send false or omit it"),
    "priority": (0, "kvseal does not schedule by priority (every tenant is served first come, first served); "
                    "send 0 or omit it"),
    "spaces_between_special_tokens": (True, "not implemented; send true or omit it"),
    "return_tokens_as_token_ids": (False, "not implemented; send false or omit it"),
    "return_token_ids": (False, "not implemented; send false or omit it"),
}


class _Body(BaseModel):
    """A field sent as null is taken as not sent, at every level of a body, as OpenAI's API and
    vLLM take it: clients echo back what they were given with None for what was absent (the
    `openai` client's `model_dump()` of an assistant message has `refusal`, `audio`, ... None),
    and an unsupported field sent as null asks for nothing, so it passes."""

    model_config = ConfigDict(extra="forbid", strict=True)
    nulls_taken: ClassVar[frozenset[str]] = frozenset()  # fields whose null means something else than omitted

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_sent(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {key: value for key, value in data.items() if value is not None or key in cls.nulls_taken}


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its choice's usage


class JsonSchemaFormat(_Body):
    name: FunctionName
    description: Description | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


SpecText = Annotated[str, Field(min_length=1, max_length=MAX_SCHEMA_CHARS)]  # a regex, an EBNF grammar, ...
JsonSchemaSpec = dict[str, Any] | SpecText  # a JSON Schema as an object or as JSON text
ChoiceList = Annotated[list[SpecText], Field(min_length=1, max_length=MAX_CHOICES)]


class StructuredOutputsSpec(_Body):
    """vLLM's `structured_outputs`: exactly one of these (checked when the request is prepared)."""

    json_spec: JsonSchemaSpec | None = Field(default=None, alias="json")
    regex: SpecText | None = None
    choice: ChoiceList | None = None
    grammar: SpecText | None = None
    json_object: bool | None = None


class GenerationBody(_Body):
    """Fields both endpoints share (a field sent as null is not sent: `_Body`)."""

    model: Name | None = None
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    seed: Annotated[int, Field(ge=-2**63, le=2**63 - 1), AfterValidator(_unseeded)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10, allow_inf_nan=False)] | None = None
    logit_bias: Annotated[dict[Annotated[str, Field(max_length=MAX_TOKEN_ID_DIGITS)],
                               Annotated[float, Field(allow_inf_nan=False), AfterValidator(_clamped_bias)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX)]],
                              Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    user: Name | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0
    # -1: the most a prompt may have (vLLM's)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT32_MAX), AfterValidator(_not_zero)] | None = None
    response_format: ResponseFormat | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX)]],
                                 Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    # vLLM's: this request's prefix cache is its tenant's, split by the salt (kvseal.types.namespace_of)
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None
    # vLLM's structured outputs, besides OpenAI's response_format: at most one spec per request
    structured_outputs: StructuredOutputsSpec | None = None
    guided_json: JsonSchemaSpec | None = None
    guided_regex: SpecText | None = None
    guided_choice: ChoiceList | None = None
    guided_grammar: SpecText | None = None
    # vLLM's fields, taken at the value that asks for nothing (`_asks_for_nothing`)
    use_beam_search: bool = False
    length_penalty: Annotated[float, Field(allow_inf_nan=False)] = 1.0  # beam search's alone, as in vLLM
    priority: int = 0
    spaces_between_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    bad_words: Annotated[list[Name], Field(max_length=MAX_STOP)] = []

    @field_validator("use_beam_search", "priority", "spaces_between_special_tokens", "return_tokens_as_token_ids",
                     "return_token_ids")
    @classmethod
    def _asks_for_nothing(cls, value: bool | int, info: ValidationInfo) -> bool | int:
        """Clients that always send vLLM's defaults are served; a value that asks for what kvseal
        does not do is refused, naming the field, never ignored."""
        if value != NOTHING_ASKED[str(info.field_name)][0]:
            raise ValueError(f"{info.field_name}={json.dumps(value)}: {NOTHING_ASKED[str(info.field_name)][1]}")
        return value

    @field_validator("bad_words")
    @classmethod
    def _no_bad_words(cls, value: list[str]) -> list[str]:
        if value:
            raise ValueError("bad_words is not implemented; a single-token word can be banned with "
                             "logit_bias -100, or send an empty list")
        return value

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def include_continuous_usage(self) -> bool:
        """vLLM's `continuous_usage_stats`: honoured with `include_usage`, as there."""
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(GenerationBody):
    """`max_tokens` left out is 16, OpenAI's and vLLM's default for this endpoint; sent as null, it
    is the rest of the context (or the model's `max_new_tokens`), as chat's left out is."""

    nulls_taken = frozenset({"max_tokens"})
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt's logprobs too)
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS and the like around a text prompt
    # 0 only with echo: the prompt alone comes back, as OpenAI's and vLLM's do
    max_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = COMPLETION_MAX_TOKENS
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None  # OpenAI's; only equal to n (a no-op)

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int, info: ValidationInfo) -> int:
        """best_of equal to n (1 without n) asks for nothing besides the n choices, as vLLM takes
        it; more candidates than choices, ranked on the server, is not implemented."""
        n = info.data.get("n") or 1
        if value != n:
            raise ValueError(f"best_of={value} with n={n}: generating more candidates than the choices returned "
                             f"is not implemented; send best_of equal to n, or omit it")
        return value


class ChatTextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: FunctionName
    arguments: str  # JSON text, as OpenAI sends it; rendered by the template (kvseal.server.bounds)

    @field_validator("arguments")
    @classmethod
    def _json_text(cls, value: str) -> str:
        """JSON text nested at most `MAX_ARGUMENTS_DEPTH` deep, checked before parsing it: the
        parser, and a template's `tojson`, recurse as deep as the text nests."""
        depth = json_depth(value)
        if depth > MAX_ARGUMENTS_DEPTH:
            raise ValueError(f"tool call arguments nest objects and arrays {depth} deep; the limit is "
                             f"{MAX_ARGUMENTS_DEPTH}. Send flatter arguments")
        try:
            json.loads(value)
        except ValueError:
            raise ValueError("tool call arguments must be JSON text") from None
        return value


class ToolCall(_Body):
    id: Name
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]  # developer: OpenAI's newer name for system
    # left out (or null) renders as "", whatever the role, as vLLM takes it (kvseal always has): an
    # assistant turn of tool calls or a refusal has none
    content: str | Annotated[list[ChatTextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None  # an assistant turn's calls
    tool_call_id: Name | None = None  # a tool result answers this call
    name: FunctionName | None = None  # the author's name, for a template that renders it
    refusal: str | None = None  # an assistant turn's refusal, as OpenAI answered it (bounded: kvseal.server.bounds)
    # an assistant turn's reasoning as a `--reasoning-parser` answered it (under both names), for
    # templates that render it (Qwen3's reads `reasoning_content`); bounded as refusals are
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _assistant_fields(self) -> ChatMessage:
        """A refusal and reasoning are what the API answered on an assistant turn; on another
        role they are a mistake, as are two different reasonings for one turn."""
        for name in ("refusal", "reasoning_content", "reasoning"):
            if getattr(self, name) is not None and self.role != "assistant":
                raise ValueError(f"{name} is an assistant message's field, not a {self.role} message's")
        if None not in (self.reasoning, self.reasoning_content) and self.reasoning != self.reasoning_content:
            raise ValueError("reasoning and reasoning_content differ: send one of them (they name the same text)")
        return self

    @property
    def reasoning_text(self) -> str | None:
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning

    def as_template_input(self) -> dict[str, Any]:
        """The message as the chat template reads it. vLLM passes messages through to the
        template, so every field a template may use is here (`name`, `refusal`, the reasoning
        under both its names), while absent ones stay out; a turn without content (tool calls,
        a refusal) has "" as it."""
        content = self.content if not isinstance(self.content, list) else "\n".join(p.text for p in self.content)
        # The model's template knows "system" (OpenAI's "developer" is the same instructions by a newer name)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_arguments(c.function.arguments)}} for c in self.tool_calls]
        optional = {"tool_call_id": self.tool_call_id, "name": self.name, "refusal": self.refusal,
                    "reasoning_content": self.reasoning_text, "reasoning": self.reasoning_text}
        return message | {key: value for key, value in optional.items() if value is not None}


def _json_arguments(arguments: str) -> Any:
    """Chat templates expect arguments as an object; OpenAI sends them as (validated) JSON text."""
    return json.loads(arguments)


class FunctionDef(_Body):
    name: Annotated[str, Field(min_length=1, max_length=MAX_FUNCTION_NAME_CHARS, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Description | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: FunctionName


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


@dataclass(frozen=True)
class ConversationNames:
    """How an error about the conversation as a whole names it, in the words of the API the
    client used: chat's `messages`, or the Responses API's `input`."""

    param: str
    tool_calls: str  # the turns' calls, all together
    extras: str  # the assistant turns' refusals and reasoning, all together


CHAT_NAMES = ConversationNames("messages", "the tool calls' arguments",
                               "the assistant messages' refusals and reasoning")


def _bounded_kwargs(value: dict[str, Any]) -> dict[str, Any]:
    text = json.dumps(value, ensure_ascii=False)
    if len(text) > MAX_TEMPLATE_KWARGS_CHARS:
        raise ValueError(f"chat_template_kwargs has {len(text)} characters as JSON; the limit is "
                         f"{MAX_TEMPLATE_KWARGS_CHARS}")
    return value


# template variables (e.g. {"enable_thinking": false}): names of identifiers, a bounded JSON object
TemplateKwargs = Annotated[dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")], Any],
                           Field(max_length=MAX_TEMPLATE_KWARGS), AfterValidator(_bounded_kwargs)]


class ChatCompletionRequest(GenerationBody):
    conversation_names: ClassVar[ConversationNames] = CHAT_NAMES  # how errors name `messages`
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    # vLLM's: the answer starts with the last message's content when that message is the answer's
    # own turn (an assistant message, or any last message without add_generation_prompt)
    echo: bool = False
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # vLLM's: how the chat template renders the conversation
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: TemplateKwargs | None = None
    include_reasoning: bool = True  # vLLM's: false leaves a reasoning parser's reasoning out of the answer
    # OpenAI's stored completions: kvseal stores none, so store may only be false; metadata (for
    # stored completions) is taken and not used, as vLLM takes both
    store: bool | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)],
                             Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]],
                        Field(max_length=MAX_METADATA)] | None = None

    @field_validator("store")
    @classmethod
    def _nothing_is_stored(cls, value: bool) -> bool:
        if value:
            raise ValueError("store=true asks to keep the completion for later retrieval; kvseal stores no "
                             "completions. Send store=false or omit it")
        return value
    add_special_tokens: bool = False  # vLLM's: also the tokenizer's around the rendered template (which writes BOS)

    @property
    def chat_options(self) -> ChatOptions:
        """Raises `InvalidParameter` for a combination the template cannot honour."""
        return ChatOptions.of(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs,
                              self.add_special_tokens)

