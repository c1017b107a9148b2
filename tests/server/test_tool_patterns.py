"""A tool schema's string `pattern`, checked against the model's value on the shared event loop
(`PatternChecks`, kvseal/server/tools/patterns.py): bounded per request, the same answer for the
request's stream and its parse."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvseal.server.tools import Qwen3CoderToolParser, ToolCallStream
from kvseal.server.tools.patterns import MAX_PATTERN_CHARS, MAX_PATTERN_SIZE, PatternChecks

ROOT = Path(__file__).resolve().parents[2]
BACKTRACKING = "^(a|aa)+$"  # against "aaa...a!": each 4 more characters, about 6 times longer in `re`
LOWER = "^[a-z]+$"

# argv: the tools' parameters (JSON), an answer; prints [its arguments streamed, parsed]
STREAM_AND_PARSE = """
import json, sys
from kvseal.server.tools import Qwen3CoderToolParser, ToolCallStream
parser, text = Qwen3CoderToolParser(json.loads(sys.argv[1])), sys.argv[2]
stream = ToolCallStream(parser)
streamed = "".join(c.arguments for c in stream.feed(text).calls + stream.finish()[1])
print(json.dumps([streamed, parser.parse(text)[1][0].arguments]))
"""


def _call(**values: str) -> str:
    parameters = "".join(f"<parameter={key}>{value}</parameter>\n" for key, value in values.items())
    return f"<tool_call>\n<function=f>\n{parameters}</function>\n</tool_call>"


def _streamed_arguments(parser: Qwen3CoderToolParser, text: str) -> str:
    stream = ToolCallStream(parser)
    pieces = [call.arguments for char in text for call in stream.feed(char).calls]
    return "".join(pieces + [call.arguments for call in stream.finish()[1]])


def test_a_backtracking_pattern_does_not_stop_the_loop() -> None:
    """`re` would take hours on a 60-character value (about 2^30 times the 1.6 s it takes at 34):
    the stream's draft and the parse both come back, the value held to nothing. A hang guard,
    in a process of its own that the test can end; no timing is asserted."""
    schema = {"type": "object", "properties": {
        "s": {"type": "string", "pattern": BACKTRACKING},
        "t": {"type": "string", "pattern": "^(?:(?:a{1000}){1000}){1000}$"}}}
    text = _call(s="\n" + "a" * 60 + "!\n", t="\nb\n")
    done = subprocess.run([sys.executable, "-c", STREAM_AND_PARSE, json.dumps({"f": schema}), text], cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    streamed, parsed = json.loads(done.stdout)
    assert streamed == parsed and json.loads(parsed) == {"s": "a" * 60 + "!", "t": "b"}


def test_the_stream_and_the_parse_agree_when_the_budget_runs_out_between_them() -> None:
    """`z`'s pattern is checked while the budget lasts (its bare reading is the one that matches);
    `s`'s search then spends the rest. The parse afterwards, with nothing left, must still read
    `z` as the stream sent it: every answer is kept."""
    schema = {"type": "object", "properties": {"z": {"type": "string", "pattern": LOWER},
                                               "s": {"type": "string", "pattern": BACKTRACKING}}}
    patterns = PatternChecks()
    parser = Qwen3CoderToolParser({"f": schema}, patterns)
    text = _call(z=" abc ", s="\n" + "a" * 60 + "!\n")
    streamed = _streamed_arguments(parser, text)
    assert patterns.is_spent
    [call] = parser.parse(text)[1]
    assert streamed == call.arguments
    assert json.loads(call.arguments) == {"z": "abc", "s": "a" * 60 + "!"}


def test_with_no_budget_a_pattern_is_not_held_against_a_value() -> None:
    schema = {"type": "object", "properties": {"z": {"type": "string", "pattern": LOWER}}}
    text = _call(z=" abc ")
    [checked] = Qwen3CoderToolParser({"f": schema}).parse(text)[1]
    [unchecked] = Qwen3CoderToolParser({"f": schema}, PatternChecks(budget_s=0)).parse(text)[1]
    assert (json.loads(checked.arguments), json.loads(unchecked.arguments)) == ({"z": "abc"}, {"z": " abc "})
    assert _streamed_arguments(Qwen3CoderToolParser({"f": schema}, PatternChecks(budget_s=0)), text) == \
        unchecked.arguments


def test_an_answer_stays_once_given() -> None:
    patterns = PatternChecks()
    assert not patterns.allows(LOWER, "ab1") and patterns.allows(LOWER, "ab")
    assert patterns.allows(BACKTRACKING, "a" * 60 + "!") and patterns.is_spent  # held: out of time
    assert not patterns.allows(LOWER, "ab1"), "asked again, the answer given"
    assert patterns.allows(LOWER, "zz9"), "asked first with the budget spent: held"


def test_patterns_that_are_not_checked() -> None:
    """A pattern `re` cannot parse (`\\p{L}` too, which `regex` could: `re`'s syntax is the one
    checked, as before), or one unrolled past MAX_PATTERN_SIZE (which `regex` would take seconds
    to compile), holds nothing against a text; one of that size does."""
    patterns = PatternChecks()
    assert patterns.allows("(", "x") and patterns.allows(r"\p{L}", "1")
    assert patterns.allows(f"a{{{MAX_PATTERN_SIZE + 1}}}", "c") and patterns.allows("^(?:a{1000}){1000}$", "c")
    assert not patterns.allows(f"a{{{MAX_PATTERN_SIZE}}}", "c") and not patterns.allows("^(?:a{40}){49}$", "c")
    # longer than MAX_PATTERN_CHARS: not even parsed (a long class of escapes took 75 ms to compile)
    def char_class(num_chars: int) -> str:
        return "^[" + "".join(f"\\u{0x4e00 + i:04x}" for i in range(num_chars)) + "]$"

    longest = char_class((MAX_PATTERN_CHARS - 4) // 6)  # 6 characters an escape, 4 around them
    assert len(char_class((MAX_PATTERN_CHARS - 4) // 6 + 1)) > MAX_PATTERN_CHARS >= len(longest)
    assert patterns.allows(char_class((MAX_PATTERN_CHARS - 4) // 6 + 1), "c") and not patterns.allows(longest, "c")
    assert not patterns.is_spent


class _Recording(PatternChecks):
    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []

    def allows(self, pattern: str, text: str) -> bool:
        self.texts.append(text)
        return super().allows(pattern, text)


def test_no_search_where_it_could_not_change_the_reading() -> None:
    """A value with no whitespace around it has one reading; one whose other readings the length
    bounds rule out is the template's text whatever its pattern says: neither is searched."""
    schema = {"type": "object", "properties": {"z": {"type": "string", "pattern": LOWER},
                                               "y": {"type": "string", "pattern": LOWER, "maxLength": 3}}}
    patterns = _Recording()
    [call] = Qwen3CoderToolParser({"f": schema}, patterns).parse(_call(z="ab1", y="\nxy1\n"))[1]
    assert json.loads(call.arguments) == {"z": "ab1", "y": "xy1"} and patterns.texts == []
    [call] = Qwen3CoderToolParser({"f": schema}, patterns).parse(_call(z="\nab\n"))[1]
    assert json.loads(call.arguments) == {"z": "ab"} and patterns.texts == ["ab"]
