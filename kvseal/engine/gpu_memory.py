"""The KV pool on a GPU: what `--gpu-memory-utilization` of the device's free memory leaves after
the weights and the activation peak of a profiling forward (`kvseal.capacity.GpuMemoryPlan`, the
arithmetic `kvseal plan` prints too)."""

from __future__ import annotations

import logging
import math

import torch

from kvseal.capacity import GpuMemoryPlan
from kvseal.kvcache.pool import KVPool
from kvseal.models.llama import CausalLM
from kvseal.types import ForwardBatch

logger = logging.getLogger("kvseal")


def model_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's parameters and buffers (tied weights once)."""
    tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def profiling_batch(num_tokens: int, num_sampled: int, page_size: int, device: torch.device) -> ForwardBatch:
    """One fresh prompt of `num_tokens` tokens (a full step's budget) whose last `num_sampled`
    tokens are sampled (as many logits rows as a step of decodes has): the step that needs the
    most activation memory."""
    positions = torch.arange(num_tokens, dtype=torch.int64, device=device)
    num_pages = math.ceil(num_tokens / page_size)
    return ForwardBatch(input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device), positions=positions,
                        slot_mapping=positions.clone(), query_lens=[num_tokens], context_lens=[num_tokens],
                        block_tables=[torch.arange(num_pages, dtype=torch.int64)],
                        logits_indices=positions[num_tokens - num_sampled:].clone())


def measure_activation_peak(model: CausalLM, num_tokens: int, num_sampled: int, page_size: int,
                            dtype: torch.dtype) -> int:
    """The bytes one forward of `num_tokens` tokens (and the sampler's float32 logits of
    `num_sampled` rows) allocates on the GPU beyond what is live before it, measured with
    torch's allocator statistics. Its scratch pool is freed before this returns."""
    device = next(model.parameters()).device
    cfg = model.config
    pool = KVPool(cfg.num_layers, math.ceil(num_tokens / page_size), page_size, cfg.num_kv_heads, cfg.head_dim,
                  dtype, device=str(device))
    batch = profiling_batch(num_tokens, num_sampled, page_size, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        logits = model(batch, pool)
        torch.log_softmax(logits.float(), dim=-1)  # the sampler's float32 rows
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del pool, batch, logits
    torch.cuda.empty_cache()
    return int(peak)


def plan_gpu_pool(model: CausalLM, free_bytes: int, utilization: float, num_tokens: int, num_sampled: int,
                  page_size: int, dtype: torch.dtype) -> GpuMemoryPlan:
    """The GPU's pool plan, from the free memory measured before the weights loaded."""
    plan = GpuMemoryPlan(free_bytes, utilization, model_bytes(model),
                         measure_activation_peak(model, num_tokens, num_sampled, page_size, dtype))
    for name, value in plan.rows():
        logger.info("gpu memory: %s: %s", name, value)
    return plan
