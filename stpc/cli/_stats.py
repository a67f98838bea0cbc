"""The one significance test the benchmarks share: whether interleaved rounds separate two
programs' step times (``bench fidelity`` judges its order by it, ``bench runtime`` its solved
row's note)."""
from __future__ import annotations

import math

SIGN_TEST_P = 0.05  # two programs' measured order counts where the sign test gives p below this


def sign_test_p(wins: int, rounds: int) -> float:
    """Two-sided exact sign test: the chance of a split at least as uneven as ``wins`` of
    ``rounds`` (ties left out) if each plan were as likely to be the faster in a round."""
    if rounds == 0:
        return 1.0
    k = max(wins, rounds - wins)
    tail = sum(math.comb(rounds, i) for i in range(k, rounds + 1)) / 2.0 ** rounds
    return min(1.0, 2.0 * tail)


def paired_rounds(a_steps: list[float], b_steps: list[float]) -> tuple[int, int, float]:
    """Two programs' step times of the same interleaved rounds, compared round by round:
    (rounds ``a`` was faster in, rounds not tied, the sign test's p)."""
    pairs = [(x, y) for x, y in zip(a_steps, b_steps) if x != y]
    wins = sum(x < y for x, y in pairs)
    return wins, len(pairs), sign_test_p(wins, len(pairs))


__all__ = ["SIGN_TEST_P", "sign_test_p", "paired_rounds"]
