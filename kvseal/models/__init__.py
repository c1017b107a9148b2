"""Llama-family models over the paged KV pool, and their loading from local files."""

from kvseal.model_files import default_model_path
from kvseal.models.llama import CausalLM
from kvseal.models.loader import LoadedModel, load_model

__all__ = ["CausalLM", "LoadedModel", "default_model_path", "load_model"]
