"""Cost-model bucketing: batch_plan's rows per step, predict's counts, and Auto.fit's optimum."""

import itertools
import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import buckets
from buckets import Auto, CostModel, Fixed, Optimal


def all_shards(lengths, policy, num_shards, **kw):
    return [buckets.batch_plan(lengths, policy, num_shards=num_shards, shard_index=i, **kw)
            for i in range(num_shards)]


def full_rows(bucket_size, budget):
    """The rows of a full batch of a bucket, computed here without batch_size_for."""
    if "batch_size" in budget:
        return budget["batch_size"]
    q = budget["max_tokens"] // bucket_size
    b = 1
    while 2 * b <= q:
        b *= 2
    return b


def round_up(n, m):
    return -(-n // m) * m


def exact_sizes(partial_rows, sizes):
    """The bucket sizes whose partial step gets exact rows, for a partial_rows option."""
    if partial_rows == "exact":
        return set(sizes)
    if partial_rows in ("full", None):
        return set()
    return set(partial_rows)


@st.composite
def plan_setups(draw):
    """Lengths 1..50, a policy covering them, a budget, shards and a partial_rows option."""
    lengths = draw(st.lists(st.integers(1, 50), min_size=1, max_size=60))
    top = max(lengths)
    if draw(st.booleans()):
        sizes = sorted(set(draw(st.lists(st.integers(1, 60), max_size=5))
                           + [draw(st.integers(top, 60))]))
        policy = draw(st.sampled_from([sizes, Fixed(sizes)]))   # plain list or a policy
    else:
        policy = Optimal.fit(lengths, max_buckets=draw(st.integers(1, 6)))
    sizes = buckets.as_policy(policy).sizes
    if draw(st.booleans()):
        budget = dict(batch_size=draw(st.integers(1, 8)))
    else:
        # >= 60, the largest bucket drawn: batch_plan refuses a bucket that not even one row
        # of fits the budget (tested in test_batches.py).
        budget = dict(max_tokens=draw(st.integers(60, 200)))
    num_shards = draw(st.integers(1, 4))
    partial_rows = draw(st.one_of(
        st.sampled_from(["full", "exact", None]),
        st.lists(st.sampled_from(sizes), unique=True).map(tuple),
        st.frozensets(st.sampled_from(sizes)),
    ))
    return lengths, policy, budget, num_shards, partial_rows


# --------------------------------------------------------------------------- batch_plan rows


@given(plan_setups(), st.booleans(), st.integers(0, 2**32 - 1), st.integers(0, 3))
def test_plan_rows_are_aligned_full_or_exact_and_within_budget(setup, shuffle, seed, epoch):
    """Every example once; all shards agree on (bucket_size, rows) per step; rows follow partial_rows."""
    lengths, policy, budget, S, partial_rows = setup
    sizes = buckets.as_policy(policy).sizes
    exact = exact_sizes(partial_rows, sizes)
    shards = all_shards(lengths, policy, S, shuffle=shuffle, seed=seed, epoch=epoch,
                        partial_rows=partial_rows, **budget)
    assert len({len(p) for p in shards}) == 1
    seen = np.concatenate([b.indices for p in shards for b in p])
    assert sorted(seen.tolist()) == list(range(len(lengths)))
    arr = np.asarray(lengths)
    for step in zip(*shards):
        size, rows = step[0].bucket_size, step[0].rows
        assert all(b.bucket_size == size for b in step)
        assert all(b.rows == rows for b in step)
        assert isinstance(rows, int) and rows >= 1
        n = sum(b.indices.size for b in step)      # the global step's examples
        for b in step:
            assert np.all(arr[b.indices] <= size)
            assert b.indices.size <= rows
        b_full = full_rows(size, budget)
        if size in exact:
            assert rows == -(-n // S)
        else:
            assert rows == b_full
        assert rows <= b_full
        if "max_tokens" in budget:
            assert rows * size <= budget["max_tokens"] or rows == 1


def test_partial_rows_small_example():
    """partial_rows picks full rows, exact rows, or exact rows only for the listed buckets."""
    lengths = [3, 9, 4, 10, 2, 1, 12]      # bucket 4: 4 examples, bucket 16: 3 examples
    def rows(pr):
        return [(b.bucket_size, b.indices.size, b.rows) for b in
                buckets.batch_plan(lengths, [4, 16], batch_size=3, shuffle=False, partial_rows=pr)]
    assert rows("full") == [(4, 3, 3), (4, 1, 3), (16, 3, 3)]
    assert rows(None) == rows("full")
    assert rows("exact") == [(4, 3, 3), (4, 1, 1), (16, 3, 3)]
    assert rows([4]) == rows("exact")
    assert rows({16}) == rows("full")


# --------------------------------------------------------------------------- predict


@st.composite
def costs(draw):
    return CostModel(compile_seconds=draw(st.floats(0, 5)),
                     seconds_per_cell=draw(st.floats(1e-4, 1e-1)),
                     seconds_per_step=draw(st.floats(0, 0.5)))


@given(plan_setups(), st.integers(1, 3), st.integers(1, 5), costs(), st.data())
def test_predict_counts_match_batch_plan(setup, row_multiple, epochs, cost, data):
    """predict's steps, cells, shapes, compiles and seconds are those counted from batch_plan."""
    lengths, policy, budget, S, partial_rows = setup
    seed = data.draw(st.integers(0, 2**32 - 1))
    epoch = data.draw(st.integers(0, 5))
    plan = buckets.batch_plan(lengths, policy, num_shards=S, shard_index=0, seed=seed,
                              epoch=epoch, partial_rows=partial_rows, **budget)
    shapes = {(round_up(b.rows, row_multiple), b.bucket_size) for b in plan}
    cells = sum(S * round_up(b.rows, row_multiple) * b.bucket_size for b in plan)
    # Free shapes: some of the plan's own plus some that it does not use.
    compiled = (data.draw(st.lists(st.sampled_from(sorted(shapes)), max_size=3))
                + data.draw(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 60)),
                                     max_size=3)))
    p = buckets.predict(lengths, policy, cost, epochs=epochs, num_shards=S,
                        row_multiple=row_multiple, partial_rows=partial_rows,
                        compiled=compiled, **budget)
    assert p.steps == epochs * len(plan)
    assert p.cells == epochs * cells
    assert set(p.shapes) == shapes and len(p.shapes) == len(shapes)
    assert p.compiles == len(shapes - set(compiled))
    assert p.real == epochs * sum(lengths)
    assert p.padding_efficiency == pytest.approx(sum(lengths) / cells)
    assert p.compile_seconds == pytest.approx(p.compiles * cost.compile_seconds)
    expected_steps = epochs * (len(plan) * cost.seconds_per_step + cells * cost.seconds_per_cell)
    assert p.step_seconds == pytest.approx(expected_steps, rel=1e-9, abs=1e-12)
    assert p.seconds == pytest.approx(p.compile_seconds + p.step_seconds, rel=1e-12, abs=1e-12)


@given(plan_setups(), st.integers(0, 2**32 - 1))
def test_plan_shapes_are_the_same_every_epoch(setup, seed):
    """With shuffling, the multiset of (bucket_size, rows, global step size) is the same each epoch."""
    lengths, policy, budget, S, partial_rows = setup

    def step_shapes(epoch):
        shards = all_shards(lengths, policy, S, shuffle=True, seed=seed, epoch=epoch,
                            partial_rows=partial_rows, **budget)
        return Counter((step[0].bucket_size, step[0].rows, sum(b.indices.size for b in step))
                       for step in zip(*shards))

    first = step_shapes(0)
    assert step_shapes(1) == first
    assert step_shapes(2) == first


# --------------------------------------------------------------------------- Auto.fit


@st.composite
def small_fit_cases(draw):
    """Up to 25 examples with at most 6 distinct lengths in 1..30, a cost, epochs, a budget."""
    values = draw(st.lists(st.integers(1, 30), min_size=1, max_size=6, unique=True))
    lengths = draw(st.lists(st.sampled_from(values), min_size=1, max_size=25))
    cost = draw(costs())
    epochs = draw(st.integers(1, 20))
    if draw(st.booleans()):
        budget = dict(batch_size=draw(st.integers(1, 6)))
    else:
        budget = dict(max_tokens=draw(st.integers(30, 120)))
    return lengths, cost, epochs, budget


def subsets(xs):
    return itertools.chain.from_iterable(itertools.combinations(xs, k) for k in range(len(xs) + 1))


def brute_force(lengths, cost, **kw):
    """The least predicted seconds over every bucket set and every partial_rows subset."""
    values = sorted(set(lengths))
    top, rest = values[-1], values[:-1]
    best = math.inf
    for lower in subsets(rest):
        sizes = list(lower) + [top]
        for exact in subsets(sizes):
            p = buckets.predict(lengths, sizes, cost, partial_rows=exact, **kw)
            best = min(best, p.seconds)
    return best


@given(small_fit_cases(), st.integers(1, 3), st.data())
def test_auto_fit_is_the_brute_force_optimum(case, row_multiple, data):
    """Auto.fit's predicted seconds equal the minimum over all bucket sets and partial_rows choices."""
    lengths, cost, epochs, budget = case
    # Sometimes some shapes are already compiled (free): a bucket's full or partial shape.
    def free_shape(v):
        b = full_rows(v, budget)
        rows = st.one_of(st.just(b), st.integers(1, b)).map(lambda r: round_up(r, row_multiple))
        return rows.map(lambda r: (r, v))
    compiled = data.draw(st.lists(st.sampled_from(sorted(set(lengths))).flatmap(free_shape),
                                  max_size=3))
    kw = dict(epochs=epochs, row_multiple=row_multiple, compiled=compiled, **budget)
    auto = Auto.fit(lengths, cost, **kw)
    best = brute_force(lengths, cost, **kw)
    tol = 1e-9 * max(1.0, best)
    assert best - tol <= auto.prediction.seconds <= best + tol, (auto, auto.prediction, best)
    # The policy is valid and its prediction is predict's on it.
    assert auto.sizes[-1] == max(lengths)
    assert set(auto.partial_rows) <= set(auto.sizes)
    again = buckets.predict(lengths, auto, cost, **kw)
    assert again == auto.prediction


@given(small_fit_cases(), st.integers(1, 3), st.integers(1, 3))
def test_auto_fit_prediction_is_predict_on_the_result(case, num_shards, row_multiple):
    """With shards too, Auto.fit's prediction is predict() recomputed on the returned policy."""
    lengths, cost, epochs, budget = case
    kw = dict(epochs=epochs, num_shards=num_shards, row_multiple=row_multiple, **budget)
    auto = Auto.fit(lengths, cost, **kw)
    again = buckets.predict(lengths, auto, cost, **kw)
    assert again.seconds == auto.prediction.seconds
    assert again.cells == auto.prediction.cells
    assert again.compiles == auto.prediction.compiles
    assert again == auto.prediction
    explicit = buckets.predict(lengths, auto.sizes, cost, partial_rows=auto.partial_rows, **kw)
    assert explicit == auto.prediction


@given(small_fit_cases(), st.integers(1, 3), st.integers(1, 3))
def test_auto_fit_compiled_shape_never_costs_more(case, num_shards, row_multiple):
    """Declaring the (full rows, max length) shape compiled never raises Auto.fit's predicted time."""
    lengths, cost, epochs, budget = case
    top = max(lengths)
    kw = dict(epochs=epochs, num_shards=num_shards, row_multiple=row_multiple, **budget)
    shape = (round_up(full_rows(top, budget), row_multiple), top)
    without = Auto.fit(lengths, cost, **kw).prediction.seconds
    with_ = Auto.fit(lengths, cost, compiled=[shape], **kw).prediction.seconds
    assert with_ <= without + 1e-9 * max(1.0, without)


def test_auto_fit_one_epoch_huge_compile_cost_is_one_bucket():
    """One epoch where a compile costs far more than any padding: a single bucket."""
    lengths = [3] * 50 + [7] * 20 + [20] * 10 + [40] * 3
    cost = CostModel(compile_seconds=1e6, seconds_per_cell=1e-3, seconds_per_step=0.01)
    auto = Auto.fit(lengths, cost, epochs=1, batch_size=4)
    assert auto.sizes == (40,)
    assert auto.prediction.compiles == 1


def test_auto_fit_free_compiles_many_epochs_pads_nothing():
    """Zero compile cost, many epochs, batch_size=1: each distinct length is its own bucket."""
    lengths = [3] * 5 + [7] * 2 + [8] + [20] * 4 + [40] * 3
    cost = CostModel(compile_seconds=0.0, seconds_per_cell=1e-3, seconds_per_step=0.01)
    auto = Auto.fit(lengths, cost, epochs=100, batch_size=1)
    assert auto.sizes == (3, 7, 8, 20, 40)
    assert auto.prediction.padding_efficiency == 1.0
    assert auto.prediction.cells == 100 * sum(lengths)


def test_auto_fit_uses_free_compiled_shapes():
    """Already-compiled full and partial shapes cost nothing, and Auto.fit picks them."""
    cost = CostModel(compile_seconds=10.0, seconds_per_cell=1e-3)
    # One example, batch 16: full rows (16, 1) are free, exact rows (1, 1) would be a compile.
    auto = Auto.fit([1], cost, epochs=1, batch_size=16, compiled=[(16, 1)])
    assert (auto.sizes, auto.partial_rows, auto.prediction.compiles) == ((1,), (), 0)
    auto = Auto.fit([1], cost, epochs=1, batch_size=16)
    assert (auto.partial_rows, auto.prediction.cells) == ((1,), 1)
    # 17 examples, batch 16: with (16, 5) and (1, 5) both free, the partial step runs exact.
    auto = Auto.fit([5] * 17, cost, epochs=1, batch_size=16, compiled=[(16, 5), (1, 5)])
    assert (auto.partial_rows, auto.prediction.compiles, auto.prediction.cells) == ((5,), 0, 85)
    auto = Auto.fit([5] * 17, cost, epochs=1, batch_size=16, compiled=[(16, 5)])
    assert (auto.partial_rows, auto.prediction.compiles, auto.prediction.cells) == ((), 0, 160)


def test_auto_fit_docstring_trade_off():
    """A short run keeps one compile; a long one is worth a second bucket."""
    lengths = [5] * 40 + [6] * 30 + [50] * 9 + [51] * 3
    cost = CostModel(compile_seconds=1.0, seconds_per_cell=1e-4)
    assert Auto.fit(lengths, cost, epochs=1, batch_size=16).sizes == (51,)
    assert Auto.fit(lengths, cost, epochs=100, batch_size=16).sizes == (6, 51)


# --------------------------------------------------------------------------- Auto in batch_plan


@given(small_fit_cases(), st.integers(1, 3), st.integers(0, 2**32 - 1), st.integers(0, 3))
def test_batch_plan_follows_auto_partial_rows(case, num_shards, seed, epoch):
    """batch_plan(lengths, auto) is batch_plan(lengths, auto.sizes, partial_rows=auto.partial_rows)."""
    lengths, cost, epochs, budget = case
    auto = Auto.fit(lengths, cost, epochs=epochs, num_shards=num_shards, **budget)
    assert isinstance(auto, buckets.BucketPolicy)
    kw = dict(num_shards=num_shards, seed=seed, epoch=epoch, **budget)
    for i in range(num_shards):
        got = buckets.batch_plan(lengths, auto, shard_index=i, **kw)
        want = buckets.batch_plan(lengths, list(auto.sizes), shard_index=i,
                                  partial_rows=auto.partial_rows, **kw)
        assert [(b.bucket_size, b.indices.tolist(), b.rows) for b in got] == \
               [(b.bucket_size, b.indices.tolist(), b.rows) for b in want]


def test_batch_plan_uses_a_hand_made_auto_partial_rows():
    """An Auto with partial_rows=(4,) gives bucket 4's partial batch exact rows, bucket 16's full."""
    lengths = [3, 9, 4, 10, 2, 1, 12]
    auto = Auto(sizes=(4, 16), partial_rows=(4,))
    plan = buckets.batch_plan(lengths, auto, batch_size=3, shuffle=False)
    assert [(b.bucket_size, b.indices.size, b.rows) for b in plan] == \
           [(4, 3, 3), (4, 1, 1), (16, 3, 3)]
    # An explicit partial_rows= overrides the policy's own.
    plan = buckets.batch_plan(lengths, auto, batch_size=3, shuffle=False, partial_rows="full")
    assert [b.rows for b in plan] == [3, 3, 3]
    cost = CostModel(compile_seconds=1.0, seconds_per_cell=0.01)
    assert buckets.predict(lengths, auto, cost, batch_size=3).cells == (3 + 1) * 4 + 3 * 16


def test_auto_rejects_partial_rows_outside_its_sizes():
    """Auto's partial_rows must be among its sizes."""
    with pytest.raises(ValueError, match="partial_rows"):
        Auto(sizes=(4, 16), partial_rows=(8,))


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("field", ["compile_seconds", "seconds_per_cell", "seconds_per_step"])
@pytest.mark.parametrize("value, error", [(-1.0, ValueError), (float("nan"), ValueError),
                                          (float("inf"), ValueError), (True, TypeError),
                                          ("1", TypeError)])
def test_cost_model_rejects_bad_fields(field, value, error):
    """CostModel rejects negative, NaN, infinite, bool and non-number fields, naming the field."""
    kw = dict(compile_seconds=1.0, seconds_per_cell=1e-3, seconds_per_step=0.0)
    kw[field] = value
    with pytest.raises(error, match=f"CostModel: {field}"):
        CostModel(**kw)


def test_cost_model_accepts_ints_and_numpy_floats():
    """Valid numbers become floats."""
    c = CostModel(compile_seconds=2, seconds_per_cell=np.float32(0.5))
    assert c == CostModel(2.0, 0.5, 0.0) and isinstance(c.compile_seconds, float)


def test_auto_fit_requires_epochs():
    """Auto.fit needs epochs= (keyword only), at least 1."""
    cost = CostModel(compile_seconds=1.0, seconds_per_cell=1e-3)
    with pytest.raises(TypeError, match="epochs"):
        Auto.fit([1, 2, 3], cost, batch_size=2)
    with pytest.raises(ValueError, match="epochs"):
        Auto.fit([1, 2, 3], cost, epochs=0, batch_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        Auto.fit([1, 2, 3], cost, epochs=1)


def test_predict_and_fit_reject_a_non_cost_model():
    """predict and Auto.fit want a CostModel for cost, and say so."""
    with pytest.raises(TypeError, match="predict: cost"):
        buckets.predict([1, 2, 3], [4], {"compile_seconds": 1.0}, batch_size=2)
    with pytest.raises(TypeError, match="Auto.fit: cost"):
        Auto.fit([1, 2, 3], 1.0, epochs=1, batch_size=2)


def test_predict_rejects_bad_compiled():
    """compiled must be (rows, length) pairs of ints >= 1."""
    cost = CostModel(compile_seconds=1.0, seconds_per_cell=1e-3)
    with pytest.raises(TypeError, match="compiled"):
        buckets.predict([1, 2, 3], [4], cost, batch_size=2, compiled=[(2,)])
    with pytest.raises(ValueError, match=r"compiled\[0\]\[0\]"):
        buckets.predict([1, 2, 3], [4], cost, batch_size=2, compiled=[(0, 4)])


def test_batch_plan_rejects_bad_partial_rows():
    """partial_rows must be 'full', 'exact' or bucket sizes >= 1."""
    with pytest.raises(ValueError, match="'full', 'exact'"):
        buckets.batch_plan([1, 2, 3], [4], batch_size=2, partial_rows="bogus")
    with pytest.raises(ValueError, match="partial_rows"):
        buckets.batch_plan([1, 2, 3], [4], batch_size=2, partial_rows=[0])
    with pytest.raises(TypeError, match="partial_rows"):
        buckets.batch_plan([1, 2, 3], [4], batch_size=2, partial_rows=3)
