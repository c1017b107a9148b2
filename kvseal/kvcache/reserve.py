"""The CPU engine's KV pool, reserved and being committed before the engine process imports torch.

Why. On this project's VMs the first write of memory the host had taken back costs 3-6 s per
GiB of huge pages on one vCPU: a 2 GiB pool is most of a cold start. The engine already commits
its pool on a thread while the weights load (`KVPool(touch_later=True)`), but it could only
start once torch and transformers were imported and the model's config read through them
(1.5-2.5 s on two cores). `reserve_cpu_pool` starts it first thing in the engine process: the
pool's dimensions from the model folder's config.json (plain JSON) and the engine's arguments,
its K and V mappings made and advised onto huge pages, and a thread writing them
(`kvseal.pagemem`), all without torch.

What it promises. Nothing the engine relies on: the engine resolves the pool's dimensions as
always, from the loaded model, and adopts the reservation (`KVPool(reserved=...)`, tensors over
the same mappings) only if it is exactly that pool; else it releases it (the thread stopped, the
mappings unmapped) and builds its own. A reservation is made only where the engine will run a
one-process CPU pool: device cpu (or auto where no GPU device node exists), one rank, a model
folder (or a GGUF file already converted) whose config.json names the dimensions. Anything else,
or anything unreadable, makes none, and the engine reports the problem as it would have.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from kvseal.capacity import bytes_per_element
from kvseal.config import EngineArgs
from kvseal.errors import ConfigError, ModelLoadError
from kvseal.model_files import gguf_cache_dir, resolve_model_path
from kvseal.pagemem import AdvisedMapping, BackgroundTouch, advised_mapping

logger = logging.getLogger("kvseal")

# Where one exists, torch may see a GPU, and `--device auto` would run there.
_GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd")


@dataclass(frozen=True)
class PoolGeometry:
    """A CPU pool's tensors: 2 x num_layers of [num_kv_heads, num_pages, page_size, head_dim] of `dtype`."""

    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # a `kvseal.config.DTYPES` name

    @property
    def tensor_bytes(self) -> int:
        return self.num_kv_heads * self.num_pages * self.page_size * self.head_dim * bytes_per_element(self.dtype)


class PoolReservation:
    """The mappings of a pool of `geometry` (layer order, K then V), a thread committing them."""

    def __init__(self, geometry: PoolGeometry) -> None:
        self.geometry = geometry
        self.mappings: tuple[AdvisedMapping, ...] = tuple(
            advised_mapping(geometry.tensor_bytes) for _ in range(2 * geometry.num_layers))
        self._touch: BackgroundTouch | None = BackgroundTouch([(m.address, m.nbytes) for m in self.mappings],
                                                              keep=self.mappings)

    def wait(self) -> None:
        """Every mapping written (zeros); what the adopting pool's `wait_touched()` calls."""
        if self._touch is None:
            raise RuntimeError("the reservation was released")
        self._touch.wait()

    def release(self) -> None:
        """Unused after all: the thread stopped and the memory unmapped (nothing may view it)."""
        if self._touch is None:
            return
        self._touch.stop()
        self._touch = None
        for mapping in self.mappings:
            mapping.region.close()


def reserve_cpu_pool(args: EngineArgs) -> PoolReservation | None:
    """The pool these arguments give a one-process CPU engine, reserved now; None where the
    engine will not run one or its dimensions cannot be read without torch (see the module)."""
    geometry = early_geometry(args)
    if geometry is None:
        return None
    try:
        return PoolReservation(geometry)
    except (OSError, ValueError, OverflowError) as error:  # no memory to map: the engine finds out itself
        logger.debug("no early KV pool reservation: %s", error)
        return None


def early_geometry(args: EngineArgs) -> PoolGeometry | None:
    """The pool's geometry from the arguments and config.json alone; None where not certain to be
    a one-process CPU pool or not readable."""
    if args.device == "cuda" or (args.device == "auto" and any(Path(p).exists() for p in _GPU_DEVICE_NODES)):
        return None
    if args.tensor_parallel_size != 1 or args.is_pool_sized_by_device:
        return None
    try:
        dims = _config_dims(_config_folder(args.model))
        if dims is None:
            return None
        capacity = args.capacity_for(*dims)
    except (ConfigError, ModelLoadError, OSError, ValueError) as error:
        logger.debug("no early KV pool reservation: %s", error)
        return None
    num_layers, num_kv_heads, head_dim = dims
    return PoolGeometry(num_layers, capacity.num_pages, args.page_size, num_kv_heads, head_dim, args.dtype)


def _config_folder(model: str | None) -> Path:
    path = resolve_model_path(model)
    return gguf_cache_dir(path) if path.suffix == ".gguf" else path


def _config_dims(folder: Path) -> tuple[int, int, int] | None:
    """(num_layers, num_kv_heads, head_dim) as `ModelConfig.from_hf` reads them, where the file
    names them (a field left to the config class's default is not guessed); a GGUF file not yet
    converted has no folder, and gives None."""
    if not (folder / "config.json").is_file():  # a converted GGUF's folder appears whole (a rename)
        return None
    config = json.loads((folder / "config.json").read_text())
    layers, heads, hidden = (config.get(k) for k in ("num_hidden_layers", "num_attention_heads", "hidden_size"))
    if not all(isinstance(v, int) and v > 0 for v in (layers, heads, hidden)):
        return None
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    if not all(isinstance(v, int) and v > 0 for v in (kv_heads, head_dim)):
        return None
    return layers, kv_heads, head_dim
