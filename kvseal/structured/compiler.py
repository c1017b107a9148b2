"""Grammar compilation off the engine loop, with a compiled-grammar cache keyed per tenant.

Compiling a grammar against the vocabulary takes from milliseconds to seconds, so it runs on
one worker thread; the engine loop only polls the future. The cache key starts with the
tenant (like the prefix cache's namespace, I5): a hit can only come from the same tenant's
earlier request, so its speed tells no tenant what another one sent. xgrammar's own
compiler cache, which would be shared by all tenants, is switched off.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvseal.errors import InvalidParameter
from kvseal.structured.schema import describe_error
from kvseal.types import StructuredOutput

CACHE_ENTRIES = 256  # compiled grammars kept, over all tenants (least recently used evicted)

CacheKey = tuple[str, str, str | None]
ANY_OBJECT = '{"type": "object"}'  # json_object: any JSON object (OpenAI), not any JSON value


class GrammarCompilerPool:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvseal-grammar")
        self._compiler: Any = None  # built on the worker at first use (reading the vocabulary takes time)
        self._cache: OrderedDict[CacheKey, Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0  # grammars actually compiled (cache misses), for tests and logs

    def compile(self, tenant: str, spec: StructuredOutput) -> Future[Any]:
        """A future of the xgrammar `CompiledGrammar` for `spec`, shared only within `tenant`."""
        key = (tenant, spec.kind, spec.schema)
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(key)
                return future
            future = self._worker.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return future

    def compile_now(self, tenant: str, spec: StructuredOutput) -> Any:
        """Blocking form, for the offline API (there is no loop to keep free). Raises
        `InvalidParameter` for a schema xgrammar refuses."""
        return compiled_or_raise(self.compile(tenant, spec))

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutput) -> Any:
        compiler = self._get_compiler()
        self.num_compiles += 1
        if spec.kind == "tool_call":
            compiled = compiler.compile_grammar(tool_call_grammar(spec.schema or ANY_OBJECT))
        else:
            schema = ANY_OBJECT if spec.kind == "json_object" else spec.schema
            compiled = compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
        _check_can_start(compiled, self._vocab_size)
        return compiled

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar

            info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                           stop_token_ids=self._eos_token_ids or None)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


def _check_can_start(compiled: Any, vocab_size: int) -> None:
    """Refuse a grammar this vocabulary cannot even begin (e.g. no token spells "{"): the
    request would have no token to sample. Raises ValueError (a 400 via `compiled_or_raise`)."""
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


def compiled_or_raise(future: Future[Any]) -> Any:
    """The compiled grammar of a finished future, or `InvalidParameter` naming the problem."""
    try:
        return future.result()
    except (RuntimeError, ValueError) as exc:
        raise InvalidParameter(f"cannot compile the response_format grammar: {describe_error(exc)}",
                               param="response_format") from None
