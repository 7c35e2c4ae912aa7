"""Whether the boxes a tensor is stored in overlap: one check for trainstate's own manifests and for the
chunk layouts of other tools' files (DCP's ``.metadata``), both untrusted.

The layouts writers make (FSDP's rows, tensor parallel's columns, both at once) are grids: every box is one
cell of the grid all the boxes' edges cut, so two share an element exactly when they start at the same
corner (n log n). Any other layout is swept along the axis the boxes are split on most, each box compared
only with those still open along that axis, within a budget of comparisons: a staircase of n boxes would
otherwise take n²/8 comparisons (hours for a few hundred thousand), so a layout past the budget is reported
as too irregular to check (no writer makes one).
"""

from __future__ import annotations

from collections.abc import Sequence

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape)

COMPARISONS = 4_000_000  # what the sweep compares of a layout that is no grid (a few seconds)


def overlap(boxes: Sequence[Box], budget: int = COMPARISONS) -> str | None:
    """``"overlap"`` when two non-empty boxes share an element, ``"irregular"`` when the layout is too
    irregular to tell within ``budget`` comparisons, None when the boxes are disjoint.

    Example:
        >>> overlap([((0,), (2,)), ((2,), (2,))]) is None
        True
    """
    live = [b for b in boxes if all(b[1])]  # an empty box shares nothing
    if len(live) < 2:
        return None
    ndim = len(live[0][0])
    following: list[dict[int, int]] = []  # per axis: each cut the boxes' edges make, then the next one
    for d in range(ndim):
        cuts = sorted({at[d] for at, _ in live} | {at[d] + n[d] for at, n in live})
        following.append(dict(zip(cuts, cuts[1:])))
    if all(following[d].get(at[d]) == at[d] + n[d] for at, n in live for d in range(ndim)):
        return "overlap" if len({at for at, _ in live}) < len(live) else None  # one cell each: same corner
    axis = max(range(ndim), key=lambda d: len({at[d] for at, _ in live}))
    live.sort(key=lambda b: b[0][axis])
    active: list[Box] = []
    for at, n in live:
        active = [a for a in active if a[0][axis] + a[1][axis] > at[axis]]
        budget -= len(active) + 1
        if budget < 0:
            return "irregular"
        for a_at, a_n in active:
            if all(b0 < a0 + an and a0 < b0 + bn for a0, an, b0, bn in zip(a_at, a_n, at, n)):
                return "overlap"
        active.append((at, n))
    return None
