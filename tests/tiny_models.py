"""Tiny random-weight models for tests, one per supported architecture, saved like real ones.

Each is a Hugging Face folder (config.json, model.safetensors, tokenizer.json with a chat
template) so tests exercise the real loading path. Words are "w3".."w511" (token id = N); 0, 1, 2 are <unk>, </s>, <s>.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

VOCAB_SIZE = 512
EOS_ID, BOS_ID = 1, 2
CHAT_TEMPLATE = (  # `enable_thinking` (a template variable, as Qwen3's): rendered only when it is passed
    "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}{% if add_generation_prompt %}w5{% endif %}"
    "{% if enable_thinking is defined and enable_thinking %} w6{% endif %}"
)

_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               eos_token_id=EOS_ID, bos_token_id=BOS_ID, tie_word_embeddings=False)

# LLM() engine arguments that exercise every path of a forward on the tiny models: one batch,
# chunked prefill, preemption (a pool too small for every prompt at once), big pages checked
SCHEDULES = {
    "batched": dict(kv_cache_tokens=1024, page_size=4, max_num_batched_tokens=2048, dtype="float32"),
    "chunked": dict(kv_cache_tokens=1024, page_size=4, max_num_batched_tokens=5, dtype="float32"),
    "preempting": dict(kv_cache_tokens=80, page_size=4, max_num_batched_tokens=64, max_model_len=80, dtype="float32"),
    "big-pages-checked": dict(kv_cache_tokens=1024, page_size=16, max_num_batched_tokens=24, check_kv=True,
                              dtype="float32"),
}


CONFIGS = {
    "llama": lambda: LlamaConfig(**_COMMON),
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**_COMMON),
    "qwen3": lambda: Qwen3Config(**{**_COMMON, "tie_word_embeddings": True}, head_dim=32),
}
TP_CONFIGS = {
    # tensor-parallel shapes: one KV head (replicated on every rank), and 3 KV heads of 6 query
    # heads with an odd vocabulary (split unevenly over 2 ranks, as SmolLM2-135M's 3 of 9 are)
    "llama_one_kv_head": lambda: LlamaConfig(**{**_COMMON, "num_key_value_heads": 1}),
    "llama_odd_split": lambda: LlamaConfig(**{**_COMMON, "hidden_size": 96, "num_attention_heads": 6,
                                              "num_key_value_heads": 3, "intermediate_size": 150,
                                              "vocab_size": 509}),
}


# the kernels' own shapes: a head dim of 64, which the prefill attention kernel takes on AMX
KERNEL_CONFIGS = {
    "llama_head_dim_64": lambda: LlamaConfig(**{**_COMMON, "hidden_size": 128, "num_attention_heads": 2,
                                                "num_key_value_heads": 1}),
}


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"w{i}": i for i in range(VOCAB_SIZE)} | {"<unk>": 0, "</s>": EOS_ID, "<s>": BOS_ID}
    for special in ("w0", f"w{EOS_ID}", f"w{BOS_ID}"):
        del vocab[special]
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(arch: str, folder: Path, seed: int = 0) -> Path:
    """Write a random-weight model of `arch` into `folder`; return the folder."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config({**CONFIGS, **TP_CONFIGS, **KERNEL_CONFIGS}[arch]()).eval()
    with torch.no_grad():  # larger weights than the init default: sharper, less tie-prone logits
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)
