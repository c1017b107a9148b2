"""Typed errors. Every message says what was wrong, the limit, and what to do.

`RequestRejected` and its subclasses are the client's fault and map to HTTP 4xx; the
frontend reads `code`, `param` and `http_status` from them. `ConfigError` and
`ModelLoadError` stop start-up. A rejected request is terminal: nothing downstream may
replace, pad, queue or compute it.
"""

from __future__ import annotations


class KvsealError(Exception):
    """Base of every error kvseal raises on purpose."""


class RequestRejected(KvsealError):
    """A request that must not run; raised before any page, slot or message exists."""

    code: str = "invalid_request"
    http_status: int = 400
    error_type: str = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ContextLengthExceeded(RequestRejected):
    """The prompt, or prompt plus max_tokens, exceeds what the server admits (I1)."""

    code = "context_length_exceeded"

    def __init__(
        self,
        message: str,
        *,
        num_prompt_tokens: int,
        max_tokens: int,
        max_model_len: int,
        kv_cache_tokens: int,
    ) -> None:
        super().__init__(message, param="prompt")
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        self.kv_cache_tokens = kv_cache_tokens


class InvalidParameter(RequestRejected):
    """A sampling or request parameter has a value kvseal cannot honour."""

    code = "invalid_parameter"


class GrammarCompileTimeout(InvalidParameter):
    """A structured-output grammar did not compile within the engine's budget
    (`--grammar-compile-timeout-s` of its worker's CPU time); the compile was stopped."""

    code = "grammar_compile_timeout"


class GrammarCompilerUnavailable(RequestRejected):
    """The engine could not start a grammar worker process, or could not give a compile its CPU
    time (a host too busy for thirty times the budget); not the client's fault: retry."""

    code = "grammar_compiler_unavailable"
    http_status = 503
    error_type = "service_unavailable"


class ConfigError(KvsealError):
    """A configuration the server cannot honour (I2); start-up refuses it."""


class ModelLoadError(KvsealError):
    """A model file or folder is missing, corrupt or of an unsupported architecture."""


class IsolationViolation(KvsealError):
    """A request was about to read or write KV it may not (I3/I4): a page it does not own,
    or positions no write of its own covers. Raised by the checks before every forward and
    by `KVCacheManager.record_written` for a write that is not contiguous growth.

    This is never a client error: it means the engine (or a transport) is broken. The
    forward that would have read the slots is not run for that request, and it is aborted
    with error_code ISOLATION_CHECK_FAILED.
    """

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id
