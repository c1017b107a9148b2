"""Load a Llama-family model and its tokenizer from a local folder or GGUF file.

A Hugging Face folder needs config.json, *.safetensors and tokenizer files. A GGUF file is
converted once (weights dequantized with the `gguf` package, config and tokenizer with its
chat template read from the GGUF metadata) into a Hugging Face folder under the user's cache
(`model_files`: what the cache trusts), then loaded like any folder. Nothing is ever fetched
from a hub.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import importlib
import json
import logging
import os
import shutil
import sys
import tempfile
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvseal.config import ModelConfig
from kvseal.errors import ModelLoadError
from kvseal.model_files import (
    GgufSource,
    conversion_problem,
    gguf_cache_dir,
    older_conversions,
    private_gguf_dir,
    resolve_model_path,
    stamp_conversion,
)
from kvseal.models.llama import PACKED_MODULES, CausalLM
from kvseal.models.tensor_parallel import RankLayout

logger = logging.getLogger("kvseal")

@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Any
    name: str
    path: Path
    tokenizer_path: Path  # the folder the tokenizer was loaded from (the model's, or --tokenizer)


def plan_config(model: str | os.PathLike[str] | None) -> ModelConfig:
    """The model's dimensions from config.json or GGUF metadata alone; no weights are read."""
    path = resolve_model_path(model)
    if path.suffix != ".gguf":
        return ModelConfig.from_hf(_load_hf_config(path))
    _import_config_validators()
    from transformers import AutoConfig

    try:
        return ModelConfig.from_hf(AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name))
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF metadata of {path}: {exc}") from exc


def folder_config(model: str | os.PathLike[str] | None) -> ModelConfig:
    """The dimensions `load_model` will build: config.json of the folder it reads (a GGUF file
    converted to one first, as `load_model` would, once per file). No weights are read."""
    path = resolve_model_path(model)
    return ModelConfig.from_hf(_load_hf_config(convert_gguf(path) if path.suffix == ".gguf" else path))


def load_model(model: str | os.PathLike[str] | None, dtype: torch.dtype,
               rank: tuple[int, int] | None = None, tokenizer_folder: str | None = None) -> LoadedModel:
    """The model and its tokenizer (the model's, or the one in `tokenizer_folder`: `--tokenizer`);
    `rank` = (rank, tp): only that tensor-parallel rank's shard of the weights
    (`tensor_parallel.RankLayout`), `config` still the whole model's."""
    path = resolve_model_path(model)
    folder = convert_gguf(path) if path.suffix == ".gguf" else path
    config = ModelConfig.from_hf(_load_hf_config(folder))
    tokenizer_path = Path(tokenizer_folder) if tokenizer_folder is not None else folder
    tokenizer = _load_tokenizer(tokenizer_path)
    if tokenizer_folder is not None and len(tokenizer) > config.vocab_size:  # (a model's own may add a few)
        raise ModelLoadError(f"the tokenizer in {tokenizer_path} has {len(tokenizer)} tokens, more than the "
                             f"model's vocabulary of {config.vocab_size}: it is not this model's tokenizer")
    extra_eos = _generation_eos(folder) + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    eos = tuple(dict.fromkeys([*config.eos_token_ids, *extra_eos]))
    config = dataclasses.replace(config, eos_token_ids=eos)
    layout = RankLayout.of(config, *rank) if rank is not None else None
    module = _build_and_load(config, folder, dtype, layout)
    return LoadedModel(module, config, tokenizer, path.stem if path.is_file() else path.name, path, tokenizer_path)


def _load_hf_config(folder: Path) -> Any:
    _import_config_validators()
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # transformers raises many types for a bad config
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {exc}") from exc


class _DeferredActivations(Mapping[str, Any]):
    """transformers' table of activation functions (`transformers.activations.ACT2FN`), imported
    the first time it is read."""

    @staticmethod
    def _table() -> Mapping[str, Any]:
        table: Mapping[str, Any] = importlib.import_module("transformers.activations").ACT2FN
        return table

    def __getitem__(self, name: str) -> Any:
        return self._table()[name]

    def __contains__(self, name: object) -> bool:
        return name in self._table()

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


def _import_config_validators() -> None:
    """Import transformers' config field validators (`transformers.utils.type_validators`, which
    LlamaConfig's module imports) without importing its activation functions with them.

    The validators' module imports `ACT2FN` from `transformers.activations` when torch is
    installed, for the one validator that checks an activation's name (`activation_fn_key`, used
    by no architecture kvseal runs); that module imports transformers' model-loading code and,
    through it, `torch.distributed.tensor`: about a second of CPU at every engine start for
    modules the engine never uses. Here it is imported with `ACT2FN` a view that imports the
    real table the first time a validator reads it, so every validator still checks what it
    checked. Nothing is done where either module is imported already; should the validators'
    module need anything else of `transformers.activations` (another transformers version),
    it is imported again, as usual."""
    validators, activations = "transformers.utils.type_validators", "transformers.activations"
    if validators in sys.modules or activations in sys.modules:
        return
    stand_in = types.ModuleType(activations)
    stand_in.ACT2FN = _DeferredActivations()  # type: ignore[attr-defined]
    sys.modules[activations] = stand_in
    try:
        importlib.import_module(validators)
    except ImportError:
        sys.modules.pop(validators, None)
    finally:
        if sys.modules.get(activations) is stand_in:
            del sys.modules[activations]


def _load_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {folder} (tokenizer.json / "
                             f"tokenizer_config.json): {exc}") from exc


def _generation_eos(folder: Path) -> list[int]:
    path = folder / "generation_config.json"
    if not path.exists():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return eos if isinstance(eos, list) else [] if eos is None else [eos]


def _build_and_load(config: ModelConfig, folder: Path, dtype: torch.dtype,
                    layout: RankLayout | None = None) -> CausalLM:
    return model_from_state_dict(config, _read_safetensors(folder), dtype, str(folder), layout)


def model_from_state_dict(config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                          source: str = "the state dict", layout: RankLayout | None = None) -> CausalLM:
    """kvseal's model of `config` from a Hugging Face checkpoint's tensors (names as in its
    safetensors; q/k/v and gate/up are packed here), on the tensors' device, in `dtype`; with a
    tensor-parallel `layout`, that rank's shard. ModelLoadError when the names do not match the
    architecture."""
    with torch.device("meta"):
        module = CausalLM(config if layout is None else layout.rank_config(config))
    state = dict(state)
    params = [k for k in module.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")]
    expected = {name for key in params for name in _checkpoint_names(key)}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing = sorted(expected - set(state))
    unexpected = sorted(k for k in set(state) - expected if "rotary_emb" not in k)
    if missing or unexpected:
        raise ModelLoadError(f"weights in {source} do not match {config.architecture}: "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    if layout is not None:  # this rank's slice of each tensor, before packing q/k/v and gate/up
        state = {name: layout.shard(name, t) for name, t in state.items()}
    packed = {key: torch.cat([state[n] for n in _checkpoint_names(key)]).to(dtype) for key in params}
    module.load_state_dict(packed, strict=False, assign=True)
    if config.tie_word_embeddings:
        module.lm_head.weight = module.model.embed_tokens.weight
    return module.eval()


def _checkpoint_names(key: str) -> list[str]:
    """The checkpoint tensor names that make up model parameter `key` (see PACKED_MODULES)."""
    for packed, parts in PACKED_MODULES.items():
        if f".{packed}." in key:
            return [key.replace(f".{packed}.", f".{part}.") for part in parts]
    return [key]


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as exc:
            raise ModelLoadError(f"cannot read weights file {f}: {exc}") from exc
    return state


def convert_gguf(path: Path, into: Path | None = None) -> Path:
    """The Hugging Face folder of a GGUF file: its conversion in the cache (`gguf_cache_dir`),
    made here where it is missing or must not be used (`conversion_problem`: another user may
    change it, it was not made from this very file, it is incomplete), once per version of the
    file. Where two processes convert the same file at once, the slower uses the folder the
    faster finished. Where the cache cannot be written, into a private folder of this process
    (`private_gguf_dir`). `into`: the folder to use instead of the cache's (another process's
    private folder, which this one's would not be)."""
    source = GgufSource.of(path)
    folder = gguf_cache_dir(path) if into is None else into
    problem = conversion_problem(folder, source)
    if problem is None:
        return folder
    if folder.exists():
        logger.warning("the converted folder %s is not used (%s): %s is converted again", folder, problem, path)
    else:
        logger.info("converting %s to a Hugging Face folder in %s (once)", path, folder)
    try:
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".converting-"))  # 0700
    except OSError as exc:  # the cache can be read but not written: a read-only mount, another user's
        folder = private_gguf_dir(path, exc)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".converting-"))
    try:
        _write_hf_folder(path, tmp)
        stamp_conversion(tmp, source)
        _install(tmp, folder, source)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing left where it became `folder`
    for older in older_conversions(folder, source):
        _remove_folder(older)
    return folder


def _install(tmp: Path, folder: Path, source: GgufSource) -> None:
    """Rename the finished conversion `tmp` to `folder`. A folder there already (renaming onto a
    folder that is not empty fails with ENOTEMPTY, or EEXIST) is kept where `conversion_problem`
    accepts it: another process converted the same file meanwhile. Otherwise it is removed and
    the rename tried again."""
    for _ in range(3):
        try:
            tmp.rename(folder)
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        if conversion_problem(folder, source) is None:
            return
        _remove_folder(folder)
    raise ModelLoadError(f"cannot put the conversion of {source.path} at {folder}: a folder that is not its "
                         f"conversion keeps appearing there; stop whatever writes {folder.parent}, or set "
                         f"XDG_CACHE_HOME to a folder only this user may write")


def _remove_folder(folder: Path) -> None:
    """Remove `folder`, renamed aside first so that no start sees it half removed; what cannot be
    removed (another user's files) stays aside, as a hidden `.removed-*` folder."""
    aside = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".removed-"))
    with contextlib.suppress(FileNotFoundError):  # removed meanwhile by another process
        folder.rename(aside / folder.name)
    shutil.rmtree(aside, ignore_errors=True)


def _write_hf_folder(path: Path, out: Path) -> None:
    from safetensors.torch import save_file

    _import_config_validators()
    from transformers import AutoConfig, AutoTokenizer

    try:
        hf_config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF metadata of {path}: {exc}") from exc
    config = ModelConfig.from_hf(hf_config)
    hf_config.architectures = [config.architecture]
    state = _dequantize_gguf(path, config)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    hf_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _dequantize_gguf(path: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    from gguf import GGUFReader, dequantize

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    state = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        weights = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).float()
        state[name] = unpermute_rows(name, weights, config)
    return state


def hf_name(gguf_name: str) -> str:
    """The Hugging Face checkpoint name of a GGUF tensor (ModelLoadError for one kvseal does not know)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and parts[2] in _GGUF_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    if parts[0] in _GGUF_TOP:
        return f"{_GGUF_TOP[parts[0]]}.{parts[1]}"
    raise ModelLoadError(f"unexpected tensor {gguf_name!r} in GGUF file")


def unpermute_rows(name: str, w: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Undo llama.cpp's q/k row interleave (applied for Llama and Mistral checkpoints only) on the
    rows (output features) of w [out, ...], whatever each row holds."""
    if config.architecture not in ("LlamaForCausalLM", "MistralForCausalLM"):
        return w
    if name.endswith("q_proj.weight"):
        n_head = config.num_heads
    elif name.endswith("k_proj.weight"):
        n_head = config.num_kv_heads
    else:
        return w
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
