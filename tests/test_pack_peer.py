"""The packing peer (bench.packing): Grain's first-fit plan, the hand-written segment-aware
models (their loss and gradients against each sequence alone), and its one compile."""

import doctest

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("grain")  # the bench/test extra; Grain 0.2.18 needs Python >= 3.11

from bench import packing  # noqa: E402
from bench.workloads import AttentionLM, Config, Data, build_model, load_data  # noqa: E402
from examples.rnn.model import CharLM, loss_and_count, masked_loss_fn  # noqa: E402
import polyexec as px  # noqa: E402
from polyexec._errors import OptionError  # noqa: E402

from conftest import assert_trees_close  # noqa: E402


def lengths_data(lengths, cap, seed=0) -> Data:
    """Random byte examples of the given lengths (capped), as `load_data` lays them out."""
    lengths = np.minimum(np.asarray(lengths, np.int64), cap)
    ids = np.random.default_rng(seed).integers(1, 256, size=(lengths.size, cap), dtype=np.int32)
    tokens = np.where(np.arange(cap)[None, :] < lengths[:, None], ids, 0).astype(np.int32)
    return Data(tokens, lengths, 0, lengths.size, "test")


def check_plan(batches, data, cap, rows):
    """Every invariant of a packed epoch; returns the example indices in packing order."""
    seen = []
    for b in batches:
        assert b.tokens.shape == b.segment_ids.shape == b.positions.shape == (rows, cap)
        assert b.tokens.dtype == b.segment_ids.dtype == b.positions.dtype == np.int32
        assert len(b.examples) == rows
        for r, members in enumerate(b.examples):
            seg, pos, tok = b.segment_ids[r], b.positions[r], b.tokens[r]
            want = [data.lengths[i] for i in members]
            assert sum(want) <= cap, "row overfull"
            # Segments lie back to back from the row's start, ids 1.. in order, padding after.
            expected_seg = np.concatenate([np.full(n, k + 1) for k, n in enumerate(want)] +
                                          [np.zeros(cap - sum(want))]).astype(np.int32)
            np.testing.assert_array_equal(seg, expected_seg)
            expected_pos = np.concatenate([np.arange(n) for n in want] +
                                          [np.zeros(cap - sum(want))]).astype(np.int32)
            np.testing.assert_array_equal(pos, expected_pos)
            start = 0
            for i, n in zip(members, want):
                np.testing.assert_array_equal(tok[start:start + n], data.tokens[i, :n])
                start += n
            assert not tok[start:].any()
            seen.extend(members)
    return seen


@pytest.mark.parametrize("n, cap, rows, bins", [(200, 64, 8, None), (57, 32, 4, 16),
                                                 (1, 16, 4, None)])
def test_plan_every_example_once_rows_consistent(n, cap, rows, bins):
    rng = np.random.default_rng(n)
    data = lengths_data(np.clip(rng.lognormal(np.log(cap / 4), 1.0, n).astype(int), 1, None),
                        cap)
    order = rng.permutation(n)
    batches = packing.pack_examples(data, order, cap=cap, batch_size=rows, num_bins=bins,
                                    seed=3)
    seen = check_plan(batches, data, cap, rows)
    assert sorted(seen) == list(range(n))
    # Real tokens are all there; the efficiency is real tokens over every computed cell.
    assert sum(b.real_tokens for b in batches) == data.real_tokens
    assert packing.row_efficiency(batches) == data.real_tokens / (len(batches) * rows * cap)
    assert sum(b.predictions for b in batches) == int((data.lengths - 1).sum())
    # Only the last batch may hold empty rows, and only at its end.
    for b in batches[:-1]:
        assert all(b.examples)
    last = [bool(r) for r in batches[-1].examples]
    assert last == sorted(last, reverse=True) and last[0]


def test_plan_packs_first_fit_and_a_full_row_fits():
    # Lengths 6, 5, 4, 3 into rows of 10 with two bins: 6 -> row 0, 5 -> row 1, 4 -> row 0
    # (first fit), 3 -> row 1; then 10 (a full row) fits neither and opens the next round.
    data = lengths_data([6, 5, 4, 3, 10], cap=10)
    batches = packing.pack_examples(data, np.arange(5), cap=10, batch_size=2, seed=0)
    rows = sorted(r for b in batches for r in b.examples if r)
    assert rows == [(0, 2), (1, 3), (4,)]
    check_plan(batches, data, 10, 2)
    assert batches[-1].examples == ((4,), ())
    assert batches[-1].efficiency == 10 / 20


def test_epoch_is_deterministic_for_a_seed_and_differs_across_epochs():
    cfg = Config(source="lognormal", num_examples=120, cap=128, batch_size=8, seed=4)
    data = load_data(cfg)
    a, b = packing.pack_epoch(cfg, data, 0), packing.pack_epoch(cfg, data, 0)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.examples == y.examples
        for key in ("tokens", "segment_ids", "positions"):
            np.testing.assert_array_equal(getattr(x, key), getattr(y, key))
    other = packing.pack_epoch(cfg, data, 1)
    assert [x.examples for x in other] != [x.examples for x in a]
    for epoch in (0, 1):
        seen = check_plan(packing.pack_epoch(cfg, data, epoch), data, cfg.cap, cfg.batch_size)
        assert sorted(seen) == list(range(data.lengths.size))
    # Examples enter the packer in the random-batch strategies' order.
    stream = [i for x in a for r in x.examples for i in r]
    assert sorted(stream) == sorted(packing.epoch_order(cfg, data, 0).tolist())


def test_pack_epoch_needs_rows():
    cfg = Config(source="uniform", num_examples=10, cap=32, batch_size=None, max_tokens=64)
    with pytest.raises(OptionError, match="batch_size"):
        packing.pack_epoch(cfg, load_data(cfg), 0)


def test_module_docstring_example_runs():
    result = doctest.testmod(packing, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.attempted and result.failed == 0


# ------------------------------------------------------------------------- loss and grads


MODELS = {
    "gru": lambda: CharLM(cell="gru", embed=8, hidden=12, key=jax.random.PRNGKey(1)),
    "lstm": lambda: CharLM(cell="lstm", embed=8, hidden=12, key=jax.random.PRNGKey(2)),
    "attention": lambda: AttentionLM(dim=16, heads=2, key=jax.random.PRNGKey(3)),
}


def one_batch(cap=24, rows=2, seed=0):
    """Packed batches of short sequences (lengths 1 and cap included; rows of 1 to 4). Few
    distinct lengths: the reference compiles once per length."""
    lengths = [7, 1, 5, 7, 5, 2, 7, 2, cap, 5]
    data = lengths_data(lengths, cap, seed=seed)
    batches = packing.pack_examples(data, np.arange(len(lengths)), cap=cap, batch_size=rows)
    return data, batches


@eqx.filter_jit   # non-array leaves (the model's static fields) static, arrays traced
def _alone(params, static, tokens):
    """Summed nats of one sequence at its exact length, their gradient, and the count."""
    lengths = jnp.full((1,), tokens.shape[1], jnp.int32)

    def total(p):
        return loss_and_count(eqx.combine(p, static), tokens, lengths)

    (s, c), g = jax.value_and_grad(total, has_aux=True)(params)
    return s, c, g


def exact_total(params, static, data, members):
    """Summed nats, their gradient and the predictions, each sequence alone, exact length."""
    total, count, grads = 0.0, 0, jax.tree_util.tree_map(jnp.zeros_like, params)
    for i in members:
        n = int(data.lengths[i])
        if n < 2:
            continue          # no prediction (loss_fn needs T >= 2; it would count none)
        s, c, g = _alone(params, static, jnp.asarray(data.tokens[i:i + 1, :n]))
        total, count = total + s, count + int(c)
        grads = jax.tree_util.tree_map(jnp.add, grads, g)
    return total, count, grads


@eqx.filter_jit
def _jitted(fn, params, static, *args):
    return jax.value_and_grad(lambda p: fn(eqx.combine(p, static), *args))(params)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_packed_loss_and_grads_equal_each_sequence_alone(kind):
    model = MODELS[kind]()
    data, batches = one_batch()
    assert len(batches) >= 2 and any(len(r) >= 3 for b in batches for r in b.examples)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    for b in batches:
        members = [i for r in b.examples for i in r]
        args = tuple(jnp.asarray(a) for a in (b.tokens, b.segment_ids, b.positions))
        lp, gp = _jitted(packing.packed_loss, params, static, *args)
        total, count, grads = exact_total(params, static, data, members)
        np.testing.assert_allclose(lp, total / count, rtol=1e-5, atol=1e-6)
        assert_trees_close(gp, jax.tree_util.tree_map(lambda g: g / count, grads),
                           rtol=1e-4, atol=1e-6)
        ptotal, pcount = eqx.filter_jit(packing.packed_loss_and_count)(model, *args)
        assert int(pcount) == count == b.predictions
        np.testing.assert_allclose(ptotal, total, rtol=1e-5)

        # ...and the loss masked by hand on the same examples padded one per row (what the
        # bucketed, unmasked loss_fn computes with ragged rows).
        padded = jnp.asarray(data.tokens[members])
        lf, gf = _jitted(masked_loss_fn, params, static, padded,
                         jnp.asarray(data.lengths[members], jnp.int32))
        np.testing.assert_allclose(lp, lf, rtol=1e-5, atol=1e-6)
        assert_trees_close(gp, gf, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_polyexec_packs_the_unchanged_model_like_the_peer(kind):
    """The peer's hand-written segment handling and polyexec's packed rows of the model as
    written (``loss_fn``: no segment ids, no mask) give the same loss and gradients on the
    same examples."""
    from examples.rnn.model import loss_fn
    model = MODELS[kind]()
    data, batches = one_batch()
    params, static = eqx.partition(model, eqx.is_inexact_array)
    B, T = px.LengthVar("B", max=16), px.LengthVar("T", min=2, max=24)

    def value_and_grad(params, tokens, lengths):
        return jax.value_and_grad(lambda p: loss_fn(eqx.combine(p, static), tokens,
                                                    lengths))(params)
    ours = px.bucketed(value_and_grad, (None, px.Spec((B, T), jnp.int32),
                                        px.Spec((B,), jnp.int32, lengths_of=T)),
                       buckets={T: [24], B: [16]}, layout="pack", strict=True)
    for b in batches:
        members = [i for r in b.examples for i in r if data.lengths[i] >= 2]
        args = tuple(jnp.asarray(a) for a in (b.tokens, b.segment_ids, b.positions))
        peer_loss, peer_grads = _jitted(packing.packed_loss, params, static, *args)
        loss, grads = ours(params, data.tokens[members],
                           np.asarray(data.lengths[members], np.int32))
        np.testing.assert_allclose(loss, peer_loss, rtol=1e-5, atol=1e-6)
        assert_trees_close(grads, peer_grads, rtol=1e-4, atol=1e-6)
    assert ours.plan.can_pack and ours.traces == 1


@eqx.filter_jit
def _total_with_model_segments(model, tokens, true_segments, model_segments, model_positions):
    """Summed nats over the true in-segment predictions, of logits the model computes from
    the segment ids and positions it is given."""
    logits = jax.vmap(lambda t, s, p: packing.packed_logits(model, t, s, p))(
        tokens[:, :-1], model_segments[:, :-1], model_positions[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    mask = (true_segments[:, :-1] != 0) & (true_segments[:, 1:] == true_segments[:, :-1])
    return jnp.sum(jnp.where(mask, nll, 0.0))


@pytest.mark.parametrize("kind", ["gru", "attention"])
def test_without_the_segment_handling_the_loss_differs(kind):
    """The check above can fail: a model that ignores segments (no state reset; attention and
    positions across segments) gives another loss on the same in-segment predictions."""
    model = MODELS[kind]()
    data, batches = one_batch()
    b = next(b for b in batches if any(len(r) >= 3 for r in b.examples))
    members = [i for r in b.examples for i in r]
    params, static = eqx.partition(model, eqx.is_inexact_array)
    right, _, _ = exact_total(params, static, data, members)
    same = _total_with_model_segments(model, b.tokens, b.segment_ids, b.segment_ids,
                                      b.positions)
    np.testing.assert_allclose(same, right, rtol=1e-5)
    # Each row as one long sequence: one segment, positions counted from the row's start.
    one_segment = np.where(b.segment_ids > 0, 1, 0).astype(np.int32)
    row_positions = np.where(b.segment_ids > 0, np.arange(b.tokens.shape[1])[None, :], 0)
    ignored = _total_with_model_segments(model, b.tokens, b.segment_ids, one_segment,
                                         row_positions.astype(np.int32))
    # (a tiny fresh GRU forgets fast: no reset moved the sum by 7e-4 of it; float noise < 1e-5)
    assert abs(float(ignored) - float(right)) > 1e-4 * abs(float(right))


def test_packed_logits_reject_other_models():
    with pytest.raises(TypeError, match="CharLM or an AttentionLM"):
        packing.packed_logits(eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(0)),
                              jnp.zeros(4, jnp.int32), jnp.ones(4, jnp.int32),
                              jnp.arange(4, dtype=jnp.int32))


# ------------------------------------------------------------------------------ the step


@pytest.mark.parametrize("model", ["gru", "attention"])
def test_packed_step_compiles_once_and_trains_like_the_reference(model):
    cfg = Config(model=model, source="lognormal", num_examples=20, cap=48, batch_size=4,
                 hidden=16, embed=8, heads=2, seed=5, learning_rate=3e-3)
    data = load_data(cfg)
    batches = packing.pack_epoch(cfg, data, 0)
    # A whole epoch, its last batch partial (padded with empty rows): still one shape.
    assert len(batches) >= 3 and not all(batches[-1].examples)
    step = packing.build_packed_step(cfg)
    loss, state = step(step.state, batches[0])
    losses = [float(loss)]
    with px.count_compiles() as events:   # XLA's own compile events (jax.monitoring)
        for b in batches[1:]:
            loss, state = step(state, b)
            losses.append(float(loss))
    assert events.counts().backend_compiles == 0
    assert step.compiles == 1 and step.traces == 1
    assert all(np.isfinite(losses))

    # The same initial weights as build_model(cfg), and the same first update as a plain
    # value_and_grad + optax.adam(lr) step on packed_loss.
    import optax
    initial = build_model(cfg)
    assert_trees_close(eqx.filter(step.model(step.state), eqx.is_inexact_array),
                       eqx.filter(initial, eqx.is_inexact_array), rtol=0, atol=0)
    b = batches[0]
    params, static = eqx.partition(initial, eqx.is_inexact_array)
    args = tuple(jnp.asarray(a) for a in (b.tokens, b.segment_ids, b.positions))
    loss, grads = _jitted(packing.packed_loss, params, static, *args)
    opt = optax.adam(cfg.learning_rate)
    updates, _ = opt.update(grads, opt.init(params), params)
    expected = optax.apply_updates(params, updates)
    first_loss, first_state = step(step.state, b)
    np.testing.assert_allclose(first_loss, loss, rtol=1e-5)
    assert_trees_close(eqx.filter(step.model(first_state), eqx.is_inexact_array), expected,
                       rtol=1e-5, atol=1e-6)
    assert step.compiles == 1 and step.traces == 1
