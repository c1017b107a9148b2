"""kvseal: a multi-tenant LLM inference server whose tenants cannot see each other's data."""

from kvseal.errors import (
    ConfigError,
    ContextLengthExceeded,
    InvalidParameter,
    IsolationViolation,
    KvsealError,
    ModelLoadError,
    RequestRejected,
)
from kvseal.types import (
    CompletionOutput,
    FinishReason,
    GuidedDecodingParams,
    Logprob,
    RequestOutput,
    SamplingParams,
    StructuredOutputsParams,
)
from kvseal.version import __version__ as __version__

__all__ = [
    "LLM", "CompletionOutput", "ConfigError", "ContextLengthExceeded", "FinishReason", "GuidedDecodingParams",
    "InvalidParameter", "IsolationViolation", "KvsealError", "Logprob", "ModelLoadError", "RequestOutput",
    "RequestRejected", "SamplingParams", "StructuredOutputsParams",
]


def __getattr__(name: str) -> object:
    # LLM pulls in torch models and transformers; load it only when asked for.
    if name == "LLM":
        from kvseal.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvseal' has no attribute {name!r}")
