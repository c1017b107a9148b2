"""A tiny hand-built Llama that copies its context: the negative controls' model.

A random-weight model never repeats a marker, so a canary run against it could not see a
leak even if one happened. This model does, by construction: its one attention head attends
to the token exactly `period` positions back (RoPE alone, no content in the score) and writes
that token's code into a block the LM head reads. Greedy decoding therefore continues any text
periodically: a canary prompt ending in "MARKER MARKER MARKER " (period = marker + space) makes
it repeat MARKER, and if the slots it reads hold another request's KV, it repeats *that*
request's marker. It is a real HF folder (config.json, model.safetensors, byte-level BPE
tokenizer with one token per byte) loaded by kvseal's normal path.

Layout of the residual stream (hidden 384): [0, 128) the current token's code, 128 a constant
1, [256, 384) the copied token's code. Token codes are random unit vectors in 128 dims (any two
have |cos| well under 1, so the LM head's argmax is the copied token). MLPs are zero.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from kvseal.canary.markers import DISPLAY_LEN

PERIOD = DISPLAY_LEN + 1  # a canary prompt ends in repetitions of "MARKER "
HEAD_DIM = 128
HIDDEN = 3 * HEAD_DIM
CONST_DIM = HEAD_DIM
COPY_BLOCK = slice(2 * HEAD_DIM, 3 * HEAD_DIM)
ROPE_THETA = 10000.0
SCORE_SCALE = 200.0  # peak attention logit; the runner-up is at least ~18% of it lower
MAX_POSITIONS = 1024
SPECIALS = ["<unk>", "</s>", "<s>"]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def make_byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (GPT-2's byte alphabet, no merges) after three special tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS)} | {ch: i + len(SPECIALS) for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", bos_token="<s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _positional_qk(period: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (one head, [HEAD_DIM]) whose RoPE'd product peaks at distance `period - 1`.

    With k_j = a_j and q_j = a_j * exp(-i D theta_j) per rotary pair j, the score between
    positions m and n is sum_j a_j^2 cos((m - n - D) theta_j); weights a_j^2 ~ theta_j keep
    every other distance up to 1,100 at least 18% of the peak below it."""
    half = HEAD_DIM // 2
    theta = 1.0 / (ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    weight = theta / theta.sum() * SCORE_SCALE * HEAD_DIM ** 0.5  # undo the 1/sqrt(d) scaling
    amp = weight.sqrt()
    angle = -(period - 1) * theta
    k = torch.cat([amp, torch.zeros(half, dtype=torch.float64)])
    q = torch.cat([amp * angle.cos(), amp * angle.sin()])
    return q.float(), k.float()


def make_copy_model(folder: Path, seed: int = 0) -> Path:
    tokenizer = make_byte_tokenizer()
    vocab_size = len(tokenizer)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=HIDDEN // HEAD_DIM, num_key_value_heads=1, head_dim=HEAD_DIM,
                         max_position_embeddings=MAX_POSITIONS, rope_theta=ROPE_THETA, rms_norm_eps=1e-6,
                         eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    codes = torch.nn.functional.normalize(torch.randn(vocab_size, HEAD_DIM, generator=gen), dim=-1)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.norm.weight.fill_(1.0)
        layer = model.model.layers[0]
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
        model.model.embed_tokens.weight[:, :HEAD_DIM] = codes
        model.model.embed_tokens.weight[:, CONST_DIM] = 1.0
        norm_gain = (HIDDEN / 2) ** 0.5  # RMSNorm of (unit code, 1, zeros) multiplies by this
        q, k = _positional_qk(PERIOD)
        attn = layer.self_attn
        attn.q_proj.weight[:HEAD_DIM, CONST_DIM] = q / norm_gain  # head 0 only; heads 1, 2 stay 0
        attn.k_proj.weight[:, CONST_DIM] = k / norm_gain
        attn.v_proj.weight[:, :HEAD_DIM] = torch.eye(HEAD_DIM) / norm_gain
        attn.o_proj.weight[COPY_BLOCK, :HEAD_DIM] = torch.eye(HEAD_DIM)
        model.lm_head.weight[:, COPY_BLOCK] = codes * 10.0
        model.lm_head.weight[: len(SPECIALS)] = 0.0  # never emits <unk>, </s> or <s>
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
