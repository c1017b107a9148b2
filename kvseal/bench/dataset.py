"""Random prompts of an exact token length, sent as token ids.

Token-id prompts make the input length exact on every server that accepts them (`prompt` as a
list of ints in `/v1/completions`: kvseal and vLLM both do), instead of text whose re-encoding
may drift by a token or two. Ids are drawn uniformly from the model's vocabulary without its
special tokens, so no prompt contains BOS/EOS or a chat marker.
"""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvseal.errors import KvsealError


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


def load_tokenizer(path: str | None) -> Any:
    """The tokenizer at `path`, or the default model's (its converted HF folder, made once)."""
    from transformers import AutoTokenizer

    if path is None:
        path = str(_default_model_folder())
    if not Path(path).exists():
        raise KvsealError(f"tokenizer path {path} does not exist; pass --tokenizer with a local model folder")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise KvsealError(f"cannot load a tokenizer from {path} ({' '.join(str(exc).split())}); pass --tokenizer "
                          f"with a local model folder holding tokenizer.json or tokenizer_config.json") from exc


def _default_model_folder() -> Path:
    from kvseal.model_files import default_model_path

    return converted_folder(default_model_path())


def converted_folder(path: Path) -> Path:
    """The GGUF file's converted folder; made (once) in a child process where it is missing or not
    to be used (`conversion_problem`), since the conversion dequantizes weights with torch and the
    bench process keeps torch out. The child converts into the folder this process names, so that
    where the cache is not used (`gguf_cache_dir`'s private folder) the conversion lands in this
    process's folder, not in the child's, which goes when the child exits."""
    from kvseal.model_files import GgufSource, conversion_problem, gguf_cache_dir

    folder = gguf_cache_dir(path)
    if conversion_problem(folder, GgufSource.of(path)) is not None:
        convert = "import sys; from pathlib import Path; from kvseal.models.loader import convert_gguf; " \
                  "convert_gguf(Path(sys.argv[1]), into=Path(sys.argv[2]))"
        subprocess.run([sys.executable, "-c", convert, str(path), str(folder)], check=True)
        problem = conversion_problem(folder, GgufSource.of(path))
        if problem is not None:
            raise KvsealError(f"the conversion of {path} cannot be used: {problem}; pass --tokenizer with a local "
                              f"model folder")
    return folder


def prompt_vocab(tokenizer: Any) -> list[int]:
    """Token ids a random prompt may use: the whole vocabulary less the special tokens."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    if not ids:
        raise KvsealError("the tokenizer has no ordinary tokens to build random prompts from")
    return ids


def random_requests(vocab: list[int], num_prompts: int, input_len: int, output_len: int,
                    rng: random.Random) -> list[BenchRequest]:
    """`num_prompts` prompts of exactly `input_len` ids, each asking for exactly `output_len` tokens."""
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise KvsealError(f"num_prompts, input_len and output_len must be >= 1 "
                          f"(got {num_prompts}, {input_len}, {output_len})")
    return [BenchRequest([rng.choice(vocab) for _ in range(input_len)], output_len) for _ in range(num_prompts)]
