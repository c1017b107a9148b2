"""Where a tensor-parallel rank runs its forward, and which process group carries its collectives.

Every rank joins one gloo group on the CPU: the handshake (`rank_auth.py`), the driver's step
messages, the refusals and a PD handoff's head shards go over it, on every device. On the CPU the
forward's collectives (the row-parallel all-reduces, the embedding's all-reduce, the vocabulary
gather) use that same group. On CUDA each rank takes `cuda:<local rank>` and, once the gloo group
is authenticated, the ranks form a second group with backend nccl for the forward's collectives
(authenticated in turn before it carries anything; `group.RankGroup.serving`).

The choice (`RankDevice.choose`) is a pure function of the flags and the number of visible GPUs;
`RankDevice.here` counts them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvseal.errors import ConfigError

CONTROL_BACKEND = "gloo"  # the handshake, the messages, the refusals, the handoff shards: always the CPU's


@dataclass(frozen=True)
class RankDevice:
    """One rank's device and the backend of its forward's collectives."""

    device: str  # "cpu" or "cuda:<local rank>"
    forward_backend: str  # CONTROL_BACKEND (the one gloo group) or "nccl" (a second group on `device`)

    @property
    def has_forward_group(self) -> bool:
        """Whether the forward's collectives need a group of their own (not the gloo group)."""
        return self.forward_backend != CONTROL_BACKEND

    @classmethod
    def choose(cls, device: str, local_rank: int, ranks_per_node: int, num_visible_gpus: int) -> RankDevice:
        """Local rank `local_rank` of this node's `ranks_per_node` on `device` ("cpu" or "cuda", as
        `ops.device.resolve_device` decides it). ConfigError where the node's ranks cannot each have
        a GPU of their own (NCCL refuses two ranks of one group on one device)."""
        if not 0 <= local_rank < ranks_per_node:
            raise ConfigError(f"local rank {local_rank} is outside this node's ranks 0..{ranks_per_node - 1}")
        if device == "cpu":
            return cls("cpu", CONTROL_BACKEND)
        if device != "cuda":
            raise ConfigError(f"tensor-parallel ranks run on cpu or cuda; got device {device!r}")
        if num_visible_gpus < ranks_per_node:
            raise ConfigError(
                f"--tensor-parallel-size runs {ranks_per_node} ranks on this node, one GPU each, and torch sees "
                f"{num_visible_gpus} GPU(s) here (CUDA_VISIBLE_DEVICES names them); NCCL cannot put two ranks on "
                f"one GPU. Use -tp {max(num_visible_gpus, 1)} (times --nnodes), make more GPUs visible, or pass "
                f"--device cpu")
        return cls(f"cuda:{local_rank}", "nccl")

    @classmethod
    def here(cls, device: str, local_rank: int, ranks_per_node: int) -> RankDevice:
        """`choose` with the GPUs torch sees in this process (none asked for on the CPU)."""
        return cls.choose(device, local_rank, ranks_per_node, torch.cuda.device_count() if device == "cuda" else 0)

    def enter(self) -> None:
        """Make this rank's GPU the process's current one (a plain "cuda" then means it; nccl
        needs it before the group forms). Nothing on the CPU."""
        if self.device != "cpu":
            torch.cuda.set_device(torch.device(self.device))


CPU_RANK = RankDevice("cpu", CONTROL_BACKEND)
