"""How many KV pages each request held, for its audit record (I8).

Pages are reserved and freed inside `LLMEngine.step`, so the loop samples the running
requests after every step and keeps each request's peak. A request that prefills and
finishes within one step is never seen holding pages; for a natural finish the count is
therefore also derived from the tokens whose KV the engine wrote (all but the last sampled
token), and the larger of the two is reported.
"""

from __future__ import annotations

import math

from kvseal.engine.engine import LLMEngine
from kvseal.types import FinishReason, RequestOutput


class PageLedger:
    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._peak: dict[str, int] = {}

    def observe(self, request_id: str) -> None:
        held = len(self._engine.kv.allocator.pages_of(request_id))
        self._peak[request_id] = max(self._peak.get(request_id, 0), held)

    def observe_running(self) -> None:
        for request in self._engine.scheduler.running:
            self.observe(request.request_id)

    def peak(self, request_id: str) -> int:
        return self._peak.get(request_id, 0)

    def settle(self, out: RequestOutput) -> int:
        """The final count for a finished request; forgets the request."""
        peak = self._peak.pop(out.request_id, 0)
        if out.finish_reason is FinishReason.ABORT:
            return peak
        num_written = out.num_prompt_tokens + len(out.token_ids) - 1
        return max(peak, math.ceil(num_written / self._engine.cache_config.page_size))
