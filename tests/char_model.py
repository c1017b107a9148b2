"""A tiny random Llama with a character-level tokenizer, for structured-output tests.

The word-level tokenizer of `tiny_models.py` has no token for "{" or '"', so no grammar
for JSON can be satisfied with it. Here newline and every printable ASCII character is one token (id =
3 + its index in CHARS; 0, 1, 2 are <unk>, </s>, <s>), so any JSON text and Hermes
tool-call tags (which need a newline) can be produced. `<think>` and `</think>` are tokens
too (THINK, END_THINK: added, not special, as in Qwen3's vocabulary), for reasoning parsers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHARS = ["\n"] + [chr(c) for c in range(32, 127)]
THINK, END_THINK = 3 + len(CHARS), 4 + len(CHARS)  # the token ids of <think> and </think>
VOCAB_SIZE = 128
CHAT_TEMPLATE = ("{% if tools %}<tools>{{ tools | tojson }}{% endif %}"
                 "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                 "{% for c in m.get('tool_calls', []) %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
                 "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def make_char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "</s>": 1, "<s>": 2} | {c: 3 + i for i, c in enumerate(CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_tokens([AddedToken(marker, normalized=False) for marker in ("<think>", "</think>")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_char_model(folder: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    make_char_tokenizer().save_pretrained(folder)
    return folder
