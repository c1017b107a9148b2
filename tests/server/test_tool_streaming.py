"""Every parser's calls streamed as they are written (`ToolCallStream`): whatever the text and
however it is cut into tokens, what a stream sends adds up to the unstreamed message."""

from __future__ import annotations

import json
import re
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvseal.server.tools import (
    FirstCallOnly,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
    Qwen3CoderToolParser,
    ToolCallStream,
    ToolParser,
)
from kvseal.server.tools.calls import CALL_BLOCK, START_TAG, before_partial
from kvseal.server.tools.python_calls import _continues_identifier

PARAMS = {"get_time": {"type": "object", "properties": {"zone": {"type": "string"}, "hours": {"type": "integer"}}}}

# Pieces an answer is made of, per format: calls, broken calls, text between
FRAGMENTS: dict[str, list[str]] = {
    "hermes": ['<tool_call>\n{"name": "f", "arguments": {"a": [1, 2.50], "s": "x\\u00e9"}}\n</tool_call>',
               '<tool_call>{"arguments": {}, "name": "g"}</tool_call>',
               '<tool_call>{"name": "f", "arguments": {"a": 1, "a": 2}}',
               "</tool_call>", "Sure. ", "  ", '{"name": "h", "arguments": {"b": null}}', "<tool", "\n"],
    "llama3_json": ['{"name": "f", "parameters": {"a": 1}}', '{"name": "g", "arguments": {"b": "x"}}', "; ", " ",
                    "<|python_tag|>", '{"name": "Bob", "age": 3}', "and text", '{"a": {"b": [', "}", "\n"],
    "mistral": ["[TOOL_CALLS]", "[", '{"name": "f", "arguments": {"a": 1}}', ", ", "]", " ", "Sure",
                '{"name": "g", "arguments": {"k": [true, null]}}', '{"name": 1}', "\n"],
    "pythonic": ["[", 'get_time(zone="CET", hours=3)', ", ", "]", "<|python_start|>", "<|python_end|>", " ",
                 "f(a=(1, 'é'), b={'k': [None]})", "g()", "f(a=1, a=2)", "h(x)", "f(s='''a\"b''', t=r'\\q')",
                 '{"name": "f", "arguments": {}}', "text", "f(a='#', b=\"),\")"],
    "qwen3_coder": ["<tool_call>\n<function=get_time>\n", "<parameter=zone>\nCET\n</parameter>\n",
                    "<parameter=hours>\n12\n</parameter>\n", "<parameter=hours>\nmany\n", "</function>\n</tool_call>",
                    "Sure. ", "\n", "<parameter=x>\n{\"a\": 1}\n</parameter>", "</tool_call>", "<function=f>"],
}


def _parser(name: str) -> ToolParser:
    return {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser,
            "pythonic": PythonicToolParser, "qwen3_coder": lambda: Qwen3CoderToolParser(PARAMS)}[name]()


def _stream(parser: ToolParser, pieces: list[str]) -> tuple[str, dict[int, dict[str, Any]], bool, int]:
    """(content, each index's name, id and arguments added up, has calls, how many indices had
    their first delta before the choice ended). For the formats of `<tool_call>` blocks anywhere,
    the content sent after each piece is all the text so far settles (`_settled_content`)."""
    stream, content, calls = ToolCallStream(parser), "", {}
    text = ""
    for piece in pieces:
        step = stream.feed(piece)
        content += step.content
        _add(calls, step.calls)
        text += piece
        if isinstance(parser, HermesToolParser | Qwen3CoderToolParser):
            assert content == _settled_content(parser, text), (text, content)
    num_early = len(calls)
    rest, deltas, has_calls = stream.finish()
    _add(calls, deltas)
    return content + rest, calls, has_calls, num_early


def _settled_content(parser: ToolParser, text: str) -> str:
    """The content of a block format's answer that `text`, its beginning, settles whatever
    follows: the unstreamed content of the text before an open block (or a start tag's
    beginning), less the whitespace at its end (content only if more content follows)."""
    end_of_blocks = max((m.end() for m in CALL_BLOCK.finditer(text)), default=0)
    open_at = text.find(START_TAG, end_of_blocks)
    settled = text[:open_at if open_at >= 0 else before_partial(text, START_TAG)]
    content, calls = parser.parse(settled)
    return (content or "").rstrip() if calls else settled.rstrip()


def _add(calls: dict[int, dict[str, Any]], deltas: list[Any]) -> None:
    for delta in deltas:
        if delta.name is not None:
            assert delta.index == len(calls) and delta.id, "indices in order, each first delta with its id"
            calls[delta.index] = {"name": delta.name, "id": delta.id, "arguments": ""}
        calls[delta.index]["arguments"] += delta.arguments


def _check(parser: ToolParser, text: str, pieces: list[str]) -> int:
    content, calls = parser.parse(text)
    streamed, sent, has_calls, num_early = _stream(parser, pieces)
    assert streamed == (content or "") and has_calls == bool(calls)
    whole = []
    for call in sent.values():
        try:
            value = json.loads(call["arguments"])
        except ValueError:
            assert call["arguments"].startswith("{"), "a call found no call is left a beginning of arguments"
            continue
        assert isinstance(value, dict)
        whole.append((call["name"], call["arguments"]))
    assert whole == [(c.name, c.arguments) for c in calls]
    if isinstance(parser, MistralToolParser):
        assert all(re.fullmatch("[A-Za-z0-9]{9}", call["id"]) for call in sent.values())
    return num_early


def _cuts(text: str, data: st.DataObject) -> list[str]:
    points = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(FRAGMENTS)), st.booleans(), st.data())
def test_streamed_deltas_add_up_to_the_unstreamed_message(name: str, is_first_only: bool, data: st.DataObject) -> None:
    """Any answer made of the format's pieces (calls, broken calls, text), cut anywhere (as
    max_tokens cuts it), fed in any split: content, calls and finish agree with `parse`."""
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS[name]), max_size=8)))
    text = text[:data.draw(st.integers(0, len(text)))]
    parser = FirstCallOnly(_parser(name)) if is_first_only else _parser(name)
    _check(parser, text, _cuts(text, data))
    _check(parser, text, list(text))


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["hermes", "qwen3_coder"]), st.data())
def test_block_formats_stream_text_around_their_calls_as_it_comes(name: str, data: st.DataObject) -> None:
    """The formats whose calls are blocks anywhere: the text before, between and after the
    blocks streams as it is written (a block that reads as no call is content once it closed),
    not at the answer's end, and still adds up to the unstreamed content."""
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS[name]), min_size=2, max_size=8)))
    _check(_parser(name), text, _cuts(text, data))


def test_hermes_sends_the_text_after_a_call_before_the_answer_ends() -> None:
    stream = ToolCallStream(HermesToolParser())
    steps = [stream.feed(piece) for piece in ["Let me check.\n", '<tool_call>{"name": "f", "arguments": {}}',
                                              "</tool_call>", "\nDone", " so", " far."]]
    assert [step.content for step in steps] == ["Let me check.", "", "", "\n\nDone", " so", " far."]
    assert stream.finish()[0] == "" and HermesToolParser().parse(
        'Let me check.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\nDone so far.')[0] == \
        "Let me check.\n\nDone so far."


CALLS = {
    "hermes": '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
              '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
    "mistral": '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
    "pythonic": '[f(a=1), g()]',
    "qwen3_coder": "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>\n"
                   "<tool_call>\n<function=g>\n</function>\n</tool_call>",
}


def test_every_format_sends_its_calls_before_the_answer_ends() -> None:
    """Each call's name (and its arguments' beginning) goes out as it is written, not when the
    choice ends: the pieces of both calls come before `finish` (which only sends the last `}` of
    a format whose answer must be wholly calls)."""
    for name, text in CALLS.items():
        assert _check(_parser(name), text, list(text)) == 2, name


def test_pythonic_arguments_come_one_by_one() -> None:
    stream = ToolCallStream(PythonicToolParser())
    sent = [[(c.name, c.arguments) for c in stream.feed(piece).calls]
            for piece in ["[get_time(", "zone='C", "ET',", " hours=1", "2)", "]"]]
    assert sent == [[("get_time", "{")], [], [(None, '"zone": "CET"')], [], [(None, ', "hours": 12')], []]
    assert [c.arguments for c in stream.finish()[1]] == ["}"]


def test_qwen3_coder_parameters_come_typed_as_each_closes() -> None:
    stream = ToolCallStream(Qwen3CoderToolParser(PARAMS))
    sent = [[(c.name, c.arguments) for c in stream.feed(piece).calls]
            for piece in ["<tool_call>\n<function=get_time>\n<parameter=hours>\n1", "2\n</parameter>",
                          "\n<parameter=zone>\nCET\n", "</parameter>\n</function>\n</tool_call>"]]
    assert sent == [[("get_time", "{")], [(None, '"hours": 12')], [], [(None, ', "zone": "CET"'), (None, "}")]]


class _CountingParser:
    """A parser that counts the texts its `parse` reads, and their characters."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self.arguments_key = parser.arguments_key
        self.max_calls = parser.max_calls
        self.num_chars_parsed = 0

    def parse(self, text: str) -> Any:
        self.num_chars_parsed += len(text)
        return self._parser.parse(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parser, name)


def test_a_long_call_fed_a_character_at_a_time_is_read_once() -> None:
    """The frontend's work is linear in the answer: fed one character at a time, a 200k-character
    call is parsed once (at the end), not once per token, for every format; and the deltas sent
    add up to it with no piece sent twice."""
    long = "x" * 200_000
    texts = {"hermes": f'<tool_call>{{"name": "f", "arguments": {{"s": "{long}"}}}}</tool_call>',
             "llama3_json": f'{{"name": "f", "parameters": {{"s": "{long}"}}}}',
             "mistral": f'[{{"name": "f", "arguments": {{"s": "{long}"}}}}]',
             "pythonic": f'[f(s="{long}")]',
             "qwen3_coder": f"<tool_call><function=f><parameter=s>{long}</parameter></function></tool_call>"}
    for name, text in texts.items():
        parser = _CountingParser(_parser(name))
        stream = ToolCallStream(parser)  # type: ignore[arg-type]
        num_sent = sum(len(c.arguments) for char in text for c in stream.feed(char).calls)
        num_sent += sum(len(c.arguments) for c in stream.finish()[1])
        assert parser.num_chars_parsed == len(text), name
        assert num_sent == len(json.dumps({"s": long})), name


@given(st.text(max_size=12))
def test_an_identifier_read_a_character_at_a_time_is_what_isidentifier_says(text: str) -> None:
    """The pythonic reader checks a name's next character alone (a long name is not read again
    for each character): at every prefix it answers what `str.isidentifier` does."""
    chars: list[str] = []
    for char in text:
        if not _continues_identifier(chars, char):
            assert not (("".join(chars) + char).isidentifier())
            return
        chars.append(char)
        assert "".join(chars).isidentifier()
