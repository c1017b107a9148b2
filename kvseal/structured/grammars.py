"""What a `StructuredOutput` compiles to with xgrammar: one function, used by the grammar
worker processes (which judge a grammar under the time budget) and by the engine (which
compiles the grammars they accepted). Imports only xgrammar, so a worker starts lean.
"""

from __future__ import annotations

import json
from typing import Any

from kvseal.structured.keywords import unenforced_keyword

ANY_OBJECT = '{"type": "object"}'  # json_object: any JSON object (OpenAI), not any JSON value


def compile_spec(compiler: Any, vocab_size: int, kind: str, schema: str | None) -> Any:
    """The xgrammar `CompiledGrammar` for a structured-output spec (`StructuredOutput.kind`,
    `.schema`). Raises RuntimeError or ValueError (xgrammar's) for a schema it refuses, and
    ValueError for a grammar this vocabulary cannot even begin."""
    for held_to in _json_schemas(kind, schema):
        if (unenforced := unenforced_keyword(held_to)) is not None:
            raise ValueError(f"the JSON schema uses {unenforced}, which the grammar cannot enforce while sampling; "
                             f"remove it")
    if kind == "tool_call":
        compiled = compiler.compile_grammar(tool_call_grammar(schema or ANY_OBJECT))
    elif kind == "tool_calls":
        compiled = compiler.compile_grammar(tool_calls_grammar(schema or ANY_OBJECT))
    elif kind == "qwen3_coder_call":
        compiled = compiler.compile_structural_tag(qwen3_coder_call_tag(schema or "[]"))
    elif kind == "regex":
        compiled = compiler.compile_regex(schema)
    elif kind == "choice":
        compiled = compiler.compile_grammar(choice_grammar(schema or "[]"))
    elif kind == "grammar":
        compiled = compiler.compile_grammar(schema)
    else:
        json_schema = ANY_OBJECT if kind == "json_object" else schema
        compiled = compiler.compile_json_schema(json_schema, any_whitespace=False, strict_mode=True)
    _check_can_start(compiled, vocab_size)
    return compiled


def _json_schemas(kind: str, schema: str | None) -> list[str]:
    """The JSON Schemas (as JSON text) a spec holds output to."""
    if kind in ("json_schema", "tool_call", "tool_calls") and schema is not None:
        return [schema]
    if kind == "qwen3_coder_call" and schema is not None:
        return [json.dumps(tool["parameters"]) for tool in _qwen3_coder_tools(schema)]
    return []


def _check_can_start(compiled: Any, vocab_size: int) -> None:
    """Refuse a grammar this vocabulary cannot even begin (e.g. no token spells "{"): the
    request would have no token to sample."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    if not bool(bitmask.any()):
        raise ValueError("this model's vocabulary has no token that can begin output matching the grammar")


def tool_call_grammar(call_schema: str) -> Any:
    """Hermes' format: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, JSON per schema."""
    import xgrammar

    return xgrammar.Grammar.concat(xgrammar.Grammar.from_ebnf('root ::= "<tool_call>\\n"'),
                                   xgrammar.Grammar.from_json_schema(call_schema, any_whitespace=False),
                                   xgrammar.Grammar.from_ebnf('root ::= "\\n</tool_call>"'))


def tool_calls_grammar(call_schema: str) -> Any:
    """One or more of Hermes' calls (`tool_call_grammar`), a newline between two, as its chat
    templates write parallel calls: each call's JSON per schema."""
    import xgrammar

    # The call's JSON grammar as EBNF (its rule `root`), and a rule of the calls over it
    call = str(xgrammar.Grammar.from_json_schema(call_schema, any_whitespace=False))
    block = '"<tool_call>\\n" root "\\n</tool_call>"'
    calls = f'kvseal_tool_calls ::= {block} ("\\n" {block})*'
    return xgrammar.Grammar.from_ebnf(f"{call}\n{calls}\n", root_rule_name="kvseal_tool_calls")


def qwen3_coder_call_tag(tools_json: str) -> str:
    """Qwen3-Coder's format, as xgrammar's structural tag: one `<tool_call>\n<function=NAME>\n`
    block of `<parameter=KEY>VALUE</parameter>` entries (xgrammar's `qwen_xml` style: a string
    value is the raw text, any other the JSON one) per the tool's parameters schema, for one of
    the tools of a JSON list of `{"name", "parameters"}`. At most one whitespace character in a
    row between the parts (the template's newlines; xgrammar's `qwen_xml` lets one around a value
    that is not a plain string, which the parser reads as the string's bounds hold): a model
    cannot spin on whitespace until max_tokens."""
    calls = [{"type": "tag", "begin": f"<tool_call>\n<function={tool['name']}>\n",
              "content": {"type": "json_schema", "json_schema": tool["parameters"], "style": "qwen_xml",
                          "max_whitespace_cnt": 1},
              "end": "\n</function>\n</tool_call>"} for tool in _qwen3_coder_tools(tools_json)]
    return json.dumps({"type": "structural_tag", "format": calls[0] if len(calls) == 1 else
                       {"type": "or", "elements": calls}}, ensure_ascii=False)


def _qwen3_coder_tools(tools_json: str) -> list[dict[str, Any]]:
    """The tools of a `qwen3_coder_call` spec; ValueError (a compile error the caller is told,
    never a worker's crash) unless it is a non-empty JSON list of `{"name": str, "parameters":
    {...}}` (offline callers may write the spec themselves)."""
    tools = json.loads(tools_json)
    if not (isinstance(tools, list) and tools and all(
            isinstance(tool, dict) and isinstance(tool.get("name"), str) and tool["name"]
            and isinstance(tool.get("parameters"), dict) for tool in tools)):
        raise ValueError('a qwen3_coder_call grammar takes a non-empty JSON list of {"name": "...", '
                         '"parameters": {...}} objects')
    return tools


def choice_grammar(choices_json: str) -> str:
    """EBNF for exactly one of the strings of a JSON list: each a quoted literal, escaped as JSON
    strings are (xgrammar's EBNF literals take the same escapes)."""
    choices = json.loads(choices_json)
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def new_compiler(tokenizer_info: Any) -> Any:
    """A compiler with xgrammar's own cache off: that cache would be shared by every tenant
    (kvseal keeps its own, per tenant, I5). One thread: the budget is per compile."""
    import xgrammar

    return xgrammar.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)
