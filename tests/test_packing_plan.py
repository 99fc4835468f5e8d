"""Batch plans of packed rows: every example once, every shard's part packs with first_fit,
cells priced exactly, shards aligned; and first_fit and balanced_fit themselves."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import buckets
from buckets import BucketOverflowError, balanced_fit, first_fit, packed_batch_plan, packed_cells


def all_shards(lengths, row_lengths, num_shards, **kw):
    return [packed_batch_plan(lengths, row_lengths, num_shards=num_shards, shard_index=i, **kw)
            for i in range(num_shards)]


def packed_lengths(lengths, row_lengths, overflow):
    """The length each example packs at: its own, or the largest row length if truncated."""
    arr = np.asarray(lengths, dtype=np.int64)
    largest = max(row_lengths)
    return np.minimum(arr, largest) if overflow == "truncate" else arr


def own_row_length(n, row_lengths):
    return min(L for L in row_lengths if L >= n)


def own_examples(batch, eff, row_lengths):
    """The step's examples at their own row length (those after them fill its free cells)."""
    return np.asarray([i for i in batch.indices
                       if own_row_length(eff[i], row_lengths) == batch.row_length], np.int64)


def expected_rows(L, budget):
    return budget["rows"] if "rows" in budget else max(1, budget["max_tokens"] // L)


@st.composite
def setups(draw, max_len=40):
    """Random lengths (zeros included), row lengths, a rows-or-budget, an overflow mode."""
    lengths = draw(st.lists(st.integers(0, max_len), min_size=1, max_size=60))
    overflow = draw(st.sampled_from(["error", "truncate"]))
    top = max(max(lengths), 1)
    if overflow == "truncate":                 # the largest row length may be below some
        top = draw(st.integers(1, top))
    row_lengths = sorted(set(draw(st.lists(st.integers(1, top), max_size=3)) + [top]))
    if draw(st.booleans()):
        budget = dict(rows=draw(st.integers(1, 4)))
    else:                                      # below a row length too: one row each then
        budget = dict(max_tokens=draw(st.integers(1, 150)))
    return lengths, row_lengths, budget, overflow


# -- 1, 2: every example once; shards aligned; every part packs ------------------------------------


@given(setups(), st.integers(1, 4), st.booleans(), st.integers(0, 2**32 - 1), st.integers(0, 3))
def test_every_example_once_and_every_part_packs(setup, num_shards, shuffle, seed, epoch):
    lengths, row_lengths, budget, overflow = setup
    shards = all_shards(lengths, row_lengths, num_shards, shuffle=shuffle, seed=seed,
                        epoch=epoch, overflow=overflow, **budget)
    eff = packed_lengths(lengths, row_lengths, overflow)
    # Same number of steps on every shard, and the same compiled shape at every step.
    assert len({len(p) for p in shards}) == 1
    for step in zip(*shards):
        assert len({(b.row_length, b.rows) for b in step}) == 1
    # Disjoint parts whose union is every example, once.
    seen = np.concatenate([b.indices for p in shards for b in p])
    assert seen.dtype == np.int64
    assert np.sort(seen).tolist() == list(range(len(lengths)))
    for plan in shards:
        for b in plan:
            assert type(b.row_length) is int and type(b.rows) is int
            assert b.rows == expected_rows(b.row_length, budget)
            assert np.all(eff[b.indices] <= b.row_length)
            # The step at its longest example's own row length (the smallest that holds it,
            # what the executor picks); shorter examples fill the cells that leaves free.
            if b.indices.size:
                assert own_row_length(eff[b.indices].max(), row_lengths) == b.row_length
            if b.indices.size:
                assert first_fit(eff[b.indices], b.row_length).rows <= b.rows


@given(setups(), st.integers(1, 3), st.data())
def test_excluded_examples_are_left_out_and_every_other_one_planned_once(setup, num_shards,
                                                                        data):
    lengths, row_lengths, budget, overflow = setup
    done = data.draw(st.lists(st.integers(0, len(lengths) - 1), unique=True), label="exclude")
    shards = all_shards(lengths, row_lengths, num_shards, overflow=overflow, exclude=done,
                        **budget)
    seen = np.concatenate([b.indices for p in shards for b in p] + [np.zeros(0, np.int64)])
    assert np.sort(seen).tolist() == sorted(set(range(len(lengths))) - set(done))
    eff = packed_lengths(lengths, row_lengths, overflow)
    for plan in shards:
        for b in plan:
            if b.indices.size:
                assert first_fit(eff[b.indices], b.row_length).rows <= b.rows


@pytest.mark.parametrize("exclude", [[3], [-1], [0.5], [[0]]])
def test_exclude_must_be_example_indices(exclude):
    with pytest.raises(ValueError, match=r"packed_batch_plan: exclude: expected example "
                                         r"indices in \[0, 3\)"):
        packed_batch_plan([3, 5, 9], [4, 16], rows=1, exclude=exclude)


@given(setups(), st.integers(1, 4), st.booleans(), st.integers(0, 100))
def test_a_part_is_empty_only_where_documented(setup, num_shards, shuffle, seed):
    lengths, row_lengths, budget, overflow = setup
    shards = all_shards(lengths, row_lengths, num_shards, shuffle=shuffle, seed=seed,
                        overflow=overflow, **budget)
    steps = list(zip(*shards))
    eff = packed_lengths(lengths, row_lengths, overflow)

    def own(step):
        return sum(own_examples(b, eff, row_lengths).size for b in step)
    by_length = {}
    for step in steps:
        by_length.setdefault(step[0].row_length, []).append(own(step))
    for step in steps:
        n = own(step)
        if any(b.indices.size == 0 for b in step):
            # Only with fewer examples than shards, one such step per row length ...
            assert n < num_shards
            sizes = by_length[step[0].row_length]
            assert sum(s < num_shards for s in sizes) == 1
            if not shuffle and len(sizes) > 1:
                # ... its last, after a step that together with it holds fewer than 2S.
                assert sizes[-1] == n and sizes[-2] + n < 2 * num_shards
        else:
            assert n >= num_shards


@given(setups(), st.integers(1, 4))
def test_parts_are_contiguous_runs_split_by_count_or_into_nonempty_parts(setup, num_shards):
    lengths, row_lengths, budget, overflow = setup
    shards = all_shards(lengths, row_lengths, num_shards, shuffle=False, overflow=overflow,
                        **budget)
    eff = packed_lengths(lengths, row_lengths, overflow)
    order = [int(i) for step in zip(*shards) for b in step
             for i in own_examples(b, eff, row_lengths)]
    # Unshuffled: steps by row length, each a run of that row length's examples in index
    # order, shard 0's part first (then each part's fillers).
    key = [(own_row_length(int(eff[i]), row_lengths), i) for i in order]
    assert key == sorted(key)
    for step in zip(*shards):
        sizes = [own_examples(b, eff, row_lengths).size for b in step]
        n = sum(sizes)
        by_count = [a.size for a in np.array_split(np.arange(n), num_shards)]
        assert sizes == by_count or min(sizes) >= 1


@given(st.lists(st.integers(0, 30), min_size=1, max_size=60), st.integers(1, 30),
       st.integers(1, 4))
def test_one_shard_steps_are_greedy_one_more_would_not_pack(lengths, top, rows):
    lengths = [min(n, top) for n in lengths]
    row_lengths = sorted({top, max(1, top // 2)})
    plan = packed_batch_plan(lengths, row_lengths, rows=rows, shuffle=False)
    arr = np.asarray(lengths)
    for b, nxt in zip(plan, plan[1:]):
        if nxt.row_length != b.row_length:
            continue                           # a row length's last step may be partial
        more = np.append(b.indices, nxt.indices[0])
        assert first_fit(arr[more], b.row_length).rows > rows


def test_shorter_examples_fill_the_cells_a_longer_step_leaves_free():
    # Rows of 16 hold the 10 and two of the 3s; only the last 3 needs a row of 4.
    plan = packed_batch_plan([10, 3, 3, 3], [4, 16], rows=1, shuffle=False)
    assert [(b.row_length, b.indices.tolist()) for b in plan] == [(4, [3]), (16, [0, 1, 2])]
    # An empty row of a longer row length's last step takes them too.
    plan = packed_batch_plan([10, 3, 3, 3], [4, 16], rows=2, shuffle=False)
    assert [(b.row_length, b.indices.tolist()) for b in plan] == [(16, [0, 1, 2, 3])]


# -- 3: cells --------------------------------------------------------------------------------------


@given(setups(), st.integers(1, 4), st.integers(0, 100))
def test_cells_are_rows_times_row_length_and_match_repacking(setup, num_shards, seed):
    lengths, row_lengths, budget, overflow = setup
    shards = all_shards(lengths, row_lengths, num_shards, seed=seed, overflow=overflow, **budget)
    eff = packed_lengths(lengths, row_lengths, overflow)
    by_shapes = sum(b.rows * b.row_length for p in shards for b in p)
    # Re-pack every part with first_fit and pad it to the step's rows.
    repacked = 0
    for p in shards:
        for b in p:
            used = first_fit(eff[b.indices], b.row_length).rows if b.indices.size else 0
            padding = b.rows - used
            assert padding >= 0
            repacked += (used + padding) * b.row_length
            assert b.cells == b.rows * b.row_length
    for p in shards:                           # any shard's plan prices the whole run
        assert packed_cells(p, num_shards=num_shards) == by_shapes == repacked
    # A cost model prices the plan from its cells: every step x every shard.
    cost = buckets.CostModel(compile_seconds=0.0, seconds_per_cell=1e-3)
    steps = list(zip(*shards))
    seconds = sum(cost.step_seconds(num_shards * s[0].rows, s[0].row_length) for s in steps)
    assert seconds == pytest.approx(1e-3 * packed_cells(shards[0], num_shards=num_shards))
    assert sum(int(np.sum(eff[b.indices])) for p in shards for b in p) <= by_shapes


# -- 4: determinism --------------------------------------------------------------------------------


@given(setups(), st.integers(1, 3), st.integers(0, 2**32 - 1), st.integers(0, 5))
def test_same_arguments_same_plan(setup, num_shards, seed, epoch):
    lengths, row_lengths, budget, overflow = setup
    kw = dict(seed=seed, epoch=epoch, overflow=overflow, **budget)
    a = all_shards(lengths, row_lengths, num_shards, **kw)
    b = all_shards(np.asarray(lengths), buckets.Fixed(row_lengths), num_shards, **kw)
    assert [[(x.row_length, x.indices.tolist(), x.rows) for x in p] for p in a] == \
           [[(x.row_length, x.indices.tolist(), x.rows) for x in p] for p in b]


def test_a_plan_handed_out_is_the_callers_own():
    # Plans are kept for the next call with the same arguments: changing one handed out
    # must not change the next.
    lengths = np.random.default_rng(5).integers(1, 64, size=200)
    first = packed_batch_plan(lengths, [16, 64], rows=4, seed=1)
    expected = [b.indices.tolist() for b in first]
    for b in first:
        b.indices[:] = 0
    assert [b.indices.tolist() for b in packed_batch_plan(lengths, [16, 64], rows=4, seed=1)] \
        == expected
    lengths[0] = 64 if lengths[0] <= 16 else 1     # to the other row length: another plan
    assert [b.indices.tolist() for b in packed_batch_plan(lengths, [16, 64], rows=4, seed=1)] \
        != expected


def test_epochs_reorder_when_shuffling_and_not_otherwise():
    lengths = np.random.default_rng(0).integers(1, 64, 300)

    def flat(**kw):
        return [i for s in range(2) for b in packed_batch_plan(
            lengths, [16, 32, 64], rows=4, num_shards=2, shard_index=s, **kw)
            for i in b.indices.tolist()]

    assert flat(epoch=0) == flat(epoch=0)
    assert flat(epoch=0) != flat(epoch=1)
    assert flat(seed=1) != flat(seed=2)
    assert sorted(flat(epoch=0)) == sorted(flat(epoch=1)) == list(range(300))
    assert flat(shuffle=False, epoch=0, seed=0) == flat(shuffle=False, epoch=3, seed=9)
    # The number of steps of each shape may change with the order; each row length keeps
    # its rows (the shortest may run no step: longer rows' free cells took its examples).
    shapes = {(b.rows, b.row_length) for e in range(3)
              for b in packed_batch_plan(lengths, [16, 32, 64], rows=4, epoch=e)}
    assert {(4, 32), (4, 64)} <= shapes <= {(4, 16), (4, 32), (4, 64)}


# -- 5: token budget -------------------------------------------------------------------------------


@given(setups(), st.integers(1, 3), st.integers(1, 200))
def test_max_tokens_bounds_every_step(setup, num_shards, max_tokens):
    lengths, row_lengths, _, overflow = setup
    for plan in all_shards(lengths, row_lengths, num_shards, max_tokens=max_tokens,
                           overflow=overflow):
        for b in plan:
            if max_tokens >= b.row_length:
                assert b.cells <= max_tokens
                assert b.cells + b.row_length > max_tokens   # and as many rows as fit
            else:
                assert b.rows == 1                           # a single row over the budget


# -- documented small cases -------------------------------------------------------------------------


def steps_of(lengths, row_lengths, num_shards, **kw):
    shards = all_shards(lengths, row_lengths, num_shards, shuffle=False, **kw)
    return [[b.indices.tolist() for b in step] for step in zip(*shards)]


def test_the_last_step_keeps_an_example_per_shard_when_it_can():
    # Five 5s in rows of 10, one row per shard: greedy would take 4 (2 + 2) and leave one, an
    # empty part; the plan leaves two instead.
    assert steps_of([5] * 5, [10], 2, rows=1) == [[[0, 1], [2]], [[3], [4]]]
    # Three 6s: no two fit one row, so three cannot make two steps of two: an empty part.
    assert steps_of([6] * 3, [10], 2, rows=1) == [[[0], [1]], [[2], []]]
    # Fewer examples than shards.
    assert steps_of([3], [10], 3, rows=1) == [[[0], [], []]]


def test_a_run_the_count_split_cannot_pack_is_split_by_tokens():
    # Count split [1,1,1,1] | [1,1,8,1] needs 11 cells in a row of 10; by tokens the 8 and
    # the 1 after it get a part of their own (6 | 9 tokens), and the whole run is one step.
    assert steps_of([1] * 6 + [8, 1], [10], 2, rows=1) == [[[0, 1, 2, 3, 4, 5], [6, 7]]]


def test_rows_and_budget_per_row_length():
    lengths = [3, 3, 3, 3, 12, 12, 30]
    plan = packed_batch_plan(lengths, [4, 16, 32], max_tokens=32, shuffle=False)
    assert [(b.row_length, b.rows, b.indices.tolist()) for b in plan] == [
        (4, 8, [2, 3]), (16, 2, [4, 5, 0, 1]), (32, 1, [6])]
    assert packed_cells(plan) == 96


# -- overflow --------------------------------------------------------------------------------------


def test_overflow_error_names_the_example_its_length_and_the_largest_row_length():
    with pytest.raises(BucketOverflowError, match=r"packed_batch_plan: lengths\[2\] = 20 is "
                       r"longer than the largest row length 16 \(2 examples over it\)") as e:
        packed_batch_plan([3, 16, 20, 4, 25], [8, 16], rows=2)
    assert isinstance(e.value, ValueError)
    assert (e.value.index, e.value.length, e.value.largest) == (2, 20, 16)
    assert "overflow='truncate'" in str(e.value) and "'exact'" not in str(e.value)


def test_overflow_truncate_packs_over_long_examples_as_full_rows():
    plan = packed_batch_plan([3, 20, 4, 25], [8, 16], rows=2, shuffle=False, overflow="truncate")
    assert [(b.row_length, b.indices.tolist()) for b in plan] == [(8, [0, 2]), (16, [1, 3])]


# -- 6: bad arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, exc, message", [
    (dict(), ValueError, r"packed_batch_plan: expected exactly one of rows= .* or max_tokens= "
                         r".*received rows=None, max_tokens=None"),
    (dict(rows=2, max_tokens=64), ValueError, r"exactly one of rows= .*rows=2, max_tokens=64"),
    (dict(rows=0), ValueError, r"packed_batch_plan: rows: expected an int >= 1, received 0"),
    (dict(rows=2.0), TypeError, r"packed_batch_plan: rows: expected an int, received float"),
    (dict(rows=True), TypeError, r"rows: expected an int, received bool"),
    (dict(max_tokens=-4), ValueError, r"max_tokens: expected an int >= 1, received -4"),
    (dict(rows=1, num_shards=0), ValueError, r"num_shards: expected an int >= 1, received 0"),
    (dict(rows=1, num_shards=2, shard_index=2), ValueError,
     r"shard_index: expected an int in \[0, num_shards=2\), received 2"),
    (dict(rows=1, shard_index=-1), ValueError, r"shard_index: expected an int >= 0"),
    (dict(rows=1, overflow="exact"), ValueError,
     r"overflow: expected one of 'error', 'truncate', received 'exact'"),
    (dict(rows=1, shuffle="yes"), TypeError, r"shuffle: expected True or False"),
    (dict(rows=1, seed=-1), ValueError, r"seed: expected an int >= 0, received -1"),
    (dict(rows=1, epoch=1.5), TypeError, r"epoch: expected an int"),
])
def test_bad_arguments_name_the_argument(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        packed_batch_plan([3, 5, 9], [4, 16], **kwargs)
    with pytest.raises(exc, match=message):
        buckets.packed_batches([3, 5, 9], [4, 16], **kwargs)   # checked on the call


@pytest.mark.parametrize("lengths, row_lengths, exc, message", [
    ([], [8], ValueError, r"packed_batch_plan: lengths: expected at least one length"),
    ([1.5, 2], [8], TypeError, r"packed_batch_plan: lengths: expected integers"),
    ([3, -1], [8], ValueError, r"packed_batch_plan: lengths\[1\]: expected a length >= 0"),
    ([3], "8", TypeError, r"packed_batch_plan: row_lengths: .*expected a bucket policy"),
    ([3], [], ValueError, r"packed_batch_plan: row_lengths: .*expected at least one"),
    ([3], [8, 0], ValueError, r"packed_batch_plan: row_lengths: .*expected an int >= 1"),
])
def test_bad_lengths_and_row_lengths(lengths, row_lengths, exc, message):
    with pytest.raises(exc, match=message):
        packed_batch_plan(lengths, row_lengths, rows=1)


def test_packed_cells_checks_its_arguments():
    plan = packed_batch_plan([3, 5], [8], rows=1)
    with pytest.raises(ValueError, match=r"packed_cells: num_shards: expected an int >= 1"):
        packed_cells(plan, num_shards=0)
    with pytest.raises(TypeError, match=r"packed_cells: plan\[1\]: expected a PackedBatch"):
        packed_cells([plan[0], (8, np.arange(2), 1)])


# -- the public surface ----------------------------------------------------------------------------


def test_exported_and_packed_batches_yields_the_plans_indices():
    for name in ("PackedBatch", "packed_batch_plan", "packed_batches", "packed_cells"):
        assert name in buckets.__all__ and hasattr(buckets, name)
    lengths = np.random.default_rng(1).integers(0, 40, 100)
    kw = dict(max_tokens=64, seed=3, epoch=1, num_shards=3, shard_index=1)
    plan = packed_batch_plan(lengths, [8, 16, 40], **kw)
    got = list(buckets.packed_batches(lengths, [8, 16, 40], **kw))
    assert [g.tolist() for g in got] == [b.indices.tolist() for b in plan]


def test_a_larger_plan_stays_exact():
    # 20,000 lognormal lengths over 4 shards: still every example once, every part packed.
    rng = np.random.default_rng(7)
    lengths = np.clip(rng.lognormal(np.log(64), 1.0, 20_000).astype(np.int64), 1, 512)
    shards = all_shards(lengths, [64, 128, 512], 4, rows=8)
    seen = np.sort(np.concatenate([b.indices for p in shards for b in p]))
    assert np.array_equal(seen, np.arange(lengths.size))
    for p in shards:
        for b in p:
            assert first_fit(lengths[b.indices], b.row_length).rows <= 8
    real = int(lengths.sum())
    assert real / packed_cells(shards[0], num_shards=4) > 0.6


# -- 7: first_fit ----------------------------------------------------------------------------------


@given(st.integers(1, 40).flatmap(
    lambda L: st.tuples(st.just(L), st.lists(st.integers(0, L), min_size=1, max_size=60))))
def test_first_fit_lays_sequences_out_without_overlap(case):
    L, lengths = case
    p = first_fit(lengths, L)
    arr = np.asarray(lengths)
    assert p.row_length == L and p.cells == p.rows * L
    assert p.row.dtype == p.start.dtype == np.int64
    fill = np.zeros(p.rows, np.int64)
    grid = np.zeros((p.rows, L), np.int64)
    for i, n in enumerate(lengths):
        if n == 0:
            assert p.row[i] == 0 and p.start[i] == 0
            continue
        r, s = int(p.row[i]), int(p.start[i])
        assert 0 <= r < p.rows and 0 <= s and s + n <= L
        grid[r, s:s + n] += 1
        fill[r] += n
    assert grid.max(initial=0) <= 1                 # no two sequences share a cell
    assert np.all(fill > 0)                         # no row opened for nothing
    assert p.rows >= math.ceil(arr.sum() / L)       # at least the tokens' rows
    # First fit: a row opens only for a sequence no earlier row had room for, so no two
    # rows are both at most half full (rows <= 2 * ceil(tokens / L)).
    if p.rows >= 2:
        a, b = np.sort(fill)[:2]
        assert a + b > L
    again = first_fit(lengths, L)
    assert np.array_equal(again.row, p.row) and np.array_equal(again.start, p.start)


def row_fill(p, lengths):
    """Each row's cells as laid out, checking that no two sequences share a cell."""
    grid = np.zeros((p.rows, p.row_length), np.int64)
    for i, n in enumerate(lengths):
        if n == 0:
            assert p.row[i] == 0 and p.start[i] == 0
            continue
        r, s = int(p.row[i]), int(p.start[i])
        assert 0 <= r < p.rows and 0 <= s and s + n <= p.row_length
        grid[r, s:s + n] += 1
    assert grid.max(initial=0) <= 1
    return grid.sum(axis=1)


@given(st.integers(1, 40).flatmap(
    lambda L: st.tuples(st.just(L), st.lists(st.integers(0, L), min_size=1, max_size=60),
                        st.integers(0, 6))))
def test_balanced_fit_spreads_over_the_rows_and_never_fills_past_first_fit(case):
    L, lengths, extra = case
    first = first_fit(lengths, L)
    rows = max(first.rows, 1) + extra
    p = balanced_fit(lengths, L, rows)
    assert p.row_length == L and p.rows in (rows, first.rows)
    fill = row_fill(p, lengths)
    assert fill.sum() == sum(lengths)
    # Rows are filled from column 0 without gaps: the fullest row's fill is the last real
    # column + 1, where a packed scan stops; never later than first-fit's.
    ends = [int(p.start[i]) + n for i, n in enumerate(lengths) if n]
    assert max(ends, default=0) == fill.max(initial=0) <= row_fill(first, lengths).max(initial=0)
    if p.rows == rows and rows > first.rows:
        # Spread over more rows than first-fit filled: strictly shorter, or first_fit's own
        # layout (nothing shorter found).
        assert fill.max(initial=0) < row_fill(first, lengths).max(initial=0)
    # Deterministic: the same lengths always give the same layout, also from first-fit's
    # layout handed in.
    for again in (balanced_fit(lengths, L, rows), balanced_fit(lengths, L, rows, first=first)):
        assert np.array_equal(again.row, p.row) and np.array_equal(again.start, p.start)


def test_balanced_fit_spreads_a_half_full_batch():
    p = balanced_fit([6] * 4, 12, 4)          # first_fit: two full rows of 12
    assert p.rows == 4 and sorted(p.row.tolist()) == [0, 1, 2, 3] and p.start.tolist() == [0] * 4


def test_balanced_fit_refuses_too_few_rows():
    with pytest.raises(ValueError, match=r"balanced_fit: the sequences need 2 rows of 10 "
                                         r"\(first_fit\), more than rows=1"):
        balanced_fit([6, 6], 10, 1)


def test_first_fit_refuses_a_sequence_longer_than_a_row():
    with pytest.raises(ValueError, match=r"first_fit: lengths\[1\] = 11 is longer than "
                                         r"row_length=10"):
        first_fit([3, 11], 10)


def test_docstring_examples_run():
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module("buckets._packing"),
                             optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_huge_rows_or_budget_stay_exact():
    plan = packed_batch_plan([3, 5, 9], [16], rows=2**62, shuffle=False)
    assert [(b.indices.tolist(), b.rows) for b in plan] == [([0, 1, 2], 2**62)]
    assert packed_batch_plan([3], [16], max_tokens=2**63 - 1)[0].rows == (2**63 - 1) // 16
