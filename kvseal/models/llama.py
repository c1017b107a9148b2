"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV pool.

Parameter names match Hugging Face's, except that q/k/v and gate/up projections are packed
into one matrix each (fewer, larger matmuls); `PACKED_MODULES` tells the loader how to
concatenate the checkpoint's tensors. The model sees a `ForwardBatch` and the pool; it never
sees requests, tenants or the allocator.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvseal.config import ModelConfig
from kvseal.kvcache.pool import KVPool
from kvseal.models.attention import AttentionPlan, paged_attention
from kvseal.models.decode_loop import DecodeLoop
from kvseal.models.native import NativeLibrary, add_rms_norm, linear_silu, rope_, silu_mul, write_slots
from kvseal.models.rope import RotaryEmbedding
from kvseal.types import ForwardBatch

# packed parameter name -> the checkpoint's names, concatenated along the output dimension
PACKED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# The dtypes of the native forward (`CausalLM.use_native`): its fused ops exist for both.
NATIVE_DTYPES = (torch.float32, torch.bfloat16)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' order: normalize in float32, cast back, then scale by the weight.
        # torch's fused rms_norm computes exactly that (bit-equal on CPU), in one op.
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


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

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], rope: RotaryEmbedding,
                batch: ForwardBatch, plan: AttentionPlan, pool: KVPool,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        # x: [num_tokens, hidden]. Every token's K/V is written; `rows` (None: all) picks the
        # tokens whose output is returned, so o_proj runs on those only.
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = qkv[:, :self.q_size + self.kv_size].split([self.q_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(n, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(n, self.num_kv_heads, self.head_dim))
            q, k = rope.apply(q, cos_sin), rope.apply(k, cos_sin)
        else:  # q and k heads side by side: one RoPE pass for both (it is per head, per position)
            qk = rope.apply(qkv[:, :self.q_size + self.kv_size].view(n, -1, self.head_dim), cos_sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        pool.write(self.layer_idx, batch.slot_mapping, k, v)
        out = paged_attention(q, k, v, pool, self.layer_idx, plan)  # [num_tokens, heads, head_dim]
        return self.o_proj(_pick(out.reshape(n, self.num_heads * self.head_dim), rows))

    def forward_native(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, rope: RotaryEmbedding,
                       batch: ForwardBatch, plan: AttentionPlan, pool: KVPool, native: NativeLibrary,
                       rows: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` with the native kernels (float32 or bfloat16): RoPE in place on the fused qkv
        rows and K/V stored straight from them. x: [num_tokens, hidden]; cos, signed_sin:
        [num_tokens, head_dim]; rows as in `forward`."""
        if self.has_qk_norm:  # per-head norms before RoPE: the torch formulation
            return self.forward(x, (cos[:, None], signed_sin[:, None]), rope, batch, plan, pool, rows)
        n, layer = x.shape[0], self.layer_idx
        qkv = self.qkv_proj(x).contiguous()
        rope_(native, qkv, cos, signed_sin, self.num_heads + self.num_kv_heads, self.head_dim)
        k_at, v_at = self.q_size, self.q_size + self.kv_size
        pool.write_by(layer, batch.slot_mapping, lambda k_pool, v_pool: write_slots(
            native, qkv, k_at, v_at, batch.slot_mapping, k_pool, v_pool))
        q = qkv[:, :k_at].view(n, self.num_heads, self.head_dim)
        k = qkv[:, k_at:v_at].view(n, self.num_kv_heads, self.head_dim)
        v = qkv[:, v_at:].view(n, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, pool, layer, plan, qkv)  # [num_tokens, heads, head_dim]
        return self.o_proj(_pick(out.reshape(n, self.num_heads * self.head_dim), rows))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.intermediate_size = cfg.intermediate_size
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))

    def forward_native(self, x: torch.Tensor, native: NativeLibrary) -> torch.Tensor:
        gate_up = self.gate_up_proj
        packed = getattr(gate_up, "panels", getattr(gate_up, "tiles", None))
        if isinstance(packed, torch.Tensor):  # panels or tiles: gate/up and SiLU in one pass where it applies
            act = linear_silu(native, x, packed, getattr(gate_up, "bias", None), self.intermediate_size)
            if act is not None:
                return self.down_proj(act)
        return self.down_proj(silu_mul(native, gate_up(x).contiguous()))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], rope: RotaryEmbedding,
                batch: ForwardBatch, plan: AttentionPlan, pool: KVPool,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        # h: [num_tokens, hidden]; returns the stream of `rows` only (None: all), see Attention.forward
        h = _pick(h, rows) + self.self_attn(self.input_layernorm(h), cos_sin, rope, batch, plan, pool, rows)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
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
        # The native kernels for a float32 or bfloat16 model (`use_native`); None: torch ops only.
        self.native: NativeLibrary | None = None
        # Decode-only steps in one native call (`models/decode_loop.py`), built at the first
        # such step; None where the model does not fit it.
        self._decode_loop: DecodeLoop | None = None
        self._decode_loop_built = False

    def use_native(self, native: NativeLibrary | None) -> None:
        """Run the forward with the native fused ops (the model must be float32 or bfloat16)."""
        if native is not None and self.model.norm.weight.dtype not in NATIVE_DTYPES:
            raise TypeError(f"the native forward is float32 or bfloat16, not {self.model.norm.weight.dtype}")
        self.native = native
        self._decode_loop, self._decode_loop_built = None, False

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """Run one forward, writing the new tokens' KV; return logits [num_samples, vocab] in the
        lm_head's dtype (the sampler widens them to float32 where it needs to)."""
        plan = AttentionPlan.build(batch, pool, self.config.num_heads)
        if self.native is not None:
            return self._forward_native(batch, pool, plan, self.native)
        h = self.model.embed_tokens(batch.input_ids)
        cos_sin = self.rope.cos_sin(batch.positions, h.dtype)
        rows = _sampled_rows(batch)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos_sin, self.rope, batch, plan, pool, rows if i == self.config.num_layers - 1 else None)
        return self.lm_head(self.model.norm(h if rows is not None else h[batch.logits_indices]))

    def _forward_native(self, batch: ForwardBatch, pool: KVPool, plan: AttentionPlan,
                        native: NativeLibrary) -> torch.Tensor:
        """`forward` with the residual stream updated in place: each residual add is fused with
        the RMSNorm that follows it (the next layer's input norm, or the final norm)."""
        layers: list[DecoderLayer] = list(self.model.layers)  # type: ignore[arg-type]
        h = self.model.embed_tokens(batch.input_ids).contiguous()  # [num_tokens, hidden], the residual stream
        cos, signed_sin = (t.reshape(t.shape[0], -1).contiguous() for t in self.rope.cos_sin(batch.positions, h.dtype))
        if DecodeLoop.applies(plan) and (loop := self._decode_loop_for(native)) is not None:
            x = loop.run(h, cos, signed_sin, batch.slot_mapping, plan, pool)
            return self.lm_head(x[batch.logits_indices])
        x = torch.empty_like(h)  # the normed stream each sublayer reads
        norms = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        add_rms_norm(native, h, None, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps, x)
        rows = _sampled_rows(batch)
        for layer, next_norm in zip(layers, norms):
            last = layer is layers[-1] and rows is not None
            attn = layer.self_attn.forward_native(x, cos, signed_sin, self.rope, batch, plan, pool, native,
                                                  rows if last else None)
            if last:  # from here on only the sampled tokens' stream
                h, x = h[rows], torch.empty_like(attn)
            post = layer.post_attention_layernorm
            add_rms_norm(native, h, attn.contiguous(), post.weight, post.eps, x)
            mlp = layer.mlp.forward_native(x, native).contiguous()
            add_rms_norm(native, h, mlp, next_norm.weight, next_norm.eps, x)
        return self.lm_head(x if rows is not None else x[batch.logits_indices])

    def _decode_loop_for(self, native: NativeLibrary) -> DecodeLoop | None:
        if not self._decode_loop_built:  # after the linears are packed: the loop points at their weights
            self._decode_loop, self._decode_loop_built = DecodeLoop.for_model(self, native), True
        return self._decode_loop


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
