"""Confidence intervals for the accuracies the answer benchmarks report.

Wilson's score interval for a binomial proportion (E. B. Wilson, "Probable inference, the law of
succession, and statistical inference", JASA 22 (1927) 209-212; the form in Agresti & Coull, The
American Statistician 52 (1998) 119-126, eq. 2): for k successes in n trials and z the normal quantile,

    centre = (p + z^2 / 2n) / (1 + z^2 / n),   half = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / 4n^2)

with p = k / n. Unlike the normal approximation it stays inside [0, 1] and is sensible at p = 0 or 1 and
for the few dozen questions a benchmark cell holds.
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054  # two-sided 95 %


def wilson(successes: int, trials: int, z: float = Z95) -> tuple[float, float]:
    """(low, high) of the Wilson score interval; (0, 1) for no trials."""
    if trials < 0 or not 0 <= successes <= trials:
        raise ValueError(f"wilson: need 0 <= successes <= trials, got {successes} of {trials}")
    if trials == 0:
        return 0.0, 1.0
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z / denominator * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    return max(0.0, centre - half), min(1.0, centre + half)


def proportion(successes: int, trials: int) -> dict:
    """{"n", "correct", "accuracy", "ci95": [low, high]} rounded for JSON."""
    low, high = wilson(successes, trials)
    return {"n": trials, "correct": successes, "accuracy": round(successes / trials, 4) if trials else None,
            "ci95": [round(low, 4), round(high, 4)]}


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p for b and c discordant pairs (1.0 when there are none): under "no difference"
    the b + c discordant pairs split as Binomial(b + c, 1/2), and p is twice the tail at min(b, c) (Agresti,
    Categorical Data Analysis, 3rd ed., section 11.1.2)."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n
    return min(1.0, 2.0 * tail)
