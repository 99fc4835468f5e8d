"""Random draws shaped by a length (dropout: ``jax.random.bernoulli(key, p, x.shape)``,
``eqx.nn.Dropout``, ``uniform``/``normal`` of ``x.shape``) are layout-invariant (DESIGN.md): a
real cell's draw depends on the key and its coordinates, never on the bucket, the padded rows
or its neighbours; so the same example gets the same mask, outputs and gradients in any bucket.
Packed rows cannot say which sequence a cell belongs to: there the call runs padded."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polyexec as px

F = 3
X = np.random.default_rng(0).normal(size=(3, 10, F)).astype(np.float32)
W = np.float32(0.7)


def where_dropout(w, key, x):              # x: (B, T, F)
    h = jnp.tanh(x * w)
    keep = jax.random.bernoulli(key, 0.5, h.shape)
    return jnp.sum(jnp.where(keep, h, 0.0) ** 2)


def scaled_dropout(w, key, x):
    h = jnp.tanh(x * w)
    keep = jax.random.bernoulli(key, 0.8, h.shape)
    return jnp.sum((h * keep / 0.8) ** 2)


def eqx_dropout(w, key, x):
    return jnp.sum(eqx.nn.Dropout(0.5)(jnp.tanh(x * w), key=key) ** 2)


def step(loss):
    def fn(key, w, x):
        return jax.value_and_grad(loss, argnums=(0, 2))(w, key, x)
    return fn


def bucketed(fn, t, b):
    T = px.LengthVar("T", max=64)
    B = px.LengthVar("B", max=64)
    return px.bucketed(fn, in_specs=(None, None, px.Spec("B T 3", jnp.float32)),
                       buckets={T: t, B: b})


@pytest.mark.parametrize("loss", [where_dropout, scaled_dropout, eqx_dropout])
@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey])
def test_dropout_outputs_and_gradients_do_not_depend_on_the_bucket(loss, make_key):
    key = make_key(3)
    runs = []
    for t, b in (([16], [4]), ([32], [4]), ([16], [8])):    # T padded 10->16/32, B 3->4/8
        f = bucketed(step(loss), t, b)
        value, (gw, gx) = f(key, W, X)
        assert f.plan.padding_safe, f.plan.padding_reason
        assert gx.shape == X.shape
        runs.append((float(value), float(gw), np.asarray(gx)))
    for value, gw, gx in runs[1:]:
        np.testing.assert_allclose(value, runs[0][0], rtol=1e-6)
        np.testing.assert_allclose(gw, runs[0][1], rtol=1e-6)
        np.testing.assert_allclose(gx, runs[0][2], rtol=1e-6, atol=1e-7)
    # Dropout did drop: some real cells' gradients are exactly zero, not all.
    zero = runs[0][2] == 0
    assert zero.any() and not zero.all()


def test_a_cell_draws_from_the_key_folded_with_its_indices_along_the_lengths():
    """The documented draw: cell (b, t, :) is ``random_bits(fold_in(fold_in(key, b), t), (F,))``."""
    key = jax.random.key(5)
    f = bucketed(lambda key, w, x: jax.random.bits(key, x.shape), [16], [4])
    got = np.asarray(f(key, W, X))

    def cell(b, t):
        return jax.random.bits(jax.random.fold_in(jax.random.fold_in(key, b), t), (F,))
    want = jax.vmap(lambda b: jax.vmap(lambda t: cell(b, t))(jnp.arange(10)))(jnp.arange(3))
    np.testing.assert_array_equal(got, np.asarray(want))


LENGTHS = np.array([10, 4, 7, 1], np.int32)
TOKENS = np.random.default_rng(1).normal(size=(4, 10)).astype(np.float32)


def ragged_dropout(key, x, lengths):        # x: (B, T), T ragged along B
    keep = jax.random.bernoulli(key, 0.5, x.shape)
    return jnp.sum(jnp.where(keep, x, 0.0) ** 2, axis=1), jnp.where(keep, x, 0.0)


def ragged(layout, t=(16,)):
    T = px.LengthVar("T", max=64)
    B = px.LengthVar("B", max=64)
    return px.bucketed(ragged_dropout, in_specs=(None, px.Spec("B T", jnp.float32),
                                                 px.Spec("B", jnp.int32, lengths_of="T")),
                       buckets={T: list(t), B: [4, 8]}, layout=layout)


def test_ragged_rows_draw_the_same_padded_or_packed_and_packed_rows_run_padded():
    key = jax.random.key(11)
    pad = ragged("pad")
    want_sums, want_kept = pad(key, TOKENS, LENGTHS)
    assert pad.plan.padding_safe, pad.plan.padding_reason
    got_sums, got_kept = ragged("pad", t=(32,))(key, TOKENS, LENGTHS)
    np.testing.assert_allclose(got_sums, want_sums, rtol=1e-6)
    # Per row, only the real cells count (the rest of each row is "don't care").
    for row, n in enumerate(LENGTHS):
        np.testing.assert_array_equal(got_kept[row, :n], want_kept[row, :n])
        np.testing.assert_allclose(want_sums[row], np.sum(want_kept[row, :n] ** 2), rtol=1e-6)
    # A packed row holds several sequences and knows none's index in the batch: the packed
    # rewrite refuses the draw, naming the line; the call runs padded, with the same results.
    pack = ragged("pack")
    with pytest.warns(UserWarning, match="cannot run packed rows, so it runs one sequence per "
                                         "padded row"):
        packed_sums, _ = pack(key, TOKENS, LENGTHS)
    assert pack.plan.padding_safe, pack.plan.padding_reason
    assert "test_random.py:" in pack.plan.packing_reason
    assert ("random_bits: a random draw along a packed length: its cells would draw by their "
            "packed row, not their sequence") in pack.plan.packing_reason
    np.testing.assert_allclose(packed_sums, want_sums, rtol=1e-6)
    auto = ragged("auto")
    auto_sums, _ = auto(key, TOKENS, LENGTHS)              # silently padded
    np.testing.assert_allclose(auto_sums, want_sums, rtol=1e-6)


def test_the_keep_rate_over_real_cells_is_p():
    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 64, size=96).astype(np.int32)
    x = np.ones((96, lengths.max()), np.float32)
    T = px.LengthVar("T", max=64)
    B = px.LengthVar("B", max=128)
    f = px.bucketed(lambda key, x, n: jnp.where(jax.random.bernoulli(key, 0.5, x.shape), x, 0.0),
                    in_specs=(None, px.Spec("B T", jnp.float32),
                              px.Spec("B", jnp.int32, lengths_of="T")),
                    buckets={T: [64], B: [128]})
    kept = np.asarray(f(jax.random.key(0), x, lengths))
    real = np.arange(lengths.max())[None, :] < lengths[:, None]
    cells = int(real.sum())
    assert cells > 2000
    rate = kept[real].mean()
    assert abs(rate - 0.5) < 4 * np.sqrt(0.25 / cells), (rate, cells)
    # Rows and positions draw apart: no two rows' masks alike over their first 16 cells.
    long = kept[lengths >= 16, :16]
    assert len({row.tobytes() for row in long}) == len(long)


def test_uniform_normal_and_bernoulli_of_a_length_shape_are_padding_safe():
    T = px.LengthVar("T", max=64)
    B = px.LengthVar("B", max=8)
    for draw in (lambda k, s: jax.random.uniform(k, s), lambda k, s: jax.random.normal(k, s),
                 lambda k, s: jax.random.bernoulli(k, 0.5, s)):
        f = px.bucketed(lambda key, x: jnp.sum(jnp.where(draw(key, x.shape), x, 0)),
                        in_specs=(None, px.Spec("B T", jnp.float32)), buckets={T: [16, 32], B: [2]})
        f(jax.random.key(0), np.ones((2, 5), np.float32))
        assert f.plan.padding_safe, f.plan.padding_reason


def test_an_rbg_keys_draw_along_a_length_is_flagged():
    """RBG keys draw a batch of keys by the batch's shape (XLA's RngBitGenerator): no per-cell
    key makes that layout-invariant, so it is flagged, naming the key's implementation."""
    T = px.LengthVar("T", max=64)
    B = px.LengthVar("B", max=8)
    f = px.bucketed(lambda key, x: jnp.where(jax.random.bernoulli(key, 0.5, x.shape), x, 0.0),
                    in_specs=(None, px.Spec("B T", jnp.float32)), buckets={T: [16], B: [2]})
    with pytest.warns(UserWarning, match="not padding-safe"):
        f(jax.random.key(0, impl="rbg"), np.ones((2, 5), np.float32))
    assert not f.plan.padding_safe
    assert "random_bits: a random draw along a length with a 'rbg' key" in f.plan.padding_reason
