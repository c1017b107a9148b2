"""A one-layer "copy the majority" Llama for canary tests: its greedy output repeats the token
that fills most of the KV it attends to.

q = 0, so attention is uniform over every attended slot; v and o are (scaled) identities and
the MLP is zero, so the last hidden state is the token's own embedding plus 4x the mean of the
attended embeddings, and the tied LM head picks the token whose embedding dominates. A prompt
that repeats a unique marker word answers with that marker; a request that attends to pages
holding another tenant's KV answers with *their* marker. So a foreign marker in a response is
exactly a KV leak, visible in plain text. Same tokenizer as `tests/tiny_models.py`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import BOS_ID, EOS_ID, VOCAB_SIZE, make_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

HIDDEN = 64


def make_marker_model(folder: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                         eos_token_id=EOS_ID, bos_token_id=BOS_ID, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        embed = torch.randn(VOCAB_SIZE, HIDDEN)
        embed = embed / embed.norm(dim=-1, keepdim=True) * HIDDEN**0.5  # RMS 1: RMSNorm leaves it alone
        embed[EOS_ID] = 0  # never the answer
        model.model.embed_tokens.weight.copy_(embed)
        attn = model.model.layers[0].self_attn
        attn.v_proj.weight.copy_(torch.eye(HIDDEN))
        attn.o_proj.weight.copy_(4 * torch.eye(HIDDEN))
        for norm in (model.model.layers[0].input_layernorm, model.model.layers[0].post_attention_layernorm,
                     model.model.norm):
            norm.weight.fill_(1.0)
    model.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


def marker_prompt(marker: int, length: int) -> str:
    return " ".join([f"w{marker}"] * length)
