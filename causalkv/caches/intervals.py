"""Token-position sets as sorted, disjoint, half-open ``(start, end)`` runs (plain ints).

Every cache in causalkv decides *which* global positions it retains and shows with this
arithmetic, on Python ints only, so the hot path never touches the device to decide.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

Interval = tuple[int, int]
Intervals = tuple[Interval, ...]

EMPTY: Intervals = ()


def normalize(runs: Iterable[Interval]) -> Intervals:
    """Sort, drop empty runs and merge touching/overlapping ones."""
    out: list[list[int]] = []
    for a, b in sorted(r for r in runs if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def count(runs: Intervals) -> int:
    return sum(b - a for a, b in runs)


def union(*sets: Intervals) -> Intervals:
    return normalize(r for s in sets for r in s)


def intersect(x: Intervals, y: Intervals) -> Intervals:
    out: list[Interval] = []
    i = j = 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def subtract(x: Intervals, y: Intervals) -> Intervals:
    """``x`` without ``y``: ``x`` intersected with the gaps of ``y`` (both sorted runs)."""
    if not x:
        return EMPTY
    edges = [x[0][0], *(p for run in y for p in run), x[-1][1]]
    return intersect(x, normalize(zip(edges[::2], edges[1::2])))


def newest(x: Intervals, k: int) -> Intervals:
    """The ``k`` largest positions of ``x``."""
    if k <= 0:
        return EMPTY
    out: list[Interval] = []
    for a, b in reversed(x):
        take = min(k, b - a)
        out.append((b - take, b))
        k -= take
        if k == 0:
            break
    return tuple(reversed(out))


def contains(x: Intervals, y: Intervals) -> bool:
    return count(intersect(x, y)) == count(y)


def rank(x: Intervals, p: int) -> int:
    """How many positions of ``x`` are smaller than ``p`` (the compact slot of ``p``)."""
    return sum(min(p, b) - a for a, b in x if a < p)


def to_slots(x: Intervals, sub: Intervals) -> Intervals:
    """Map ``sub`` (a subset of ``x``) to compact slot runs of ``x``, merged when adjacent."""
    return normalize((rank(x, a), rank(x, a) + (b - a)) for a, b in sub)


def to_positions(x: Intervals, device: torch.device | str | None = None) -> torch.Tensor:
    """int64 ``[count(x)]`` tensor of the positions in ``x``."""
    import torch  # positions as a tensor; the arithmetic above is plain ints

    if not x:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.cat([torch.arange(a, b, dtype=torch.int64, device=device) for a, b in x])


def describe(x: Intervals) -> str:
    return " ".join(f"[{a},{b})" for a, b in x) or "(empty)"
