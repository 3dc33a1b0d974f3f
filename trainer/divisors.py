"""Divisors of counts up to 2³¹ (layers, heads, chips, batch sizes), from a factorisation, never a scan
up to n: spec validation lists them in its advice and the layout search enumerates them, for any
numbers a spec holds."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1024)
def prime_factors(n: int) -> dict[int, int]:
    """Trial division up to √n: instant for the smooth numbers batch sizes are, ~10⁶ steps at worst."""
    factors: dict[int, int] = {}
    divisor = 2
    while divisor * divisor <= n:
        while n % divisor == 0:
            factors[divisor] = factors.get(divisor, 0) + 1
            n //= divisor
        divisor += 1 if divisor == 2 else 2
    if n > 1:
        factors[n] = factors.get(n, 0) + 1
    return factors


def divisors(n: int, limit: int | None = None) -> list[int]:
    """Sorted divisors of n up to ``limit``."""
    found = [1]
    for prime, power in prime_factors(n).items():
        found = [
            d * prime**k for d in found for k in range(power + 1) if limit is None or d * prime**k <= limit
        ]
    return sorted(found)
