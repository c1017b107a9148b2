"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV pool.

Parameter names match Hugging Face's, except that q/k/v and gate/up projections are packed
into one matrix each (fewer, larger matmuls); `PACKED_MODULES` tells the loader how to
concatenate the checkpoint's tensors. The model sees a `ForwardBatch` and the pool; it never
sees requests, tenants or the allocator. Its kernels are the ops the engine selected
(`use_ops`: kvseal's native kernels or torch's); the model never knows which.

The forward keeps the residual stream in one tensor updated in place: each residual add is
fused with the RMSNorm that follows it (the next layer's input norm, or the final norm). RoPE
rotates the q and k heads in place in the fused qkv rows and K/V are stored from those rows
into the pool. A step whose every row decodes one token runs every layer in one call where the
ops have a decode loop for the model (bit-equal to the per-layer path).
"""

from __future__ import annotations

import torch
from torch import nn

from kvseal.config import ModelConfig
from kvseal.kvcache.pool import KVPool
from kvseal.models.attention import AttentionPlan, paged_attention
from kvseal.models.rope import RotaryEmbedding
from kvseal.models.tensor_parallel import RankCollectives, RankLayout
from kvseal.ops import DecodeLoop, DecoderStack, DecoderWeights, NewTokens, Ops, TorchOps
from kvseal.ops.torch_backend import rms_norm
from kvseal.types import ForwardBatch

# packed parameter name -> the checkpoint's names, concatenated along the output dimension
PACKED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        o_bias = bias and cfg.architecture != "Qwen2ForCausalLM"
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=o_bias)
        if cfg.has_qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.has_qk_norm = cfg.has_qk_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, batch: ForwardBatch,
                plan: AttentionPlan, pool: KVPool, ops: Ops, rows: torch.Tensor | None = None) -> torch.Tensor:
        """x: [num_tokens, hidden]; cos, signed_sin: [num_tokens, head_dim]. Every token's K/V is
        written; `rows` (None: all) picks the tokens whose output is returned, so o_proj runs on
        those only."""
        n = x.shape[0]
        qkv = self.qkv_proj(x).contiguous()
        if self.has_qk_norm:
            tokens = self._qk_normed(qkv, cos, signed_sin)
        else:  # q and k heads side by side: one RoPE pass for both (it is per head, per position)
            ops.rope_(qkv, cos, signed_sin, self.num_heads + self.num_kv_heads, self.head_dim)
            k_at, v_at = self.q_size, self.q_size + self.kv_size
            tokens = NewTokens(qkv[:, :k_at].view(n, self.num_heads, self.head_dim),
                               qkv[:, k_at:v_at].view(n, self.num_kv_heads, self.head_dim),
                               qkv[:, v_at:].view(n, self.num_kv_heads, self.head_dim), qkv)
        ops.write_kv(pool, self.layer_idx, batch.slot_mapping, tokens.k, tokens.v)
        out = paged_attention(tokens, pool, self.layer_idx, plan, ops)  # [num_tokens, heads, head_dim]
        return self.o_proj(_pick(out.reshape(n, self.num_heads * self.head_dim), rows))

    def _qk_normed(self, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> NewTokens:
        """Per-head RMSNorm of q and k (Qwen3), then RoPE: new tensors, not views of qkv."""
        n = qkv.shape[0]
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
        q, k = qkv[:, :self.q_size + self.kv_size].split([self.q_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(n, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(n, self.num_kv_heads, self.head_dim))
        cos_sin = (cos[:, None], signed_sin[:, None])
        return NewTokens(RotaryEmbedding.apply(q, cos_sin), RotaryEmbedding.apply(k, cos_sin), v, None)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.intermediate_size = cfg.intermediate_size
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        return self.down_proj(ops.gate_up_silu(x, self.gate_up_proj, self.intermediate_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # given its (empty) weight, so no random initialisation runs: the loader builds the model on
        # the meta device and assigns the checkpoint's, and torch's first random draw there imports
        # torch._dynamo (0.65-1.2 s of every engine process's start)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg)
        self.ops: Ops = TorchOps()  # the engine's (`use_ops`)
        # Decode-only steps in one call (`Ops.decode_loop`), built at the first such step (after
        # the linears are packed: it points at their weights); None where the ops have none.
        self._decode_loop: DecodeLoop | None = None
        self._decode_loop_built = False
        # Tensor parallelism: this rank's slice of the model and the collectives joining the
        # ranks (`use_tensor_parallel`); None: the whole model in this process.
        self.layout: RankLayout | None = None
        self.comm: RankCollectives | None = None

    def use_tensor_parallel(self, layout: RankLayout, comm: RankCollectives) -> None:
        """This module holds rank `layout.rank`'s shard (`tensor_parallel.RankLayout.shard`);
        every forward joins the other ranks' through `comm`. Rank 0 returns the full logits."""
        self.layout, self.comm = layout, comm
        self._decode_loop, self._decode_loop_built = None, True  # a loop has no all-reduce between layers

    def use_ops(self, ops: Ops) -> None:
        """Run the forward with `ops` (call after the linears are in their final form)."""
        self.ops = ops
        self._decode_loop, self._decode_loop_built = None, False

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """Run one forward, writing the new tokens' KV; return logits [num_samples, vocab] in the
        lm_head's dtype (the sampler widens them to float32 where it needs to)."""
        ops = self.ops
        plan = AttentionPlan.build(batch, pool, self.config.num_heads, ops)
        layers: list[DecoderLayer] = list(self.model.layers)  # type: ignore[arg-type]
        h = self._embed(batch.input_ids)  # [num_tokens, hidden], the residual stream
        # [num_tokens, head_dim] each; every position is below its sequence's context length
        cos, signed_sin = self.rope.cos_sin_rows(batch.positions, h.dtype, max(batch.context_lens, default=0))
        if plan.decode is not None and plan.is_decode_only and (loop := self.decode_loop()) is not None \
                and loop.takes(plan.decode.plan):
            x = loop.run(h, cos, signed_sin, batch.slot_mapping, plan.decode.plan, pool)
            # a decode-only step samples every row, in order, but for a one-token prefill chunk
            return self._logits(x if batch.logits_indices.numel() == x.shape[0] else x[batch.logits_indices])
        if (plan.fresh or plan.prefills) and plan.decodes_lead and (loop := self.decode_loop()) is not None \
                and loop.takes_fresh(plan.fresh, plan.prefills, None if plan.decode is None else plan.decode.plan):
            return self._logits(loop.run_fresh(h, cos, signed_sin, batch.slot_mapping, plan.fresh, plan.prefills,
                                               None if plan.decode is None else plan.decode.plan,
                                               batch.logits_indices, pool))
        first = layers[0].input_layernorm
        x = ops.add_rms_norm(h, None, first.weight, first.eps, torch.empty_like(h))  # the normed stream
        norms = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        rows = _sampled_rows(batch)
        for layer, next_norm in zip(layers, norms):
            last = layer is layers[-1] and rows is not None
            attn = self._reduced(layer.self_attn(x, cos, signed_sin, batch, plan, pool, ops, rows if last else None),
                                 h.dtype)
            if last:  # from here on only the sampled tokens' stream
                h, x = h[rows], torch.empty_like(attn)
            post = layer.post_attention_layernorm
            x = ops.add_rms_norm(h, attn, post.weight, post.eps, x)
            mlp = self._reduced(layer.mlp(x, ops), h.dtype)
            x = ops.add_rms_norm(h, mlp, next_norm.weight, next_norm.eps, x)
        return self._logits(x if rows is not None else x[batch.logits_indices])

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.layout is None or self.comm is None:
            return self.model.embed_tokens(input_ids).contiguous()
        return self.layout.embed(self.model.embed_tokens, input_ids, self.comm).contiguous()

    def _reduced(self, partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A row-parallel linear's output: this rank's partial sum (float32 where the linear is a
        `WidePartialLinear`) -> the sum over ranks, rounded to `dtype` once, after the sum."""
        if self.comm is not None:
            self.comm.all_reduce(partial)
        return partial.to(dtype)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """[num_samples, vocab]: the lm_head over x; under tensor parallelism each rank's vocabulary
        block gathered on rank 0 (other ranks get their own block) and the padding cut off."""
        logits = self.lm_head(x)
        if self.layout is None or self.comm is None:
            return logits
        return self.comm.gather_vocab(logits.contiguous())[:, :self.layout.vocab_size]

    def decode_loop(self) -> DecodeLoop | None:
        """The ops' loop over this model's layers (built once), or None."""
        if not self._decode_loop_built:
            self._decode_loop, self._decode_loop_built = self._build_decode_loop(), True
        return self._decode_loop

    def _build_decode_loop(self) -> DecodeLoop | None:
        layers: list[DecoderLayer] = list(self.model.layers)  # type: ignore[arg-type]
        if any(layer.self_attn.has_qk_norm for layer in layers):  # per-head norms: not what a loop runs
            return None
        cfg = self.config
        stack = DecoderStack(tuple(_weights(layer) for layer in layers), self.model.norm.weight, self.model.norm.eps,
                             cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        return self.ops.decode_loop(stack)


def _weights(layer: DecoderLayer) -> DecoderWeights:
    attn, mlp = layer.self_attn, layer.mlp
    return DecoderWeights(attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj, layer.input_layernorm.weight,
                          layer.post_attention_layernorm.weight, layer.input_layernorm.eps,
                          layer.post_attention_layernorm.eps)


def _sampled_rows(batch: ForwardBatch) -> torch.Tensor | None:
    """The tokens the last layer's tail (o_proj, MLP, final norm) must run on: only the sampled
    ones need it, every other token needs only its K/V, which the layer's qkv projection
    writes for all. None when every token is sampled (a decode-only step), so nothing is
    gathered. In a prefill step of 8 x 256 tokens this skips 84% of the last layer's FLOPs
    (about 2.8% of the step)."""
    indices = batch.logits_indices
    return None if indices.numel() == batch.input_ids.numel() else indices


def _pick(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t if rows is None else t[rows]
