"""The global save plan (no processes): who writes which box, and what the ranks must agree on."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainstate._distributed.plan import assign, rank_plan
from trainstate.errors import UnsupportedValueError

Box = tuple[tuple[int, ...], tuple[int, ...]]


def plans_of(held: list[dict[str, tuple[tuple[int, ...], Box]]], dtype: str = "F32") -> list:
    """One plan per rank from ``{name: (global shape, (offset, shape))}``."""
    out = []
    for mine in held:
        items = []
        for name, (whole, (offset, shape)) in mine.items():
            items.append((name, (dtype, "torch", whole), offset, shape, int(np.prod(shape, dtype=np.int64)) * 4))
        out.append(rank_plan(items))
    return out


def writers(held: list[dict[str, tuple[tuple[int, ...], Box]]]) -> dict[tuple[str, Box], list[int]]:
    """Which ranks write each (tensor, box), from assign()'s answer."""
    shares = assign(plans_of(held)).shares
    out: dict[tuple[str, Box], list[int]] = {}
    for rank, (mine, share) in enumerate(zip(held, shares)):
        names = list(mine)
        for i in share:
            out.setdefault((names[i], mine[names[i]][1]), []).append(rank)
    return out


def test_fsdp_row_shards_are_each_written_by_their_rank():
    held = [{"w": ((8, 3), ((2 * r, 0), (2, 3))), "b": ((4,), ((r,), (1,)))} for r in range(4)]
    got = writers(held)
    assert got == {(n, held[r][n][1]): [r] for r in range(4) for n in ("w", "b")}


def test_uneven_shards_with_an_empty_one_on_the_last_rank_are_accepted():
    held = [{"w": ((5, 2), ((0, 0), (3, 2)))}, {"w": ((5, 2), ((3, 0), (2, 2)))}, {"w": ((5, 2), ((5, 0), (0, 2)))}]
    got = writers(held)
    assert got[("w", ((0, 0), (3, 2)))] == [0] and got[("w", ((3, 0), (2, 2)))] == [1]


def test_replicated_tensors_are_written_once_and_spread_over_the_ranks():
    held = [{f"t{i}": ((16, 16), ((0, 0), (16, 16))) for i in range(8)} for _ in range(4)]
    got = writers(held)
    assert all(len(w) == 1 for w in got.values()) and len(got) == 8
    assert sorted(w[0] for w in got.values()) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_a_2d_grid_tiles_and_each_box_of_a_replicated_mesh_dimension_is_written_once():
    # 2 x 2 grid of a (4, 6) tensor; each box held by two ranks (a replicated dimension of a 3-D mesh)
    boxes = [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 3), (2, 3))]
    held = [{"w": ((4, 6), boxes[r % 4])} for r in range(8)]
    got = writers(held)
    assert sorted(got) == sorted(("w", b) for b in boxes) and all(len(w) == 1 for w in got.values())


def test_per_rank_tensors_of_each_rank_are_written_by_it():
    held = [{"w": ((2, 2), ((0, 0), (2, 2))), f"rng.{r}.state": ((5,), ((0,), (5,)))} for r in range(3)]
    got = writers(held)
    assert all(got[(f"rng.{r}.state", ((0,), (5,)))] == [r] for r in range(3))


def test_ranks_whose_tensors_have_different_ranks_of_dimension():
    held = [{"a": ((4,), ((0,), (2,)))}, {"a": ((4,), ((2,), (2,))), "m": ((2, 3), ((0, 0), (2, 3)))}]
    assert writers(held) == {("a", ((0,), (2,))): [0], ("a", ((2,), (2,))): [1], ("m", ((0, 0), (2, 3))): [1]}


def test_scalars_and_a_rank_that_holds_nothing():
    held = [{"s": ((), ((), ()))}, {}]
    assert writers(held) == {("s", ((), ())): [0]}


@pytest.mark.parametrize(
    "held, message",
    [
        ([{"w": ((4, 2), ((0, 0), (2, 2)))}, {"w": ((4, 2), ((0, 0), (2, 2)))}], "do not tile"),  # rows 2-3 missing
        ([{"w": ((4, 2), ((0, 0), (3, 2)))}, {"w": ((4, 2), ((2, 0), (2, 2)))}], "do not tile"),  # rows overlap
        ([{"w": ((4, 2), ((0, 0), (2, 2)))}, {"w": ((4, 2), ((2, 0), (3, 2)))}], "outside its global shape"),
        ([{"w": ((4, 2), ((0, 0), (2, 2)))}, {"w": ((4, 2), ((0, 0), (4, 2)))}], "hold different boxes"),
        ([{"w": ((4, 2), ((0, 0), (4, 2)))}, {"w": ((4, 3), ((0, 0), (4, 3)))}], "differs between ranks"),
    ],
)
def test_parts_that_do_not_tile_or_disagree_are_refused(held, message):
    with pytest.raises(UnsupportedValueError, match=message):
        assign(plans_of(held))


def test_the_ranks_must_agree_on_the_dtype():
    plans = plans_of([{"w": ((2,), ((0,), (2,)))}]) + plans_of([{"w": ((2,), ((0,), (2,)))}], dtype="BF16")
    with pytest.raises(UnsupportedValueError, match="rank 0 has F32.*rank 1 has BF16"):
        assign(plans)


def test_a_grid_with_one_overlapping_corner_is_refused():
    boxes = [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((1, 2), (2, 2))]  # the last one overlaps two
    with pytest.raises(UnsupportedValueError, match="do not tile"):
        assign(plans_of([{"w": ((4, 6), b)} for b in boxes]))


def _split(rng: np.random.Generator, offset: tuple[int, ...], shape: tuple[int, ...], depth: int) -> list[Box]:
    """A random tiling of the box by recursive cuts."""
    axes = [a for a, n in enumerate(shape) if n > 1]
    if not axes or depth == 0 or rng.random() < 0.3:
        return [(offset, shape)]
    a = int(rng.choice(axes))
    cut = int(rng.integers(1, shape[a]))
    left = shape[:a] + (cut,) + shape[a + 1 :]
    right = shape[:a] + (shape[a] - cut,) + shape[a + 1 :]
    moved = offset[:a] + (offset[a] + cut,) + offset[a + 1 :]
    return _split(rng, offset, left, depth - 1) + _split(rng, moved, right, depth - 1)


def _tiles(whole: tuple[int, ...], boxes: list[Box]) -> bool:
    """The dense reference: every element covered exactly once, nothing outside."""
    count = np.zeros(whole, dtype=np.int64)
    for offset, shape in boxes:
        if any(o < 0 or o + s > n for o, s, n in zip(offset, shape, whole)):
            return False
        count[tuple(slice(o, o + s) for o, s in zip(offset, shape))] += 1
    return bool((count == 1).all())


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_random_tilings_and_their_damaged_versions_are_judged_like_a_dense_count(seed):
    rng = np.random.default_rng(seed)
    whole = tuple(int(n) for n in rng.integers(1, 7, size=int(rng.integers(1, 4))))
    boxes = _split(rng, (0,) * len(whole), whole, 4)
    damage = rng.integers(0, 4)
    if damage == 1 and len(boxes) > 1:  # a gap
        boxes.pop(int(rng.integers(len(boxes))))
    elif damage == 2:  # one box moved by one along some axis
        i, a = int(rng.integers(len(boxes))), int(rng.integers(len(whole)))
        offset, shape = boxes[i]
        boxes[i] = (offset[:a] + (offset[a] + int(rng.choice([-1, 1])),) + offset[a + 1 :], shape)
    elif damage == 3:  # one box grown by one along some axis
        i, a = int(rng.integers(len(boxes))), int(rng.integers(len(whole)))
        offset, shape = boxes[i]
        boxes[i] = (offset, shape[:a] + (shape[a] + 1,) + shape[a + 1 :])
    offsets = [b[0] for b in boxes]
    if len(set(offsets)) != len(offsets):  # two boxes at one offset: refused for another reason
        return
    held = [{"w": (whole, b)} for b in boxes]
    held += [{"w": (whole, boxes[int(rng.integers(len(boxes)))])} for _ in range(int(rng.integers(0, 3)))]
    if _tiles(whole, boxes):
        got = writers(held)
        assert sorted(b for _, b in got) == sorted(boxes) and all(len(w) == 1 for w in got.values())
    else:
        with pytest.raises(UnsupportedValueError):
            assign(plans_of(held))
