"""Function calling on chat completions: `tools`, `tool_choice`, and the call parsers.

The tool definitions go to the model's own chat template (`apply_chat_template(tools=...)`).
The model answers in its family's format, which the parser `--tool-call-parser` names turns
into OpenAI's `tool_calls` (as vLLM's parser of that name does); without the flag a request
with tools is refused:
- `hermes` (Hermes, Qwen): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
  blocks anywhere in the text (`HermesToolParser`).
- `llama3_json` (Llama 3.1 to 3.3): an answer that is one or more `{"name": ...,
  "parameters": {...}}` objects (or `"arguments"`), separated by `;`, optionally after
  `<|python_tag|>` (`Llama3JsonToolParser`); an answer that does not begin so is content.
- `mistral` (Mistral's instruct models from v0.3): an answer that is a JSON list of `{"name":
  ..., "arguments": {...}}` objects after `[TOOL_CALLS]` (a special token, so usually not in
  the text) (`MistralToolParser`); its call ids are nine letters and digits, the only ids
  Mistral's chat templates take back in the history.
- `pythonic` (Llama 3.2 and 4, and models tuned on the same format): an answer that is a Python
  list of calls with keyword arguments of literal values, `[get_weather(city="Oslo"),
  get_time(zone="CET")]`, optionally between Llama 4's `<|python_start|>` and `<|python_end|>`
  (`PythonicToolParser`). It is read with Python's parser, never run.
- `qwen3_coder` (Qwen3-Coder): `<tool_call>` blocks anywhere in the text, each one
  `<function=NAME>` of `<parameter=KEY>\\nVALUE\\n</parameter>` entries (`Qwen3CoderToolParser`).
  A value is raw text, typed by the request's schema for that parameter as vLLM's parser types
  it: a string stays the text (less the template's newline at each end); an `enum` or
  `const` value is the one its text spells; an integer, number, boolean, null, object or array
  is read as JSON (`True` and `None` too, which the template writes for Python's values; an
  object or array also as a Python literal, never run); a value that is not of its type, or of
  a parameter or tool the request does not define, stays text. A block that is not one whole
  function of parameters (cut off by max_tokens, two functions, stray text between parameters)
  is content, as hermes takes its blocks; unlike vLLM's parser, which reads a cut call as far
  as it goes and drops the text between and after calls. A string held to a length or a
  pattern is read as the text those bounds hold for (the enforced call's grammar counts the
  newlines and whitespace between the tags). A pattern is checked in `re`'s syntax on the event
  loop every request shares, so one request's checks get 50 ms in all (`patterns.py`): a pattern
  too costly to check (backtracking past that, repeats unrolling past 2,000 nodes, or any once
  the 50 ms are spent), like one `re` cannot read, is not held against a value. The format
  cannot tell its own tags inside a value from the value's end: a string holding `</parameter>`,
  `<parameter=`, `</function>` or `</tool_call>` is cut there, as in vLLM's parser (a call so
  cut may come back as content).
  An enforced call's tools may not name a parameter with `<`, `>` or a line break.
In every format a call has a string name and an object of arguments under the format's key;
anything else (a JSON record that happens to have a `name`, a call with a positional argument or
a value that is not a literal) leaves the whole answer content, as in vLLM's parsers. A call
naming a function that is not in `tools` is still a call, as vLLM's parsers return it: the
client sees the name it got.
`tool_choice`:
- "auto" (the default with tools): the model may call tools; calls are parsed from its text
  (with `parallel_tool_calls: false`, the first call only, as vLLM keeps it).
- "none": tools are rendered but nothing is parsed; the text is the answer.
- "required": one or more calls (one with `parallel_tool_calls: false`), in the parser's format,
  are enforced with the grammar (each call's JSON must match one tool's parameters schema), then
  parsed, as vLLM's grammar of a list of at least one call allows; `llama3_json`'s and
  `qwen3_coder`'s enforced grammar holds one call, their formats' several calls being no one
  grammar value here (one call is still an answer vLLM's would allow).
- a named function: one call, to it, enforced and parsed likewise.
  `pythonic` has no JSON call of its own: its enforced calls are a JSON list of `{"name": ...,
  "arguments": {...}}` objects, as vLLM enforces every format's, which its parser also reads.
  `qwen3_coder`'s is one block in its own XML form (xgrammar's structural tag).
Streamed, every format's calls are sent as they are written (`ToolCallStream`, `readers.py`): a
call's name once its text is certainly a call (hermes' and mistral's and llama3_json's
`{"name": ..., "arguments": {`, pythonic's `[name(`, qwen3_coder's `<function=NAME>`), then its
arguments in pieces adding up to the unstreamed call's (JSON as it comes; a pythonic or
qwen3_coder argument once its value ends, as the parser types it), the last `}` once the parser
has read the call: at the block's end (hermes, qwen3_coder), or the answer's (llama3_json,
mistral, pythonic, whose answer is calls only if wholly calls). A call found no call after part
of it went out is left a beginning of arguments, never whole, and its text comes as content.
"""

from kvseal.server.tools.calls import ParsedToolCall
from kvseal.server.tools.canonical_json import CanonicalJson
from kvseal.server.tools.parsers import (
    TOOL_PARSERS,
    FirstCallOnly,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
    ToolParser,
    tool_parameters,
    tool_parser,
)
from kvseal.server.tools.qwen3_coder import Qwen3CoderToolParser
from kvseal.server.tools.setup import ToolSetup, call_schema, tool_setup
from kvseal.server.tools.streaming import CallDelta, StreamStep, ToolCallStream

__all__ = ["TOOL_PARSERS", "CallDelta", "CanonicalJson", "FirstCallOnly", "HermesToolParser", "Llama3JsonToolParser",
           "MistralToolParser", "ParsedToolCall", "PythonicToolParser", "Qwen3CoderToolParser", "StreamStep",
           "ToolCallStream", "ToolParser", "ToolSetup", "call_schema", "tool_parameters", "tool_parser", "tool_setup"]
