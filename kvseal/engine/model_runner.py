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
    logits: torch.Tensor  # [num_samples, vocab] float32, in the order of batch.logits_indices


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool) -> None:
        self.model = model
        self.pool = pool

    def run(self, batch: ForwardBatch) -> RunnerOutput:
        return RunnerOutput(self.model(batch, self.pool))
