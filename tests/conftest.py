from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import CONFIGS, make_tiny_model  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model(arch, root / arch) for arch in CONFIGS}


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture
def make_llm(llama_dir: Path) -> Callable[..., Any]:
    """An offline LLM over the tiny Llama with small pages, so edge cases are hit."""
    from kvseal import LLM

    def make(**kwargs: Any) -> Any:
        defaults: dict[str, Any] = dict(kv_cache_tokens=512, page_size=4, max_num_batched_tokens=32, dtype="float32")
        defaults.update(kwargs)
        model = defaults.pop("model", str(llama_dir))
        return LLM(model, **defaults)

    return make
