"""Egress cost: bytes per ordered region pair times the price of data leaving ``from`` for ``to``.

The default table (``DEFAULT_PRICES``) is AWS's inter-region data transfer price, charged to the
sending region, per GB (10^9 bytes here; AWS bills per GB of 2^30, a 7% difference stated in
docs/simulate.md). A plan's ``[egress] prices`` or ``--prices FILE`` overrides it per pair.
"""

from __future__ import annotations

from collections.abc import Iterable

# USD per GB out of the region to another AWS region (docs/simulate.md: source and date).
DEFAULT_OUT_PRICES: dict[str, float] = {
    "us-east-1": 0.02,
    "us-east-2": 0.02,
    "us-west-1": 0.02,
    "us-west-2": 0.02,
    "ca-central-1": 0.02,
    "eu-west-1": 0.02,
    "eu-west-2": 0.02,
    "eu-west-3": 0.02,
    "eu-central-1": 0.02,
    "eu-north-1": 0.02,
    "ap-southeast-1": 0.09,
    "ap-southeast-2": 0.098,
    "ap-northeast-1": 0.09,
    "ap-northeast-2": 0.08,
    "ap-south-1": 0.086,
    "sa-east-1": 0.138,
}
# Pairs priced apart from their source's rate (the one found: N. Virginia <-> Ohio).
DEFAULT_PAIR_PRICES: dict[tuple[str, str], float] = {("us-east-1", "us-east-2"): 0.01, ("us-east-2", "us-east-1"): 0.01}
FALLBACK_PRICE = 0.09  # a region the table does not know: the common price out of the other AWS regions


def price(src: str, dst: str, prices: Iterable[tuple[str, str, float]]) -> tuple[float, str]:
    """USD per GB from ``src`` to ``dst`` and where the figure comes from (plan, default, fallback)."""
    for a, b, usd in prices:
        if (a, b) == (src, dst) or (a == src and b == "*"):
            return usd, "given"
    if (src, dst) in DEFAULT_PAIR_PRICES:
        return DEFAULT_PAIR_PRICES[(src, dst)], "default"
    if src in DEFAULT_OUT_PRICES:
        return DEFAULT_OUT_PRICES[src], "default"
    return FALLBACK_PRICE, "fallback"


def egress_usd(pair_bytes: dict[tuple[str, str], float], prices: Iterable[tuple[str, str, float]]) -> dict[tuple[str, str], float]:
    table = tuple(prices)
    return {pair: n / 1e9 * price(*pair, table)[0] for pair, n in pair_bytes.items()}
