"""The ops layer: the kernels (C sources in `csrc/`), their torch fallbacks, and the dispatch
between them, behind one interface (`interface.Ops`). Model code and the sampler call an `Ops`;
only this package knows which backend runs."""

from kvseal.ops.dispatch import NATIVE_MODES, NativeMode, select_ops
from kvseal.ops.interface import (
    DecodeLoop,
    DecodePlan,
    DecoderStack,
    DecoderWeights,
    FreshPrefills,
    NewTokens,
    Ops,
    PrefillSpan,
)
from kvseal.ops.torch_backend import TorchOps

__all__ = ["NATIVE_MODES", "DecodeLoop", "DecodePlan", "DecoderStack", "DecoderWeights", "FreshPrefills",
           "NativeMode", "NewTokens", "Ops", "PrefillSpan", "TorchOps", "select_ops"]
