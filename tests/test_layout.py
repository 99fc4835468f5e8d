"""Choosing the layout: ``layout="auto"`` per call (fewer cells), `Bucketed.with_layout`,
packed warmup, `buckets.predict_packed` against the cells the executor counts, and
`polyexec.training.choose_layout` (pad or pack by predicted run time).

Traces and compiles are counted directly (``f.traces``, ``f.stats``); a cost model is fixed
by hand where a test needs a known decision (a measured one depends on the machine).
"""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, strategies as st

import buckets
import polyexec as px
from polyexec.training import TrainState, choose_layout, make_train_step
from polyexec.training import _auto

from conftest import assert_trees_close

T = px.LengthVar("T", min=1, max=64)
B = px.LengthVar("B", max=256)
SPECS = (px.Spec("B T", jnp.float32), px.Spec("B", jnp.int32, lengths_of="T"))


def total(x, n):
    """Plain code, no mask: the sum of every real token."""
    return jnp.sum(x)


def ragged(lengths, fill=np.nan):
    """A (B, longest) batch: token j of sequence i is i + j / 100; NaN past each length."""
    lengths = np.asarray(lengths, np.int32)
    x = np.full((len(lengths), max(int(lengths.max(initial=0)), 1)), fill, np.float32)
    for i, n in enumerate(lengths):
        x[i, :n] = i + np.arange(n) / 100
    return x, lengths


def exact_total(lengths):
    return sum(float(i * n + np.arange(n).sum() / 100) for i, n in enumerate(lengths))


def test_auto_packs_a_call_only_when_it_saves_cells():
    f = px.bucketed(total, in_specs=SPECS, buckets={T: [16, 64], B: [2, 4, 8]}, layout="auto")
    skewed = [64, 3, 5, 2]             # pad: 4 x 64 cells; packed: 2 rows of 64 (74 tokens)
    even = [60, 61, 62, 63]            # packed needs 4 rows of 64 too: no saving, stays padded
    for lengths in (skewed, even):
        np.testing.assert_allclose(float(f(*ragged(lengths))), exact_total(lengths), rtol=1e-6)
    assert sorted(f.stats.buckets) == [(("B", 4), ("T", 64)),
                                       (("rows(B)", 2), ("row_length(T)", 64))]
    packed = f.stats.buckets[(("rows(B)", 2), ("row_length(T)", 64))]
    assert (packed.real_elements, packed.padded_elements) == (74, 128)
    assert f.traces == 1


def test_with_layout_shares_one_trace_and_the_compiled_programs():
    f = px.bucketed(total, in_specs=SPECS, buckets={T: [64], B: [4]}, layout="auto")
    pad, pack = f.with_layout("pad"), f.with_layout("pack", pack_rows={64: 3})
    x, n = ragged([10, 3, 7, 1])
    assert float(pad(x, n)) == pytest.approx(float(pack(x, n))) == pytest.approx(exact_total(n))
    assert float(pack(x, n)) == pytest.approx(exact_total(n))        # compiled: not again
    assert f.traces == 1
    assert sorted(f.stats.buckets) == [(("B", 4), ("T", 64)),
                                       (("rows(B)", 3), ("row_length(T)", 64))]
    assert f.stats.compiles == 2
    with pytest.raises(px.OptionError, match="layout"):
        f.with_layout("packed")
    with pytest.raises(px.OptionError, match="pack_rows"):
        f.with_layout("pack", pack_rows=[64])


def test_pack_rows_keys_that_are_no_row_length_are_refused_by_name():
    """Before: ``pack_rows={7: 2}`` was silently never used (no row is 7 long)."""
    message = (r"pack_rows: expected keys that are row lengths \(the buckets of T: \[16, 64\]\), "
               r"received 7, which no row has")
    with pytest.raises(px.OptionError, match=r"bucketed\(total\): " + message):
        px.bucketed(total, in_specs=SPECS, buckets={T: [16, 64]}, layout="pack", pack_rows={7: 2})
    f = px.bucketed(total, in_specs=SPECS, buckets={T: [16, 64]}, layout="auto")
    with pytest.raises(px.OptionError, match=r"total.with_layout: " + message):
        f.with_layout("pack", pack_rows={7: 2, 64: 3})
    packed = f.with_layout("pack", pack_rows={16: 2})
    with pytest.raises(px.OptionError, match=r"total.with_buckets: pack_rows: .*\[32, 64\]\), "
                                             r"received 16"):
        packed.with_buckets({T: [32, 64]})


def test_a_packing_plan_exports_its_padded_program_only_when_a_call_runs_padded():
    f = px.bucketed(total, in_specs=SPECS, buckets={T: [64], B: [2, 4]}, layout="auto")
    pad_program = lambda: f.plan.segments[0].programs["pad"]    # noqa: E731
    x, n = ragged([64, 3, 5, 2])                   # 2 rows packed against 4 padded
    assert float(f(x, n)) == pytest.approx(exact_total(n), rel=1e-6)
    assert f.plan.segments[0].programs["pack"].built and not pad_program().built
    x, n = ragged([60, 61, 62, 63])                # no saving: runs padded, exports now
    assert float(f(x, n)) == pytest.approx(exact_total(n), rel=1e-6)
    assert pad_program().built and f.traces == 1
    pad_only = px.bucketed(total, in_specs=SPECS, buckets={T: [64], B: [4]}, layout="pad")
    assert pad_only.plan.segments[0].programs["pad"].built
    assert "pack" not in pad_only.plan.segments[0].programs


def test_views_keep_their_own_options_and_share_the_compiled_programs():
    f = px.bucketed(total, in_specs=SPECS, buckets={T: [16, 64], B: [4]}, layout="pad")
    g = f.with_buckets({T: [64]})
    assert (f.bucket_sizes("T"), g.bucket_sizes("T")) == ((16, 64), (64,))
    assert g._lock is not f._lock and g._shared is f._shared
    x, n = ragged([10, 3])
    assert float(g(x, n)) == pytest.approx(float(f(x, n)))
    assert sorted(f.stats.buckets) == [(("B", 4), ("T", 16)), (("B", 4), ("T", 64))]
    g.with_layout("pack")(x, n)
    assert f.layout == g.layout == "pad" and f.traces == 2    # the packing view's own plan


def test_call_at_least_runs_at_the_given_bucket_and_counts_only_the_real_rows():
    f = px.bucketed(lambda x, n: jnp.mean(jnp.sum(x, 1)), in_specs=SPECS,
                    buckets={T: [16, 64], B: [2, 4]})
    x, n = ragged([3, 2])
    assert float(f.call_at_least({"B": 4, "T": 64}, x, n)) == pytest.approx(
        exact_total(n) / 2, rel=1e-6)
    assert list(f.stats.buckets) == [(("B", 4), ("T", 64))]


def test_a_pad_function_traces_again_for_packed_rows():
    f = px.bucketed(total, in_specs=SPECS, buckets={T: [64], B: [4]})
    x, n = ragged([10, 3])
    f(x, n)
    g = f.with_layout("pack")
    assert float(g(x, n)) == pytest.approx(exact_total(n))
    assert f.traces == 2 and any(k[0][0] == "rows(B)" for k in f.stats.buckets)


def test_packed_warmup_compiles_the_grid_a_call_runs():
    f = px.bucketed(total, in_specs=SPECS, buckets={T: [16, 64]}, layout="pack",
                    pack_rows={64: 3})
    assert f.warmup(sizes=[{"B": 3, "T": 50}]) == [{"T": 64, "B": 3}]
    assert f.stats.compiles == 1
    with px.forbid_compiles():
        x, n = ragged([50, 40, 30, 20, 9])     # first-fit: 3 rows of 64
        assert float(f(x, n)) == pytest.approx(exact_total(n), rel=1e-6)
    assert f.stats.compiles == 1 and f.traces == 1


@given(lengths=st.lists(st.integers(1, 64), min_size=1, max_size=60),
       rows=st.integers(1, 4), epochs=st.integers(1, 3))
def test_predicted_packed_cells_are_the_cells_the_executor_runs(lengths, rows, epochs):
    """`predict_packed` prices the plans `packed_batch_plan` makes; run through the executor
    at ``pack_rows``, the cells it counts are the predicted ones, step for step."""
    cost = buckets.CostModel(compile_seconds=1.0, seconds_per_cell=1e-6)
    predicted = buckets.predict_packed(lengths, [64], cost, rows=rows, epochs=epochs, seed=3)
    f = _PACKED.with_layout("pack", pack_rows={64: rows})
    before = _cells(f)
    steps = 0
    for epoch in range(epochs):
        for batch in buckets.packed_batch_plan(lengths, [64], rows=rows, seed=3, epoch=epoch):
            x, n = ragged(np.asarray(lengths)[batch.indices])
            assert float(f(x, n)) == pytest.approx(exact_total(n), rel=1e-5, abs=1e-4)
            steps += 1
    assert (_cells(f) - before, steps) == (predicted.cells, predicted.steps)
    assert predicted.real == epochs * sum(lengths)


_PACKED = px.bucketed(total, in_specs=SPECS, buckets={T: [64]}, layout="pack")


def _cells(f):
    return sum(b.padded_elements for k, b in f.stats.buckets.items() if k[0][0] == "rows(B)")


# -- choose_layout --------------------------------------------------------------------------

def _loss(model, tokens, lengths):
    """Plain per-token code with a per-token mean: packable."""
    return jnp.mean(tokens.astype(jnp.float32) * model.weight[0, 0])


def _unpackable_loss(model, tokens, lengths):
    """Each sequence weighted by a per-position vector contracted along the length: packed
    rows have no rule for a per-position value contracted into them."""
    x = tokens.astype(jnp.float32) * model.weight[0, 0]
    return jnp.mean(jnp.einsum("bt,t->b", x, jnp.cos(jnp.arange(x.shape[1]))))


def _state():
    return TrainState.create(eqx.nn.Linear(1, 1, key=jax.random.PRNGKey(0)), optax.sgd(0.1))


LENGTHS = np.array([3, 5, 6, 7, 40, 41, 64, 9, 2, 12] * 8)


@pytest.fixture
def fixed_cost(monkeypatch):
    """measure_cost's compile and step still happen; the returned model is fixed, so the
    decision does not depend on this machine's speed."""
    chosen = {}

    def measure(step, arg, tokens, lengths, **kw):
        _original(step, arg, tokens, lengths, **kw)
        return chosen["cost"]

    _original = _auto.measure_cost
    monkeypatch.setattr(_auto, "measure_cost", measure)
    return chosen


def test_choose_layout_packs_when_packing_is_cheaper(fixed_cost):
    fixed_cost["cost"] = buckets.CostModel(compile_seconds=1.0, seconds_per_cell=1e-3)
    step = make_train_step(_loss, optax.sgd(0.1), length_buckets=[64], batch_buckets=[4],
                           layout="auto")
    # max_tokens=256: 4 rows of 64 a step (batch_size=4 would take the rows holding about 4
    # examples a step: 2; tests/test_training.py checks that rule).
    choice = choose_layout(step, _state(), LENGTHS, epochs=2, max_tokens=256)
    assert choice.layout == "pack" and choice.row_lengths == (64,) and choice.pack_rows == {64: 4}
    assert choice.pack.seconds < choice.pad.seconds
    assert choice.pack.compiles == 0                 # the measured program is the one that runs
    assert step.traces == 1 and step.stats.compiles == 1
    assert "packed" in choice.describe() or "pack" in choice.describe()
    # The pinned step runs the plan's batches at the measured shape: no more compiles.
    state = _state()
    with px.forbid_compiles():
        for batch in buckets.packed_batch_plan(LENGTHS, [64], rows=4, epoch=0):
            n = LENGTHS[batch.indices].astype(np.int32)
            state, _ = choice.step(state, np.ones((len(n), int(n.max())), np.int32), n)


def test_choose_layout_keeps_the_measured_first_batch_as_the_runs_first_step(fixed_cost,
                                                                             tmp_path):
    fixed_cost["cost"] = buckets.CostModel(compile_seconds=1.0, seconds_per_cell=1e-3)
    tokens = np.random.default_rng(0).integers(1, 9, size=(len(LENGTHS), 64)).astype(np.int32)

    def examples(indices):
        n = LENGTHS[indices].astype(np.int32)
        return tokens[indices, :int(n.max())], n

    plan = buckets.packed_batch_plan(LENGTHS, [64], rows=4, seed=3, epoch=0)
    first = plan[0]
    px.enable_persistent_cache(str(tmp_path))
    try:
        # The first run times the plan's first three batches (a first call after a compile runs
        # slow), each on the last one's output. The second run loads the program from
        # the persistent cache and its recorded cost: nothing is timed, yet the first batch
        # still runs once and is kept.
        for run in range(2):
            step = make_train_step(_loss, optax.sgd(0.1), length_buckets=[16, 64],
                                   batch_buckets=[4], layout="auto")
            choice = choose_layout(step, _state(), LENGTHS, epochs=2, max_tokens=256, seed=3,
                                   examples=examples, next_arg=lambda output: output[0])
            kept = choice.first_steps
            assert len(kept) == (_auto.SAMPLES if run == 0 else 1) == (3 if run == 0 else 1)
            (batch, output) = kept[0]
            np.testing.assert_array_equal(batch.indices, first.indices)
            # That batch's step from the initial state: the run goes on from it.
            assert_trees_close(output, choice.step(_state(), *examples(first.indices)))
            for i in range(1, len(kept)):       # the plan's next batches, each on the last
                np.testing.assert_array_equal(kept[i][0].indices, plan[i].indices)
                assert_trees_close(kept[i][1], choice.step(kept[i - 1][1][0],
                                                           *examples(plan[i].indices)))
            # Epoch 0 takes them first, then every other example once.
            plan = choice.epoch_plan(LENGTHS, epoch=0, seed=3)
            assert plan[:len(kept)] == [b for b, _ in kept]
            assert sorted(np.concatenate([b.indices for b in plan])) == list(range(len(LENGTHS)))
            # One program, at the plan's grid (short examples still run in rows of 64).
            assert set(step.stats.buckets) == {(("rows(B)", 4), ("row_length(T)", 64))}
            assert step.stats.compiles == 1
    finally:
        px.disable_persistent_cache()


# Half the tokens are in examples of 16 or fewer: two row lengths can pay.
LENGTHS_SHORT_AND_LONG = np.array([3, 5, 6, 7, 9, 12, 2, 4, 10, 11, 64] * 8)


def _priced(monkeypatch, per_cell: dict, compile_seconds: float):
    """`choose_layout`'s measurements compiled and run for real, but priced at ``per_cell``
    seconds a cell by row length (read at each call) and ``compile_seconds`` a compile;
    returns ``examples`` for `LENGTHS_SHORT_AND_LONG`."""
    original = _auto.measure_cost

    def measure(step, arg, tokens, n, *, grid=None, **kw):
        original(step, arg, tokens, n, grid=grid, **kw)
        return buckets.CostModel(compile_seconds=compile_seconds,
                                 seconds_per_cell=per_cell[(grid or tokens.shape)[1]])

    monkeypatch.setattr(_auto, "measure_cost", measure)
    lengths = LENGTHS_SHORT_AND_LONG
    tokens = np.random.default_rng(1).integers(1, 9, size=(len(lengths), 64)).astype(np.int32)

    def examples(indices):
        n = lengths[indices].astype(np.int32)
        return tokens[indices, :int(n.max())], n

    return examples


def test_choose_layout_adds_shorter_rows_when_their_cells_measure_cheaper(monkeypatch):
    lengths = LENGTHS_SHORT_AND_LONG
    per_cell = {64: 1e-3, 16: 1e-4}
    examples = _priced(monkeypatch, per_cell, compile_seconds=0.01)
    step = make_train_step(_loss, optax.sgd(0.1), length_buckets=[64], batch_buckets=[4],
                           layout="auto")
    choice = choose_layout(step, _state(), lengths, epochs=3, max_tokens=256, examples=examples,
                           next_arg=lambda output: output[0])
    # The timed calls ran the two-length plan's first three batches of each row length (the
    # fastest counts), each on the last one's output: all kept, in that order, as the run's
    # first steps.
    plan = buckets.packed_batch_plan(lengths, [16, 64], max_tokens=256, epoch=0)
    kept = choice.first_steps
    expected = [b for n in (64, 16) for b in [b for b in plan if b.row_length == n][:3]]
    # The plan has two batches of rows of 64 (a padding call, not kept, is their third sample).
    assert [b.indices.tolist() for b, _ in kept] == [b.indices.tolist() for b in expected]
    assert [b.row_length for b, _ in kept] == [64, 64, 16, 16, 16]
    state = _state()
    for batch, output in kept:
        assert_trees_close(output, choice.step(state, *examples(batch.indices)))
        state = output[0]
    epoch = choice.epoch_plan(lengths, epoch=0)
    assert epoch[:len(kept)] == [b for b, _ in kept]
    assert sorted(np.concatenate([b.indices for b in epoch])) == list(range(len(lengths)))
    # The same 256 cells a step: 16 rows of 16, or 4 rows of 64.
    assert choice.layout == "pack" and choice.row_lengths == (16, 64), choice.describe()
    assert choice.pack_rows == {16: 16, 64: 4} and choice.max_tokens == 256
    assert set(choice.pack.shapes) == {(16, 16), (4, 64)} and choice.pack.compiles == 0
    assert step.traces == 1 and step.stats.compiles == 2
    state = _state()
    with px.forbid_compiles():          # the plan's batches run at the two measured shapes
        for batch in buckets.packed_batch_plan(lengths, [16, 64], max_tokens=256, epoch=0):
            n = lengths[batch.indices].astype(np.int32)
            state, _ = choice.step(state, np.ones((len(n), int(n.max())), np.int32), n)
    # Measured as dear as the long rows' cells, the short rows only lose efficiency: the
    # packed price is one row length's (here padding, with compiles this cheap, wins anyway).
    per_cell[16] = 1e-3
    step = make_train_step(_loss, optax.sgd(0.1), length_buckets=[64], batch_buckets=[4],
                           layout="auto")
    again = choose_layout(step, _state(), lengths, epochs=3, max_tokens=256)
    assert step.stats.compiles == 2 and set(again.pack.shapes) == {(4, 64)}


def test_packed_batching_keeps_the_tokens_a_step_at_every_row_length():
    from polyexec.training._data import PackedBatching
    lengths = np.array([3, 5, 6, 7, 9, 12, 2, 4, 10, 11, 64, 40] * 3)
    batching = PackedBatching((16, 64), 256, shuffle=True, seed=1, min_length=2)
    steps = batching.epoch(lengths, 0)
    assert sorted(np.concatenate([b.indices for b in steps])) == list(range(len(lengths)))
    assert {batching.shape(b) for b in steps} == {(16, 16), (4, 64)}
    # The shapes' tokens are the plan's: the rows of 64 also carry short examples in the
    # cells their long ones leave free, so a (16, 16) step runs fewer than all short tokens.
    shapes = batching.shapes(lengths)
    assert set(shapes) == {(16, 16), (4, 64)} and sum(shapes.values()) == lengths.sum()
    assert shapes[(4, 64)] > lengths[lengths > 16].sum()


def test_packed_shares_across_processes_are_disjoint_and_hold_every_example_once():
    """Two processes plan the same global packed steps; each loads only the examples packed
    into its half of the grid's rows (every length known to both), so the shares are disjoint
    and hold each example of an epoch once, at the one grid a single process would run."""
    from polyexec.training import as_examples
    from polyexec.training._data import PackedBatching
    rng = np.random.default_rng(3)
    examples = as_examples([rng.integers(1, 9, n) for n in rng.integers(1, 40, 60)], "data")
    step = make_train_step(_loss, optax.sgd(0.1), length_buckets=[40], batch_buckets=[4],
                           layout="pack").with_layout("pack", {40: 4})
    state = _state()
    shares = [PackedBatching((40,), 4 * 40, True, 0, num_shards=2, shard_index=i)
              for i in (0, 1)]
    for epoch in (0, 1):
        plans = [b.epoch(examples.lengths, epoch) for b in shares]
        assert [b.indices.tolist() for b in plans[0]] == [b.indices.tolist() for b in plans[1]]
        loaded = []
        for batch in plans[0]:
            row, rows = step.packing_of(examples.lengths[batch.indices], state)
            assert rows == 4 and all(b.shape(batch) == (2, 40) for b in shares)
            mine = []
            for i, share in enumerate(shares):
                tokens, lengths = share.stack(examples, batch,
                                              rows_of=lambda n: step.packing_of(n, state))
                assert lengths.tolist() == examples.lengths[batch.indices].tolist()
                read = (tokens != 0).any(axis=1)            # tokens are 1..8: read, else pad
                assert read.tolist() == (row // 2 == i).tolist()
                mine.append(set(batch.indices[read].tolist()))
            assert not mine[0] & mine[1]
            loaded += sorted(mine[0] | mine[1])
        assert sorted(loaded) == list(range(len(examples)))
    with pytest.raises(px.OptionError, match="rows_of: expected the step's packing_of"):
        shares[0].stack(examples, plans[0][0])


def test_choose_layout_pads_when_padding_is_cheaper(fixed_cost):
    # Compiles free, cells dear, and every example as long as the row: packing saves no
    # cell, while the padded plan's partial batch runs at its own rows.
    fixed_cost["cost"] = buckets.CostModel(compile_seconds=0.0, seconds_per_cell=1.0)
    lengths = np.full(5, 64)
    step = make_train_step(_loss, optax.sgd(0.1), length_buckets=[64], batch_buckets=[4],
                           layout="auto")
    choice = choose_layout(step, _state(), lengths, epochs=1, batch_size=4)
    assert choice.layout == "pad", choice.describe()
    assert choice.pad.cells < choice.pack.cells
    assert choice.buckets.policy.sizes == (64,) and step.traces == 1
    assert choice.step.layout == "pad"


def test_choose_layout_names_the_line_when_the_plan_cannot_pack():
    step = make_train_step(_unpackable_loss, optax.sgd(0.1), length_buckets=[64],
                           batch_buckets=[4], layout="auto")
    choice = choose_layout(step, _state(), LENGTHS, epochs=1, batch_size=4)
    assert choice.layout == "pad" and choice.pack is None
    assert "test_layout.py" in choice.reason, choice.reason
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        forced = choose_layout(step, _state(), LENGTHS, epochs=1, batch_size=4, layout="pack")
    assert forced.layout == "pad" and any("cannot run packed rows" in str(w.message)
                                          for w in caught)


def test_choose_layout_checks_its_layout():
    step = make_train_step(_loss, optax.sgd(0.1), length_buckets=[64], batch_buckets=[4])
    with pytest.raises(px.OptionError, match="layout: expected one of 'auto', 'pad', 'pack'"):
        choose_layout(step, _state(), LENGTHS, epochs=1, batch_size=4, layout="packed")
    with pytest.raises(px.OptionError, match="examples and next_arg: expected both or neither, "
                                             "received only examples"):
        choose_layout(step, _state(), LENGTHS, epochs=1, batch_size=4,
                      examples=lambda indices: None)
