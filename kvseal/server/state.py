"""Everything the HTTP handlers share, built once at start-up."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from kvseal.admission import AdmissionLimits
from kvseal.engine_api import EngineBackend
from kvseal.generation_defaults import GenerationDefaults
from kvseal.messages.msgs import EngineReadyMsg
from kvseal.server.audit import AuditLog
from kvseal.server.auth import ApiKeyTable, Tenant
from kvseal.server.body import BodyParser
from kvseal.server.config import ServerConfig
from kvseal.server.metrics import ServerMetrics
from kvseal.server.prompts import PromptEncoder
from kvseal.server.rate_limits import RateLimits
from kvseal.server.reasoning import ReasoningMarkers
from kvseal.server.tenant_gate import TenantGate


class LiveCall(Protocol):
    """A generation request between authentication and its terminal state (`server.call.Call`)."""

    request_id: str
    key_digest: bytes  # of the API key it authenticated with
    tenant: Tenant | None  # the tenant that key spoke for then

    def stop(self, reason: str) -> None:
        """End it for the operator: refused before it reaches the engine, aborted there after."""
        ...


@dataclass
class AppState:
    config: ServerConfig
    engine: EngineBackend
    engine_info: EngineReadyMsg
    prompts: PromptEncoder
    keys: ApiKeyTable
    metrics: ServerMetrics
    audit: AuditLog
    gate: TenantGate = field(default_factory=TenantGate)
    rates: RateLimits = field(default_factory=RateLimits)
    bodies: BodyParser = field(default_factory=BodyParser)  # big ones off the event loop, in tenants' turns
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    reasoning: ReasoningMarkers | None = None  # the model's <think> tokens, with --reasoning-parser
    created: int = field(default_factory=lambda: int(time.time()))
    is_draining: bool = False
    live_calls: dict[str, LiveCall] = field(default_factory=dict)  # by request id
    disabled_models: set[str] = field(default_factory=set)  # the operator's kill switch (`server.admin`)

    def __post_init__(self) -> None:
        # vLLM's series carry the model's name (`model_name`); their token buckets stop at its length
        self.metrics.vllm.name_model(self.model_name, self.engine_info.max_model_len)

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or self.engine_info.model_name

    @property
    def limits(self) -> AdmissionLimits:
        """The engine's own limits, as it reported them at start-up (I1 uses exactly these)."""
        info = self.engine_info
        return AdmissionLimits(info.max_model_len, info.kv_cache_tokens, info.vocab_size)
