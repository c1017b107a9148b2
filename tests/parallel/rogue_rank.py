"""A rogue tensor-parallel rank: a process that reaches rank 0's rendezvous and joins as rank 1
without the engine's key (it proves a key of its own), then acts as a worker would, writing down
everything the group sends it. `test_rank_auth.py` runs it against an engine's rank 0.

    python rogue_rank.py PORT RECORD_JSON NUM_PAGES

It speaks raw torch.distributed, as an attacker would (kvseal's codecs only to read what it
gets). RECORD_JSON is rewritten after every message: {"handshake_bytes": N, "messages": [...]},
`messages` being what it received after the handshake, the thing that must stay empty.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kvseal.parallel.msgs import ReadyMsg, RefusalsMsg, StepMsg, decode_to_rank, encode
from kvseal.parallel.rank_auth import NONCE_BYTES, TAG_BYTES, new_nonce, tag_of

TIMEOUT = datetime.timedelta(seconds=20)
RANK, WORLD_SIZE = 1, 2


class Rogue:
    def __init__(self, record: Path) -> None:
        self.record, self.handshake_bytes = record, 0
        self.messages: list[dict[str, Any]] = []
        self.pg: Any = None
        self.key = secrets.token_bytes(32)  # not the engine's

    def write(self) -> None:
        self.record.write_text(json.dumps({"handshake_bytes": self.handshake_bytes, "messages": self.messages}))

    def options(self) -> Any:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        options._timeout = TIMEOUT
        return options

    def gather_fixed(self, data: bytes, size: int) -> list[bytes]:
        parts = [torch.empty(size, dtype=torch.uint8) for _ in range(WORLD_SIZE)]
        dist.all_gather(parts, torch.frombuffer(bytearray(data), dtype=torch.uint8), group=self.pg)
        return [p.numpy().tobytes() for p in parts]

    def handshake(self, label: str) -> None:
        """Take part in kvseal's handshake with a key of its own: well-formed, wrong tag."""
        nonces = self.gather_fixed(new_nonce(), NONCE_BYTES)
        self.gather_fixed(tag_of(self.key, label, WORLD_SIZE, RANK, nonces), TAG_BYTES)
        self.handshake_bytes += NONCE_BYTES + TAG_BYTES  # rank 0's nonce and tag

    def gather_bytes(self, data: bytes) -> None:
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.empty_like(size) for _ in range(WORLD_SIZE)]
        dist.all_gather(sizes, size, group=self.pg)
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty_like(mine) for _ in range(WORLD_SIZE)]
        dist.all_gather(parts, mine, group=self.pg)
        self.messages.append({"type": "gathered", "bytes": int(sizes[0])})

    def receive(self) -> Any:
        size = torch.tensor([0], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.pg)
        buf = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.pg)
        msg = decode_to_rank(buf.numpy().tobytes())
        entry: dict[str, Any] = {"type": type(msg).__name__}
        if isinstance(msg, StepMsg):
            entry.update(input_ids=msg.input_ids, request_ids=msg.request_ids)
        self.messages.append(entry)
        return msg

    def run(self, port: int, num_pages: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, WORLD_SIZE, False, TIMEOUT)
        dist.init_process_group("gloo", store=store, rank=RANK, world_size=WORLD_SIZE, timeout=TIMEOUT,
                                pg_options=self.options())
        self.handshake("start")
        self.write()
        self.gather_bytes(encode(ReadyMsg(RANK, 1, num_pages, 0)))  # what a loaded worker says
        self.write()
        self.pg = dist.new_group([0, 1], timeout=TIMEOUT, backend="gloo", pg_options=self.options())
        self.handshake("serving")
        while True:
            msg = self.receive()
            self.write()
            if isinstance(msg, StepMsg):  # the batch is in hand: refuse nothing, then leave
                self.gather_bytes(encode(RefusalsMsg({})))
                self.write()
                return


def main(argv: list[str]) -> None:
    rogue = Rogue(Path(argv[1]))
    rogue.write()
    try:
        rogue.run(int(argv[0]), int(argv[2]))
    except Exception as exc:  # refused: rank 0 closed the group on it
        print(f"rogue: {type(exc).__name__}: {exc}", file=sys.stderr)
    rogue.write()
    os._exit(0)  # no teardown of a group rank 0 may have left half-closed


if __name__ == "__main__":
    main(sys.argv[1:])
