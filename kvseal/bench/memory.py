"""Server-side measurements taken while a benchmark runs: resident memory and KV pool use.

Resident memory is the summed RSS of the server process and all its descendants (kvseal's
frontend and engine, vLLM's API server and engine core), read from Linux's /proc every
`interval_s`; the result is the largest sum seen during the run. The KV pool figures come
from kvseal's `/metrics` (pages used + free = the pool); a server without those gauges
reports None.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from kvseal.errors import KvsealError

_PAGES_USED = re.compile(r"^kvseal_kv_pages_used (\S+)$", re.MULTILINE)
_PAGES_FREE = re.compile(r"^kvseal_kv_pages_free (\S+)$", re.MULTILINE)


def process_tree(pid: int) -> list[int]:
    """`pid` and every live descendant (by parent pid in /proc/*/stat)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(parents.get(p, []))
    return tree


def rss_bytes(pid: int) -> int:
    """Resident set size of one process (0 if it has gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss_bytes(pid: int) -> int:
    return sum(rss_bytes(p) for p in process_tree(pid))


def require_process(pid: int) -> None:
    if not Path(f"/proc/{pid}").exists():
        raise KvsealError(f"--server-pid {pid}: no such process on this machine (memory is read from /proc)")


def metrics_url(base_url: str) -> str:
    """`/metrics` at the server root of an OpenAI base URL (`http://h:p/v1` -> `http://h:p/metrics`)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    return root + "/metrics"


async def kv_pages(http: aiohttp.ClientSession, url: str, admin_key: str | None = None) -> tuple[int, int] | None:
    """(pages used, pages total) from kvseal's gauges, or None where the server has none (or
    refuses /metrics: kvseal with --api-keys wants an admin key there)."""
    headers = {"authorization": f"Bearer {admin_key}"} if admin_key is not None else None
    try:
        async with http.get(url, headers=headers) as response:
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    used, free = _PAGES_USED.search(text), _PAGES_FREE.search(text)
    if not used or not free:
        return None
    num_used = int(float(used.group(1)))
    return num_used, num_used + int(float(free.group(1)))


@dataclass
class ServerSample:
    peak_rss_bytes: int | None = None
    kv_pages_total: int | None = None
    peak_kv_pages_used: int | None = None


class ServerSampler:
    """Samples until `stop()`; `sample` holds the peaks so far."""

    def __init__(self, http: aiohttp.ClientSession, base_url: str, server_pid: int | None, admin_key: str | None = None,
                 interval_s: float = 0.5):
        self.sample = ServerSample()
        self._http, self._url, self._pid, self._interval_s = http, metrics_url(base_url), server_pid, interval_s
        self._admin_key = admin_key
        self._stopped = asyncio.Event()

    async def run(self) -> None:
        while True:
            await self._take()
            try:
                await asyncio.wait_for(self._stopped.wait(), self._interval_s)
                break
            except TimeoutError:
                continue
        await self._take()

    def stop(self) -> None:
        self._stopped.set()

    async def _take(self) -> None:
        s = self.sample
        if self._pid is not None:
            rss = await asyncio.to_thread(tree_rss_bytes, self._pid)
            s.peak_rss_bytes = max(s.peak_rss_bytes or 0, rss)
        pages = await kv_pages(self._http, self._url, self._admin_key)
        if pages is not None:
            s.peak_kv_pages_used = max(s.peak_kv_pages_used or 0, pages[0])
            s.kv_pages_total = pages[1]

