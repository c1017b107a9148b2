"""Which backend runs the ops: `select_ops`, from the engine's `--native auto|require|off`.

- `auto` (the default): the native kernels, built at first start (or found in the cache); if
  they cannot be built, the torch ops, with a warning that carries the compiler's message.
- `require`: the native kernels, or start-up fails (ConfigError) with the compiler's message.
- `off`: the torch ops, no compiler run.

Backends are chosen by device type (`BACKENDS`): on "cuda" the Triton backend (`TritonOps`),
whatever `--native` says of the CPU kernels (`require` is refused there: they are CPU kernels).
`--attention-backend triton` runs the Triton backend on the CPU too, on CPU tensors under
Triton's interpreter (`TRITON_INTERPRET=1`): how the tests hold the CUDA backend to the torch
ops on machines without a GPU. A new backend is its module, a class implementing
`interface.Ops`, and one line here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvseal.config import NATIVE_MODES, NativeMode
from kvseal.errors import ConfigError
from kvseal.ops.interface import Ops
from kvseal.ops.native_backend import NativeOps
from kvseal.ops.native_build import BuildConfig, NativeBuildError
from kvseal.ops.native_kernels import NativeKernels
from kvseal.ops.torch_backend import TorchOps

logger = logging.getLogger("kvseal")

def cpu_ops(native: NativeMode, build: BuildConfig) -> Ops:
    """The native kernels per `native`, else the torch ops."""
    if native == "off":
        logger.info("ops: torch (--native off)")
        return TorchOps()
    try:
        kernels = NativeKernels.load(build)
    except NativeBuildError as error:
        if native == "require":
            raise ConfigError(f"--native require: the native kernels cannot be built ({build.describe()}): "
                              f"{error}") from error
        logger.warning("ops: torch; the native kernels cannot be built (%s): %s", build.describe(), error)
        return TorchOps()
    built, engines = kernels.built, {kernels.TILES_NONE: "none", kernels.TILES_AVX512: "AVX512-BF16",
                                      kernels.TILES_AMX: "AMX"}
    logger.info("ops: native, %s (%s; %s), %s; tile linears on %s", built.path,
                f"built in {built.build_s:.1f} s" if built.build_s else "from the cache", built.compiler_version,
                build.describe(), engines.get(kernels.tile_engine, kernels.tile_engine))
    return NativeOps(kernels, TorchOps())


def cuda_ops(native: NativeMode, build: BuildConfig) -> Ops:
    """The Triton backend (Triton attention, torch's CUDA ops for the rest)."""
    if native == "require":
        raise ConfigError("--native require asks for kvseal's native kernels, which are CPU kernels; on --device cuda "
                          "the Triton backend runs: drop --native require (or pass --device cpu)")
    from kvseal.ops.triton_backend import TritonOps  # imports triton: only where it runs

    logger.info("ops: triton (attention), torch's CUDA ops for the linears (cuBLAS)")
    return TritonOps()


def triton_on_cpu() -> Ops:
    """The Triton backend on CPU tensors: under Triton's interpreter only."""
    import triton

    if not triton.knobs.runtime.interpret:
        raise ConfigError("--attention-backend triton on --device cpu runs the Triton kernels under Triton's "
                          "interpreter, which is off: set TRITON_INTERPRET=1 before starting (it is slow, for tests), "
                          "or leave --attention-backend auto")
    from kvseal.ops.triton_backend import TritonOps

    logger.warning("ops: triton under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1): for tests, slow")
    return TritonOps()


# device type -> its backend
BACKENDS: dict[str, Callable[[NativeMode, BuildConfig], Ops]] = {"cpu": cpu_ops, "cuda": cuda_ops}


def select_ops(native: NativeMode = "auto", device: str = "cpu", build: BuildConfig | None = None,
               attention_backend: str = "auto") -> Ops:
    """The ops for `device` ("cpu" or "cuda"; `--attention-backend triton`: the Triton backend
    there). Raises ConfigError for `native="require"` without kernels, or a device no backend
    runs on."""
    if native not in NATIVE_MODES:
        raise ConfigError(f"native must be one of {', '.join(NATIVE_MODES)}; got {native!r}")
    if attention_backend not in ("auto", "triton"):
        raise ConfigError(f"attention_backend must be auto or triton; got {attention_backend!r}")
    backend = BACKENDS.get(device)
    if backend is None:
        raise ConfigError(f"no ops backend for device {device!r}; there is one for {', '.join(BACKENDS)}")
    if attention_backend == "triton" and device == "cpu":
        return triton_on_cpu()
    return backend(native, build or BuildConfig.from_environment())
