"""The body of `POST /v1/responses` (OpenAI's Responses API), and what it means in chat's terms.

The Responses API is a second shape of the same generation as chat completions: `instructions`
and `input` are a conversation, `tools` and `text.format` are chat's tools and
`response_format`. `ResponsesRequest` takes the Responses fields (pydantic, strict, every list
and string bounded, an unknown field refused as everywhere: `protocol.py`); `ResponsesBody` is
that request as a `ChatCompletionRequest`, so it takes chat's whole path through the pipeline
(tenant, limits, bounds on tool calls' arguments, admission, structured output) and keeps the
request it came from for the response's echoed fields.

`input` is a string (one user message) or a list of items: messages (role user, system,
developer or assistant; content a string or `input_text` / `output_text` parts, as a client
sends back an earlier response's output), `function_call` items (an assistant turn's calls,
consecutive ones in one turn) and `function_call_output` items (a tool message answering a call
by its `call_id`); a `reasoning` item, as an earlier response's output carries it, is the
reasoning of the assistant turn that follows it. Images, files, audio, built-in tools
(web_search, file_search, ...) and other item types are refused naming the item: the model
reads text, and kvseal runs no tools.

No response is stored (as vLLM without `VLLM_ENABLE_RESPONSES_API_STORE`): `store` is taken
whatever its value and nothing is kept, so `previous_response_id` names a response the server
does not have (404, `responses.py`), and `background` (which needs a stored response) is
refused.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import Discriminator, Field, PrivateAttr, Tag, field_validator, model_validator

from kvseal.errors import InvalidParameter
from kvseal.server.protocol import (
    INT32_MAX,
    MAX_CONTENT_PARTS,
    MAX_FUNCTION_NAME_CHARS,
    MAX_MESSAGES,
    MAX_METADATA,
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_VALUE_CHARS,
    ChatCompletionRequest,
    ConversationNames,
    Description,
    FunctionCall,
    FunctionName,
    Name,
    _Body,
)
from kvseal.structured.schema import MAX_TOOLS
from kvseal.types import MAX_CACHE_SALT_CHARS

MAX_ANNOTATIONS = 1024  # annotations and logprobs of an earlier output_text part sent back (not read)

# Content parts and items the API has that kvseal does not take, and why
UNREADABLE_PARTS = {
    "input_image": "this server's model reads text only",
    "input_file": "this server's model reads text only; send the file's text as input_text",
    "input_audio": "this server's model reads text only",
}
BUILT_IN_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview",
                  "image_generation", "mcp", "local_shell", "shell", "custom", "apply_patch")


class _Unsupported(_Body):
    """A part or item of a type kvseal does not take: refused, naming the type."""

    what: ClassVar[str] = "input item"

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        raise ValueError(_unsupported_message(cls.what, kind))


def _unsupported_message(what: str, kind: Any) -> str:
    if what == "content part":
        reason = UNREADABLE_PARTS.get(str(kind), "kvseal takes input_text and output_text parts")
        return f"content part of type {kind!r} is not supported: {reason}"
    return (f"input item of type {kind!r} is not supported: kvseal takes message, function_call, "
            f"function_call_output and reasoning items")


class _UnsupportedPart(_Unsupported):
    what: ClassVar[str] = "content part"


class InputText(_Body):
    type: Literal["input_text"]
    text: str


class OutputText(_Body):
    """An earlier response's text, sent back: its annotations and logprobs are not read."""

    type: Literal["output_text"]
    text: str
    annotations: Annotated[list[Any], Field(max_length=MAX_ANNOTATIONS)] | None = None
    logprobs: Annotated[list[Any], Field(max_length=MAX_ANNOTATIONS)] | None = None


class Refusal(_Body):
    type: Literal["refusal"]
    refusal: str


def _part_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else None
    return kind if kind in ("input_text", "output_text", "refusal") else "unsupported"


ContentPart = Annotated[Annotated[InputText, Tag("input_text")] | Annotated[OutputText, Tag("output_text")]
                        | Annotated[Refusal, Tag("refusal")] | Annotated[_UnsupportedPart, Tag("unsupported")],
                        Discriminator(_part_kind)]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


def _text_kind(value: Any) -> str:
    return "text" if isinstance(value, str) else "parts"


Content = Annotated[Annotated[str, Tag("text")]
                    | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS), Tag("parts")],
                    Discriminator(_text_kind)]


class MessageItem(_Body):
    """A message: the easy form (`{"role", "content"}`) or a typed one, as an earlier response's
    output item (with its `id` and `status`)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: Name | None = None
    status: ItemStatus | None = None

    @model_validator(mode="after")
    def _parts_fit_the_role(self) -> MessageItem:
        if isinstance(self.content, list) and self.role != "assistant" and \
                any(not isinstance(p, InputText) for p in self.content):
            raise ValueError(f"a {self.role} message's content parts are input_text parts")
        return self

    def text(self) -> str:
        """Its text parts joined as chat joins a message's text parts (a refusal is no text)."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content if isinstance(p, InputText | OutputText))

    def refusal(self) -> str | None:
        refusals = [p.refusal for p in self.content if isinstance(p, Refusal)] if isinstance(self.content, list) else []
        return "\n".join(refusals) if refusals else None


class FunctionCallItem(_Body):
    """A call the model made (as an earlier response's output had it)."""

    type: Literal["function_call"]
    call_id: Name
    name: FunctionName
    arguments: str  # JSON text, checked as chat checks a tool call's
    id: Name | None = None
    status: ItemStatus | None = None

    @field_validator("arguments")
    @classmethod
    def _json_text(cls, value: str) -> str:
        return FunctionCall._json_text(value)


class FunctionCallOutputItem(_Body):
    """The result of a call, by its call_id: a tool message."""

    type: Literal["function_call_output"]
    call_id: Name
    output: Annotated[Annotated[str, Tag("text")]
                      | Annotated[list[InputText], Field(max_length=MAX_CONTENT_PARTS), Tag("parts")],
                      Discriminator(_text_kind)]
    id: Name | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(p.text for p in self.output)


class ReasoningText(_Body):
    type: Literal["reasoning_text"]
    text: str


class SummaryText(_Body):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(_Body):
    """An earlier response's reasoning, sent back: the reasoning of the assistant turn after it."""

    type: Literal["reasoning"]
    id: Name | None = None
    summary: Annotated[list[SummaryText], Field(max_length=MAX_CONTENT_PARTS)] = []
    content: Annotated[list[ReasoningText], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    encrypted_content: None = None  # kvseal encrypts no reasoning, so it can read none back
    status: ItemStatus | None = None

    def text(self) -> str:
        return "\n".join(p.text for p in self.content or [])


class _UnsupportedItem(_Unsupported):
    pass


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else None
    return kind if kind in ("message", "function_call", "function_call_output", "reasoning") else "unsupported"


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")] | Annotated[_UnsupportedItem, Tag("unsupported")],
                      Discriminator(_item_kind)]


class FunctionTool(_Body):
    """A function tool in the Responses form: flat, not under `function`."""

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=MAX_FUNCTION_NAME_CHARS, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Description | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _UnsupportedTool(_Body):
    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        built_in = "a built-in tool, which kvseal does not run" if kind in BUILT_IN_TOOLS else "not a tool type"
        raise ValueError(f"tool of type {kind!r} is not supported ({built_in}): send function tools")


def _tool_kind(value: Any) -> str:
    return "function" if isinstance(value, dict) and value.get("type") == "function" else "unsupported"


Tool = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[_UnsupportedTool, Tag("unsupported")],
                 Discriminator(_tool_kind)]


class NamedFunctionChoice(_Body):
    type: Literal["function"]
    name: FunctionName


class TextFormatText(_Body):
    type: Literal["text"]


class TextFormatJsonObject(_Body):
    type: Literal["json_object"]


class TextFormatJsonSchema(_Body):
    type: Literal["json_schema"]
    name: FunctionName
    json_schema: dict[str, Any] = Field(alias="schema")
    description: Description | None = None
    strict: bool | None = None


class TextConfig(_Body):
    format: Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")] \
        | None = None


class ReasoningConfig(_Body):
    """`effort` goes to the chat template as `reasoning_effort` (as vLLM passes it); the
    reasoning itself comes back whole, as a `reasoning` item, never as a summary."""

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: None = None  # no summaries: the reasoning item carries the reasoning text
    generate_summary: None = None


Metadata = Annotated[dict[Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)],
                          Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]],
                     Field(max_length=MAX_METADATA)]


def _input_kind(value: Any) -> str:
    return "text" if isinstance(value, str) else "items"


# a string is one user message; errors in a list name the item (`input.items.3`)
Input = Annotated[Annotated[str, Tag("text")]
                  | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES), Tag("items")],
                  Discriminator(_input_kind)]


class ResponsesRequest(_Body):
    model: Name | None = None
    input: Input
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    stream: bool = False
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    user: Name | None = None
    metadata: Metadata | None = None
    store: bool | None = None  # taken, and nothing stored (the module's docstring)
    background: bool | None = None
    previous_response_id: Name | None = None  # answered 404: no response is stored
    truncation: Literal["auto", "disabled"] | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None  # vLLM's

    @field_validator("input")
    @classmethod
    def _has_a_turn(cls, value: str | list[InputItem]) -> str | list[InputItem]:
        if not isinstance(value, str) and all(isinstance(item, ReasoningItem) for item in value):
            raise ValueError("the input holds only reasoning items; give at least one message or function call")
        return value

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, value: str) -> str:
        if value != "disabled":
            raise ValueError("truncation='auto' (dropping the conversation's first items to fit the context) is not "
                             "implemented; send truncation='disabled' or omit it, and send an input that fits")
        return value

    @field_validator("background")
    @classmethod
    def _no_background(cls, value: bool) -> bool:
        if value:
            raise ValueError("background=true needs a stored response, and kvseal stores none; send "
                             "background=false or omit it")
        return value

    def conversation(self) -> list[dict[str, Any]]:
        """`instructions` and `input` as chat messages (`ChatMessage`'s fields)."""
        return [message for _, message in self._turns()]

    def _turns(self) -> list[tuple[int | None, dict[str, Any]]]:
        """Each chat message with the index of the input item it begins at (None: `instructions`,
        or `input` as a string)."""
        turns: list[tuple[int | None, dict[str, Any]]] = []
        if self.instructions is not None:
            turns.append((None, {"role": "system", "content": self.instructions}))
        if isinstance(self.input, str):
            return [*turns, (None, {"role": "user", "content": self.input})]
        reasoning: str | None = None  # from reasoning items, for the next assistant turn
        for index, item in enumerate(self.input):
            if isinstance(item, ReasoningItem):
                reasoning = item.text() if reasoning is None else f"{reasoning}\n{item.text()}"
                continue
            if isinstance(item, FunctionCallOutputItem):
                turns.append((index, {"role": "tool", "tool_call_id": item.call_id, "content": item.text()}))
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if turns and turns[-1][1]["role"] == "assistant":  # one turn's calls, in one message
                    turns[-1][1].setdefault("tool_calls", []).append(call)
                else:
                    turns.append((index, {"role": "assistant", "content": None, "tool_calls": [call]}))
            else:
                assert isinstance(item, MessageItem)
                message: dict[str, Any] = {"role": item.role, "content": item.text()}
                if item.refusal() is not None:
                    message["refusal"] = item.refusal()
                turns.append((index, message))
            last = turns[-1][1]
            if reasoning is not None and last["role"] == "assistant":
                earlier = last.get("reasoning")
                last["reasoning"] = reasoning if earlier is None else f"{earlier}\n{reasoning}"
                reasoning = None
        return turns

    def _check_turns(self, turns: list[tuple[int | None, dict[str, Any]]]) -> None:
        """Raise `InvalidParameter` naming `input` when the items together make a conversation
        over chat's limits, which each item alone is within: `instructions` is one message more
        than the items, and consecutive function_call items are one assistant turn's calls."""
        if len(turns) > MAX_MESSAGES:
            raise InvalidParameter(
                f"Invalid value for 'input': its items and instructions make {len(turns)} messages (instructions "
                f"one, each message or function_call_output item one, consecutive function_call items one); a "
                f"request may have at most {MAX_MESSAGES}. Send fewer input items.", param="input")
        for index, message in turns:
            num_calls = len(message.get("tool_calls", []))
            if num_calls > MAX_TOOLS:
                raise InvalidParameter(
                    f"Invalid value for 'input': the assistant turn that begins at input.{index} has {num_calls} "
                    f"function_call items (consecutive function_call items, and an assistant message item before "
                    f"them, are one turn); a turn may have at most {MAX_TOOLS} calls. Send fewer calls in a row.",
                    param="input")

    def chat_fields(self) -> dict[str, Any]:
        """The chat completion request this one is, with only the fields it set (so the audit
        log's features are the ones the client used). Raises `InvalidParameter` naming `input`
        for a conversation over chat's limits (`_check_turns`)."""
        turns = self._turns()
        self._check_turns(turns)
        fields: dict[str, Any] = {"messages": [message for _, message in turns]}
        sent = self.model_fields_set
        for name in ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "user", "metadata",
                     "cache_salt"):
            if name in sent and getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            fields["max_completion_tokens"] = self.max_output_tokens
        if self.tools is not None:
            fields["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                               for t in self.tools if isinstance(t, FunctionTool)]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format is not None:
            fields["response_format"] = _response_format(self.text.format)
        if self.reasoning is not None and self.reasoning.effort is not None:
            fields["chat_template_kwargs"] = {"reasoning_effort": self.reasoning.effort}
        return fields


def _response_format(fmt: TextFormatText | TextFormatJsonObject | TextFormatJsonSchema) -> dict[str, Any]:
    if isinstance(fmt, TextFormatJsonSchema):
        spec = {"name": fmt.name, "schema": fmt.json_schema, "description": fmt.description, "strict": fmt.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}
    return {"type": fmt.type}


class ResponsesBody(ChatCompletionRequest):
    """A Responses request as the chat completion request it is (`ResponsesRequest.chat_fields`),
    keeping the request (`responses`). Parsed from the Responses JSON: its errors name the
    Responses fields."""

    conversation_names: ClassVar[ConversationNames] = ConversationNames(
        "input", "the function_call items' arguments", "the assistant message items' refusals and the reasoning items")
    _responses: ResponsesRequest | None = PrivateAttr(default=None)

    @classmethod
    def model_validate_json(cls, json_data: str | bytes | bytearray, **kwargs: Any) -> Self:
        request = ResponsesRequest.model_validate_json(json_data)
        body = cls.model_validate(request.chat_fields())
        body._responses = request
        return body

    @property
    def responses(self) -> ResponsesRequest:
        assert self._responses is not None, "a ResponsesBody is parsed from a Responses request"
        return self._responses
