"""Backoff delays are exact given the rng; retry stops after the last attempt."""

from __future__ import annotations

import random

import pytest

from geoshard.util.retry import Backoff, retry


def test_delays_grow_exponentially_up_to_the_cap_with_jitter() -> None:
    assert list(Backoff(attempts=6, base=1, factor=2, cap=5, jitter=0).delays()) == [1, 2, 4, 5, 5]
    rng_a, rng_b = random.Random(7), random.Random(7)
    jittered = list(Backoff(attempts=4, base=1, jitter=0.5, rng=rng_a).delays())
    draws = [rng_b.uniform(0.5, 1.5) for _ in range(3)]
    assert jittered == [1 * draws[0], 2 * draws[1], 4 * draws[2]]


def test_retry_sleeps_the_backoff_then_gives_up() -> None:
    slept: list[float] = []
    calls = []

    def flaky() -> str:
        calls.append(1)
        raise OSError("down")

    with pytest.raises(OSError, match="down"):
        retry(flaky, Backoff(attempts=3, base=0.1, jitter=0), (OSError,), "probe", sleep=slept.append)
    assert len(calls) == 3 and slept == [0.1, 0.2]


def test_retry_returns_first_success_and_does_not_catch_other_errors() -> None:
    results = iter([OSError("x"), "ok"])

    def once() -> str:
        r = next(results)
        if isinstance(r, Exception):
            raise r
        return r

    slept: list[float] = []
    assert retry(once, Backoff(attempts=5, base=1, jitter=0), (OSError,), "x", sleep=slept.append) == "ok"
    assert slept == [1]
    with pytest.raises(KeyError):
        retry(lambda: {}["k"], Backoff(), (OSError,), "x", sleep=slept.append)


def test_invalid_backoff() -> None:
    with pytest.raises(ValueError, match="attempts >= 1"):
        Backoff(attempts=0)
