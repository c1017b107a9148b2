"""The model runner: one call, a prepared batch in, logits out.

It holds the model and the KV pool tensors. It never sees queues, tenants or the allocator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvseal.kvcache.pool import KVPool
from kvseal.models.llama import CausalLM
from kvseal.types import ForwardBatch


@dataclass(frozen=True)
class RunnerOutput:
    # [num_samples, vocab] in the order of batch.logits_indices, in the lm_head's dtype (bfloat16
    # for a bfloat16 model): the sampler widens them only where it needs float32
    raw_logits: torch.Tensor

    @property
    def logits(self) -> torch.Tensor:
        """The logits in float32 (converted at each call unless the model is float32)."""
        return self.raw_logits.float()


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool) -> None:
        self.model = model
        self.pool = pool

    def run(self, batch: ForwardBatch) -> RunnerOutput:
        return RunnerOutput(self.model(batch, self.pool))
