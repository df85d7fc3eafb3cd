"""Speculation-assisted progressive recovery (source document 000, Algorithm 3 and eq. 3).

A restarting node loads its small draft model first and, while the full model
loads behind it, proposes tokens for the most loaded survivor, which verifies
k of them per step.
"""

import math
from collections.abc import Collection, Mapping


def pick_assisted(survivors: Mapping[str, float], exclude: Collection[str] = ()) -> str | None:
    """The survivor a draft-ready node should assist: the highest L̂ (Algorithm 3, line 4).

    `survivors` maps names to L̂; ties go to the smallest name; None when none is left.
    """
    best_name: str | None = None
    best = -math.inf  # read only once best_name is set
    for name, load in survivors.items():
        if name in exclude:
            continue
        if best_name is None or load > best or (load == best and name < best_name):
            best_name, best = name, load
    return best_name


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """E[tokens per step] = (1 − α^(k+1)) / (1 − α) (eq. 3): k drafts accepted left to right
    with probability α each, plus the verifier's own token; k + 1 when every draft is accepted."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"acceptance rate alpha must be between 0 and 1, got {alpha}")
    if k < 0:
        raise ValueError(f"draft length k must be at least 0, got {k}")
    if alpha == 1:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)
