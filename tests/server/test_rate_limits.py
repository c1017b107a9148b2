"""Requests and tokens per minute per tenant: the buckets' arithmetic on a clock the test moves."""

from __future__ import annotations

import pytest

from kvseal._testing.faults import Fault, inject
from kvseal.server.auth import Tenant
from kvseal.server.errors import ApiError
from kvseal.server.rate_limits import RateLimits, format_duration


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


ALICE = Tenant("alice", requests_per_minute=3, tokens_per_minute=120)
BOB = Tenant("bob", requests_per_minute=3, tokens_per_minute=120)


def refused(take: object, *args: object) -> ApiError:
    with pytest.raises(ApiError) as info:
        take(*args)  # type: ignore[operator]
    assert info.value.status == 429 and info.value.code == "rate_limit_exceeded"
    return info.value


def test_requests_per_minute_count_down_refuse_and_refill() -> None:
    clock = Clock()
    rates = RateLimits(clock)
    for remaining in (2, 1, 0):
        rates.take_request(ALICE)
        headers = rates.headers(ALICE)
        assert headers["x-ratelimit-remaining-requests"] == str(remaining)
        assert headers["x-ratelimit-limit-requests"] == "3"
    assert rates.headers(ALICE)["x-ratelimit-reset-requests"] == "1m0s"  # three used, 20 s each
    err = refused(rates.take_request, ALICE)
    assert err.retry_after_s == 20 and err.detail == "requests_per_minute_exceeded"
    assert err.headers is not None and err.headers["x-ratelimit-remaining-requests"] == "0"
    clock.now_s += 19.5
    assert refused(rates.take_request, ALICE).retry_after_s == 1
    clock.now_s += 0.5
    rates.take_request(ALICE)  # one has refilled
    clock.now_s += 600
    assert rates.headers(ALICE)["x-ratelimit-remaining-requests"] == "3"  # never more than the limit
    assert rates.headers(ALICE)["x-ratelimit-reset-requests"] == "0ms"


def test_tokens_count_the_prompt_first_and_the_completion_at_the_end() -> None:
    clock = Clock()
    rates = RateLimits(clock)
    rates.take_prompt_tokens(ALICE, 100)
    assert rates.headers(ALICE)["x-ratelimit-remaining-tokens"] == "20"
    rates.charge_tokens(ALICE, 50)  # the completion: the bucket goes into debt (-30)
    assert rates.headers(ALICE)["x-ratelimit-remaining-tokens"] == "0"
    err = refused(rates.take_prompt_tokens, ALICE, 10)
    assert err.retry_after_s == 20  # 40 tokens at 2 per second
    clock.now_s += 20
    rates.take_prompt_tokens(ALICE, 10)
    assert rates.headers(ALICE)["x-ratelimit-reset-tokens"] == "1m0s"


def test_a_prompt_larger_than_the_limit_is_refused_without_retry_after() -> None:
    rates = RateLimits(Clock())
    err = refused(rates.take_prompt_tokens, ALICE, 121)
    assert err.retry_after_s is None and "Request too large" in err.message
    assert rates.headers(ALICE)["x-ratelimit-remaining-tokens"] == "120"  # nothing was taken


def test_tenants_have_their_own_buckets() -> None:
    rates = RateLimits(Clock())
    for _ in range(3):
        rates.take_request(ALICE)
    refused(rates.take_request, ALICE)
    rates.take_request(BOB)


def test_the_per_tenant_test_fails_when_tenants_share_one_bucket() -> None:
    with inject(Fault.SHARED_RATE_LIMITS), pytest.raises(ApiError):
        test_tenants_have_their_own_buckets()


def test_a_reloaded_limit_keeps_the_usage_and_a_removed_one_drops_the_bucket() -> None:
    clock = Clock()
    rates = RateLimits(clock)
    rates.take_request(ALICE)
    rates.take_request(ALICE)
    bigger = Tenant("alice", requests_per_minute=10)
    rates.follow([bigger, BOB])
    assert rates.headers(bigger)["x-ratelimit-remaining-requests"] == "1"  # refills at the new rate from here
    clock.now_s += 6
    assert rates.headers(bigger)["x-ratelimit-remaining-requests"] == "2"
    smaller = Tenant("alice", requests_per_minute=1)
    rates.follow([smaller])
    assert rates.headers(smaller)["x-ratelimit-remaining-requests"] == "1"
    unlimited = Tenant("alice")
    rates.follow([unlimited])
    assert rates.headers(unlimited) == {}
    for _ in range(10):
        rates.take_request(unlimited)


def test_a_tenant_as_it_was_before_a_reload_neither_drops_nor_resizes_its_bucket() -> None:
    """A request holds its tenant as it authenticated; after a reload that set a limit (and the
    tenant's use went into debt), that old copy must not wipe the debt or apply the old size."""
    clock = Clock()
    rates = RateLimits(clock)
    before = Tenant("carol")
    after = Tenant("carol", tokens_per_minute=200)
    rates.follow([after])
    rates.charge_tokens(after, 400)  # 200 tokens in debt
    assert rates.headers(before) == {}  # the old copy has no limit: it sees none ...
    rates.give_back(before, 1, 10)
    rates.charge_tokens(before, 5)
    assert rates.headers(after)["x-ratelimit-remaining-tokens"] == "0"  # ... and the debt stays
    refused(rates.take_prompt_tokens, after, 1)
    larger = Tenant("carol", tokens_per_minute=10**6)
    assert rates.headers(larger)["x-ratelimit-limit-tokens"] == "200"  # nor does an old, larger limit apply
    clock.now_s += 59
    assert rates.headers(after)["x-ratelimit-remaining-tokens"] == "0"  # 200 of the 400 refilled by now: none left


@pytest.mark.parametrize(("seconds", "text"), [(0.0, "0ms"), (0.25, "250ms"), (1.0, "1s"), (17.5, "17.5s"),
                                               (60.0, "1m0s"), (360.0, "6m0s"), (90.125, "1m30.125s")])
def test_reset_durations_are_in_openais_format(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_pruning_drops_only_the_buckets_that_are_full_again() -> None:
    clock = Clock()
    rates = RateLimits(clock)
    for i in range(50):  # tenants that came and went with key reloads
        rates.take_request(Tenant(f"gone-{i}", requests_per_minute=3))
    rates.take_prompt_tokens(ALICE, 100)
    rates.charge_tokens(ALICE, 100)  # 80 tokens in debt: 100 s to refill
    clock.now_s += 60
    rates.prune()
    assert rates.num_buckets() == 1  # alice's tokens, still refilling
    assert rates.headers(ALICE)["x-ratelimit-remaining-tokens"] == "40"  # her debt survived the pruning
    clock.now_s += 40
    rates.prune()
    assert rates.num_buckets() == 0
    for remaining in (2, 1, 0):  # a pruned tenant starts with a full bucket, as it had
        rates.take_request(ALICE)
        assert rates.headers(ALICE)["x-ratelimit-remaining-requests"] == str(remaining)
