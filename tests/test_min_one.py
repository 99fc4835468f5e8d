"""The next-token loss at ``T``'s ``min=1`` (issue 38): ``logits[:, :-1]`` against ``x[:, 1:]``
needs ``T >= 2`` for JAX's own shape rules, so polyexec traces it at ``T >= 2`` and runs a
call's shorter rows at their own lengths -- each row exactly as it runs alone, values and
gradients, padded and packed -- and refuses, by name, what it cannot run that way."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import polyexec as px

V, D = 6, 4
T = px.LengthVar("T", min=1, max=16)
B = px.LengthVar("B", max=8)
PARAMS = {"embed": np.random.default_rng(0).normal(size=(V, D)).astype(np.float32),
          "out": np.random.default_rng(1).normal(size=(D, V)).astype(np.float32)}
RAGGED = (None, px.Spec("B T", jnp.int32), px.Spec("B", jnp.int32, lengths_of="T"))


def logits_of(params, x):
    return jnp.tanh(params["embed"][x]) @ params["out"]


def optax_losses(params, x):
    return optax.softmax_cross_entropy_with_integer_labels(logits_of(params, x)[:, :-1], x[:, 1:])


def nll_losses(params, x):
    logp = jax.nn.log_softmax(logits_of(params, x))
    return -jnp.take_along_axis(logp[:, :-1], x[:, 1:, None], axis=-1)[..., 0]


def increments(params, x):
    """Each row's running sum of its increments (a value along T - 1 whose export alone needs
    T >= 2: the trace at T >= 1 passes, the lowering fails)."""
    return jnp.cumsum(jnp.diff(logits_of(params, x), axis=1), axis=1)[..., 0]


LOSSES = {"optax cross-entropy": optax_losses, "take_along_axis NLL": nll_losses,
          "cumsum of diff": increments}


def step(losses):
    """The mean next-token loss and its gradient, and each row's summed loss."""
    def mean_loss(params, x):
        return losses(params, x).mean()

    def run(params, x, lengths):
        loss, grads = jax.value_and_grad(mean_loss)(params, x)
        return loss, grads, losses(params, x).sum(1)
    return run


def alone(losses, params, rows):
    """Each row run alone at its exact length: the mean over every real next-token pair (a row
    of one token has none; with no pair at all, NaN and a zero gradient, as JAX gives for an
    empty mean), its gradient, and each row's own sum."""
    def mean(params):
        return jnp.concatenate([losses(params, r[None]).ravel() for r in rows]).mean()
    # Under jax.jit: one program (and one a row length), not every op compiled alone.
    value, grads = jax.jit(jax.value_and_grad(mean))(params)
    return value, grads, np.array([_jitted(losses)(params, r[None]).sum() for r in rows])


@functools.cache
def _jitted(fn):
    return jax.jit(fn)


def batch(lengths, seed=0):
    """Tokens padded with real-looking tokens (a padding cell that leaks shows)."""
    x = np.random.default_rng(seed).integers(0, V, size=(len(lengths), max(lengths)))
    return x.astype(np.int32), [x[b, :n] for b, n in enumerate(lengths)]


def assert_exact(got, want):
    for have, expected in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(have), np.asarray(expected), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("layout", ["pad", "pack"])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_the_next_token_loss_at_min_1_is_each_rows_own_in_both_layouts(name, layout):
    """Rows of 1 and 2 tokens among longer ones: a row of one token adds no pair to the mean
    and sums to 0, as it does alone. One program for every bucket (two Python traces, once:
    the first at T >= 1 fails on JAX's rule, the second at T >= 2), no warning."""
    f = px.bucketed(step(LOSSES[name]), in_specs=RAGGED, buckets={T: [1, 4, 16]}, layout=layout)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for lengths, seed in [([5, 1, 2, 1, 3], 0), ([1, 1], 1), ([12, 2, 1], 2)]:
            x, rows = batch(lengths, seed)
            assert_exact(f(PARAMS, x, np.array(lengths, np.int32)),
                         alone(LOSSES[name], PARAMS, rows))
    plan = f.plan
    assert not plan.reshaping_is_impossible, plan.reason
    assert plan.padding_safe, plan.padding_reason
    assert plan.can_pack == (layout == "pack"), plan.packing_reason
    raised = plan.raised_mins["T"]
    assert (raised.declared, raised.min) == (1, 2)
    assert "'T - 1' >= '1'" in raised.comparison
    assert "test_min_one.py" in raised.where or name == "cumsum of diff"   # JAX's lowering
    assert "T traced at T >= 2 (declared min=1)" in plan.describe()
    # The buckets start where the program was traced: a batch of one-token rows runs at 4.
    assert f.bucket_sizes("T", plan) == (4, 16)
    assert f.traces == 2


def test_an_unragged_size_below_the_raised_min_is_refused_naming_the_line(tmp_path):
    """Without lengths every row is as long as the array: at T = 1 that is below what the
    program was traced for, so the call is refused before compiling, saying what to do; from
    T = 2 up it is exact."""
    def loss(params, x):
        return optax_losses(params, x).mean()

    f = px.bucketed(loss, in_specs=(None, px.Spec("B T", jnp.int32)), buckets={T: [4, 16]})
    x, _ = batch([3, 3])
    np.testing.assert_allclose(f(PARAMS, x), loss(PARAMS, x), rtol=2e-6)
    with px.forbid_compiles(), pytest.raises(px.SpecError) as info:
        f(PARAMS, x[:, :1])
    message = str(info.value)
    assert message.startswith("args[1].shape[1] = 1: expected T >= 2 for this function "
                              "(declared min=1): "), message
    assert "test_min_one.py" in message and "'T - 1' >= '1'" in message
    assert "lengths_of='T'" in message and "px.LengthVar('T', min=2, ...)" in message
    # A saved plan keeps the raised min: loaded, it refuses the same call the same way.
    path = tmp_path / "loss.plan"
    f.plan.save(path)
    loaded, weights = px.bucketed(px.Plan.load(path)), jax.tree_util.tree_leaves(PARAMS)
    np.testing.assert_allclose(loaded(*weights, x), loss(PARAMS, x), rtol=2e-6)
    with pytest.raises(px.SpecError) as info:
        loaded(*weights, x[:, :1])
    assert message.split(": ", 1)[1] == str(info.value).split(": ", 1)[1]


def test_a_branch_that_the_raised_min_alone_decides_stays_reshaping_impossible():
    """``x.shape[1] == 1`` is undecidable at T >= 1 and False at T >= 2: traced at the raised
    min, a row of one token would take the branch of the longer rows. The plan says so,
    naming that line, and runs retraced per bucket as before."""
    def loss(params, x, lengths):
        if x.shape[1] == 1:
            return jnp.float32(0.0)
        return optax_losses(params, x).mean()

    plan = px.trace(loss, PARAMS, *RAGGED[1:])
    assert plan.reshaping_is_impossible
    assert "'T - 1' >= '1'" in plan.reason
    assert "traced again at T >= 2" in plan.reason
    assert "`T == 1` is decided only at T >= 2" in plan.reason and "x.shape[1] == 1" in plan.reason


def test_a_min_further_up_than_polyexec_raises_is_named_in_the_verdict():
    """The loss past the first ten tokens needs T >= 11 for JAX: too far to raise unasked
    (rows that short would be the common case), so the plan stays reshaping-impossible and
    says what to declare."""
    def loss(params, x, lengths):
        logp = jax.nn.log_softmax(logits_of(params, x))
        return -jnp.take_along_axis(logp[:, 10:], x[:, 10:, None], axis=-1).mean()

    plan = px.trace(loss, PARAMS, *RAGGED[1:])
    assert plan.reshaping_is_impossible
    assert "'- min(T, 10) + T' >= '1' is inconclusive; it holds from T = 11 up" in plan.reason
    assert "declare px.LengthVar('T', min=11, ...)" in plan.reason


@pytest.mark.parametrize("layout", ["pad", "pack"])
def test_neighbours_stacked_from_slices_at_min_1_are_each_rows_own(layout):
    """``jnp.stack([r[:-2], r[1:-1], r[2:]])`` at ``T >= 1``: JAX writes the slices' sizes
    as ``max(0, T - 2)`` and ``- min(T, 2) + T``, which it finds unequal, though both are
    ``T - 2`` from ``T >= 2``. polyexec traces there; a row of one token gets no triple, as
    alone (values and gradients, rows padded with NaN)."""
    def triples(r):
        return jnp.stack([r[:-2], r[1:-1], r[2:]]).mean(0) @ PARAMS["embed"][:D, :D]

    def run(x, lengths):
        return jax.value_and_grad(lambda x: jnp.sum(jnp.sin(jax.vmap(triples)(x))))(x)

    t = px.LengthVar("T", min=1, max=16)
    f = px.bucketed(run, in_specs=(px.Spec((B, t, D), jnp.float32),
                                   px.Spec((B,), jnp.int32, lengths_of="T")),
                    buckets={t: [16]}, layout=layout, strict=True)
    lengths = [5, 1, 2, 4]
    x = np.full((len(lengths), 5, D), np.nan, np.float32)
    for b, n in enumerate(lengths):
        x[b, :n] = np.random.default_rng(b).normal(size=(n, D))
    value, grad = f(x, np.asarray(lengths, np.int32))
    want = [_jitted(run)(jnp.asarray(x[b:b + 1, :n]), None) for b, n in enumerate(lengths)]
    np.testing.assert_allclose(value, sum(v for v, _ in want), rtol=1e-5)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(grad[b, :n], want[b][1][0], rtol=1e-5, atol=1e-6)
    raised = f.plan.raised_mins["T"]
    assert (raised.declared, raised.min) == (1, 2) and "test_min_one.py" in raised.where
    assert "max(0, T - 2)" in raised.comparison
