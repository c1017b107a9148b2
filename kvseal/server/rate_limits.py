"""Per-tenant requests and tokens per minute, metered as OpenAI meters them: token buckets.

A tenant with `requests_per_minute` R (keys file) has a bucket of R requests that refills
continuously, R per minute; `tokens_per_minute` T likewise holds T tokens (prompt + completion).

- A request takes one request as it arrives, once its key is known and before its body is read
  (`server.pipeline`): with less than one left it is refused, 429 `rate_limit_exceeded`. A
  request later refused for its body or its concurrency keeps it taken, as OpenAI counts them.
- Its prompt tokens are taken once it is tokenized and admitted (I1), right before it reaches the
  engine: with fewer left it is refused with 429 and nothing ran. A prompt larger than T can
  never pass: its 429 says so and has no Retry-After.
- A request the server refuses for its own reasons (5xx: the engine restarting, the audit log
  down, shutdown) gets back what it took: nothing ran.
- Its completion tokens are taken when it ends. The bucket may then go below zero: the tenant
  waits until it has refilled, so over any long period it gets no more than T tokens a minute.

Every answer to an admitted request, and every 429 of these limits, carries OpenAI's headers:
`x-ratelimit-limit-{requests,tokens}`, `x-ratelimit-remaining-{requests,tokens}` (whole units
left, never below 0) and `x-ratelimit-reset-{requests,tokens}` (time until the bucket is full
again, as "1s", "6m0s", "250ms"); a 429 adds `Retry-After` (whole seconds until the request
could pass). A tenant without a limit gets no headers for it.

Buckets are per tenant name and follow key reloads (`follow`, given the new table's tenants): a
changed limit keeps the tenant's usage (its level clipped to the new size), a removed limit
drops the bucket. Each reload also drops the buckets that have refilled to their size (a new one
would start the same), so tenants that have come and gone leave no bucket behind. Only a reload
changes or drops a bucket: a request that still holds its tenant as it was before a reload
(its headers came before it) cannot take away the debt or the new size the reload gave.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from kvseal._testing.faults import Fault, is_active
from kvseal.server import errors
from kvseal.server.auth import Tenant
from kvseal.server.errors import ApiError

Kind = Literal["requests", "tokens"]
_WINDOW_S = 60.0


@dataclass
class Bucket:
    """`capacity` units, refilled at `capacity` per minute; `level` may go below zero (debt)."""

    capacity: int
    level: float
    at_s: float

    def refill(self, now_s: float) -> None:
        self.level = min(float(self.capacity), self.level + (now_s - self.at_s) * self.capacity / _WINDOW_S)
        self.at_s = now_s

    def seconds_until(self, amount: float) -> float:
        """Time until the bucket holds `amount` (0 if it does)."""
        return max(0.0, (amount - self.level) * _WINDOW_S / self.capacity)

    @property
    def remaining(self) -> int:
        return max(0, math.floor(self.level))


class RateLimits:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[tuple[str, Kind], Bucket] = {}

    def take_request(self, tenant: Tenant) -> None:
        """Count one request, or raise `ApiError` 429 with the headers."""
        self._take(tenant, "requests", 1)

    def take_prompt_tokens(self, tenant: Tenant, num_tokens: int) -> None:
        """Count a prompt's tokens, or raise `ApiError` 429 with the headers."""
        self._take(tenant, "tokens", num_tokens)

    def charge_tokens(self, tenant: Tenant, num_tokens: int) -> None:
        """Count tokens already spent (a completion); the bucket may go into debt."""
        bucket = self._bucket(tenant, "tokens")
        if bucket is not None:
            bucket.level -= num_tokens

    def give_back(self, tenant: Tenant, num_requests: int, num_tokens: int) -> None:
        """Return what a request took that never ran (a bucket holds no more than its size)."""
        for kind, amount in (("requests", num_requests), ("tokens", num_tokens)):
            bucket = self._bucket(tenant, kind)  # type: ignore[arg-type]
            if bucket is not None and amount:
                bucket.level = min(float(bucket.capacity), bucket.level + amount)

    def headers(self, tenant: Tenant) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the tenant's limits, as they stand now."""
        out: dict[str, str] = {}
        for kind in ("requests", "tokens"):
            bucket = self._bucket(tenant, kind)  # type: ignore[arg-type]
            if bucket is not None:
                out[f"x-ratelimit-limit-{kind}"] = str(bucket.capacity)
                out[f"x-ratelimit-remaining-{kind}"] = str(bucket.remaining)
                out[f"x-ratelimit-reset-{kind}"] = format_duration(bucket.seconds_until(bucket.capacity))
        return out

    def follow(self, tenants: Iterable[Tenant]) -> None:
        """A reload: each bucket takes its tenant's new limit, keeping its usage (the level refilled
        to now at the old rate, then clipped to the new size); a limit the table no longer sets
        drops its bucket. Then every bucket that is full again is dropped (`prune`)."""
        now_s = self._clock()
        by_name = {t.name: t for t in tenants}
        for (name, kind), bucket in list(self._buckets.items()):
            tenant = by_name.get(name)
            if tenant is None:  # a removed tenant's debt stays until it has refilled
                continue
            capacity = _capacity(tenant, kind)
            if capacity is None:
                del self._buckets[(name, kind)]
            elif capacity != bucket.capacity:
                bucket.refill(now_s)
                bucket.capacity, bucket.level = capacity, min(bucket.level, float(capacity))
        self.prune()

    def prune(self) -> None:
        """Drop every bucket that is full again: the tenant's next request finds it as it was."""
        now_s = self._clock()
        for key, bucket in list(self._buckets.items()):
            bucket.refill(now_s)
            if bucket.level >= bucket.capacity:
                del self._buckets[key]

    def num_buckets(self) -> int:
        return len(self._buckets)

    def _take(self, tenant: Tenant, kind: Kind, amount: int) -> None:
        bucket = self._bucket(tenant, kind)
        if bucket is None:
            return
        if amount > bucket.capacity:
            raise self._refused(tenant, errors.rate_limit_never(tenant.name, kind, bucket.capacity, amount))
        if bucket.level < amount:
            retry_after_s = max(1, math.ceil(bucket.seconds_until(amount)))
            err = errors.rate_limit(tenant.name, kind, bucket.capacity, amount, retry_after_s)
            raise self._refused(tenant, err)
        bucket.level -= amount

    def _refused(self, tenant: Tenant, err: ApiError) -> ApiError:
        err.headers = self.headers(tenant)
        return err

    def _bucket(self, tenant: Tenant, kind: Kind) -> Bucket | None:
        """The tenant's bucket of `kind`, refilled to now; None without that limit. A bucket that
        exists keeps the size the last reload gave it (`follow`), whatever `tenant` says: a
        caller's copy of the tenant may be older than that reload."""
        # test-only: one bucket per kind for every tenant, so one tenant's use spends another's
        key = ("", kind) if is_active(Fault.SHARED_RATE_LIMITS) else (tenant.name, kind)
        capacity = _capacity(tenant, kind)
        if capacity is None:
            return None
        now_s = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = Bucket(capacity, float(capacity), now_s)
        bucket.refill(now_s)
        return bucket


def _capacity(tenant: Tenant, kind: Kind) -> int | None:
    return tenant.requests_per_minute if kind == "requests" else tenant.tokens_per_minute


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: "250ms", "1s", "17.5s", "6m0s"."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60.0)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text
