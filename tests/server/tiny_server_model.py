"""The tiny random-weight Llama the server tests serve (a real HF folder, loaded for real).

Same tokenizer and chat template as `tests/tiny_models.py` (words "w3".."w511", token id =
N), but a longer context (so a stream can be cut mid-way) and an end-of-sequence token the
model never prefers: its output row is zero, so greedy outputs always run to max_tokens and
tests do not depend on where random weights happen to put EOS.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import BOS_ID, EOS_ID, VOCAB_SIZE, make_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

MAX_POSITIONS = 1024


def make_server_model(folder: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
                         eos_token_id=EOS_ID, bos_token_id=BOS_ID, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
        model.lm_head.weight[EOS_ID].zero_()
    model.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder
