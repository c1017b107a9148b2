"""What the shared generation pipeline needs from each endpoint (completions, chat, responses)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from kvseal.admission import AdmissionLimits
from kvseal.generation_defaults import GenerationDefaults
from kvseal.messages.msgs import RequestOutputMsg
from kvseal.server.auth import Tenant
from kvseal.server.prompts import PromptEncoder
from kvseal.server.protocol import GenerationBody
from kvseal.server.transcript import Transcript
from kvseal.types import SamplingParams

AuditPrompt = str | list[int] | list[str] | list[list[int]] | list[dict[str, Any]]


@dataclass(frozen=True)
class Prepared:
    """A request turned into engine terms, not yet admitted: per prompt (completions may send
    several, chat sends one) its token ids and its parameters (an omitted max_tokens is the rest
    of that prompt's context)."""

    prompt_token_ids: list[list[int]]
    params: list[SamplingParams]
    prompt_for_audit: AuditPrompt


@dataclass(frozen=True)
class ResponseIds:
    request_id: str
    model: str
    created: int


@dataclass(frozen=True)
class AdmittedPrompt:
    """The prompt as the engine runs it (after any truncation), and the tenant it belongs to."""

    token_ids: list[int]
    tenant: str


class Formatter(Protocol):
    """Builds one request's response bodies and stream chunks in the endpoint's shape."""

    def first_chunks(self) -> list[dict[str, Any]]: ...

    def delta_chunks(self, index: int, out: RequestOutputMsg) -> list[dict[str, Any]]: ...

    def usage_chunk(self, transcripts: list[Transcript]) -> dict[str, Any]: ...

    def response(self, transcripts: list[Transcript]) -> dict[str, Any]: ...

    def engine_params(self, params: SamplingParams) -> SamplingParams:
        """The parameters the engine runs for a prompt, given the response this formatter will build."""
        ...


class Endpoint(Protocol):
    path: str
    id_prefix: str  # its request ids' beginning, separator included ("chatcmpl-", "resp_")

    @property
    def body_model(self) -> type[GenerationBody]: ...

    async def prepare(self, body: Any, prompts: PromptEncoder, tenant: Tenant,
                      limits: AdmissionLimits, defaults: GenerationDefaults) -> Prepared: ...

    async def formatter(self, body: Any, ids: ResponseIds, prompts: PromptEncoder,
                        admitted: list[AdmittedPrompt]) -> Formatter: ...
