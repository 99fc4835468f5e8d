"""Random draws shaped by a length (dropout: ``jax.random.bernoulli(key, p, x.shape)``,
``eqx.nn.Dropout``, ``uniform``/``normal`` of ``x.shape``) are layout-invariant (DESIGN.md): a
real cell's draw depends on the key and its coordinates, never on the bucket, the padded rows
or its neighbours; so the same example gets the same mask, outputs and gradients in any bucket,
and in packed rows, where a cell draws by its sequence's index in the call and its position."""

import functools
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

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


def test_ragged_rows_draw_the_same_padded_or_packed():
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
    # Packed rows: each cell draws by its sequence's index in the call and its position, so
    # the same mask, whichever row and column it is packed at.
    for layout in ("pack", "auto"):
        packed = ragged(layout)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            packed_sums, packed_kept = packed(key, TOKENS, LENGTHS)
        assert packed.plan.can_pack, packed.plan.packing_reason
        np.testing.assert_allclose(packed_sums, want_sums, rtol=1e-6)
        for row, n in enumerate(LENGTHS):
            np.testing.assert_array_equal(packed_kept[row, :n], want_kept[row, :n])


# Eight sequences, the longest 9: packed into fewer rows of 16 than there are sequences, so
# most sequences start mid-row (their column is not their position) and share a row.
PACK_LENGTHS = np.array([9, 3, 6, 1, 5, 8, 2, 7], np.int32)
PACK_X = np.random.default_rng(3).normal(size=(8, 9, F)).astype(np.float32)


def _ragged_step(loss, layout, t, **kw):
    T = px.LengthVar("T", max=64)
    B = px.LengthVar("B", max=64)
    return px.bucketed(lambda key, w, x, lengths: jax.value_and_grad(loss, argnums=(0, 2))(
        w, key, x), in_specs=(None, None, px.Spec("B T 3", jnp.float32),
                              px.Spec("B", jnp.int32, lengths_of="T")),
        buckets={T: list(t), B: [2, 4, 8, 16]}, layout=layout, **kw)


def attention_dropout(w, key, x):           # x: (B, T, F); weights (B, T, T) dropped
    h = jnp.tanh(x * w)
    weights = jax.nn.softmax(jnp.einsum("btf,bsf->bts", h, h), axis=-1)
    keep = jax.random.bernoulli(key, 0.7, weights.shape)
    return jnp.sum(jnp.einsum("bts,bsf->btf", jnp.where(keep, weights, 0.0) / 0.7, h) ** 2)


def shifted_dropout(w, key, x):             # a draw along ``T - 1`` of a sliced value
    h = jnp.tanh(x * w)[:, 1:] * x[:, :-1]
    return jnp.sum(eqx.nn.Dropout(0.5)(h, key=key) ** 2)


def two_keys_dropout(w, key, x):            # a batch of two keys, each its own mask
    h = jnp.tanh(x * w)
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 0.5, h.shape))(jax.random.split(key))
    return jnp.sum(jnp.where(keep, h, 0.0) ** 2)


def sequence_noise(w, key, x):              # a (B, F) draw: one per sequence, no length axis
    noise = jax.random.normal(key, (x.shape[0], F))
    return jnp.sum(jnp.tanh(jnp.mean(x, axis=1) * w) * noise)


def shared_along_t_dropout(w, key, x):      # a (B, 1, F) mask: per sequence, shared along T
    keep = jax.random.bernoulli(key, 0.5, (x.shape[0], 1, F))
    return jnp.sum(jnp.where(keep, jnp.tanh(x * w), 0.0) ** 2)


# Padded at two buckets for the plain dropouts; the others once padded (the pad layout's own
# bucket invariance is tested above), to keep the file fast.
@pytest.mark.parametrize("loss, pad_buckets", [
    (where_dropout, ([16], [32])), (eqx_dropout, ([16], [32])), (attention_dropout, ([16],)),
    (shifted_dropout, ([16],)), (two_keys_dropout, ([16],)), (sequence_noise, ([16], [32])),
    (shared_along_t_dropout, ([16],))])
def test_packed_dropout_outputs_and_gradients_equal_the_padded_ones_in_any_bucket(
        loss, pad_buckets):
    key = jax.random.key(7)
    runs = {}
    for name, layout, t in ([(f"pad{t[0]}", "pad", t) for t in pad_buckets]
                            + [("pack", "pack", [16])]):
        f = _ragged_step(loss, layout, t, strict=True)
        value, (gw, gx) = f(key, W, PACK_X, PACK_LENGTHS)
        runs[name] = (float(value), float(gw), np.asarray(gx))
        assert f.plan.padding_safe, f.plan.padding_reason
    assert f.plan.can_pack, f.plan.packing_reason
    ((rows, n_rows), (_, row_length)), = f.stats.buckets.keys()
    assert rows == "rows(B)" and n_rows < len(PACK_LENGTHS) and row_length == 16
    want = runs["pad16"]
    for name, (value, gw, gx) in runs.items():
        np.testing.assert_allclose(value, want[0], rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(gw, want[1], rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(gx, want[2], rtol=1e-6, atol=1e-6, err_msg=name)
    # The draw matters: another key, another packed value.
    other, _ = f(jax.random.key(8), W, PACK_X, PACK_LENGTHS)
    assert abs(float(other) - want[0]) > 1e-3 * abs(want[0])


def test_a_packed_cell_draws_from_the_key_folded_with_its_sequence_and_position():
    """Cell (r, c) holding position t of the call's row b: ``random_bits(fold_in(fold_in(key,
    b), t), (F,))``, the pad layout's cell (b, t); a program without a draw along the rows does
    not take the sequence index at all."""
    key = jax.random.key(5)
    T = px.LengthVar("T", max=64)
    B = px.LengthVar("B", max=64)
    specs = (None, px.Spec("B T 3", jnp.float32), px.Spec("B", jnp.int32, lengths_of="T"))
    f = px.bucketed(lambda key, x, lengths: jax.random.bits(key, x.shape), specs,
                    buckets={T: [16], B: [2, 4]}, layout="pack", strict=True)
    got = np.asarray(f(key, PACK_X, PACK_LENGTHS))
    assert f.plan.segments[0].program("pack").reads_sequence

    def cell(b, t):
        return jax.random.bits(jax.random.fold_in(jax.random.fold_in(key, b), t), (F,))
    for b, n in enumerate(PACK_LENGTHS):
        want = jax.vmap(lambda t: cell(b, t))(jnp.arange(n))
        np.testing.assert_array_equal(got[b, :n], np.asarray(want))
    no_draw = px.bucketed(lambda key, x, lengths: x * 2, specs, buckets={T: [16], B: [2, 4]},
                          layout="pack", strict=True)
    doubled = np.asarray(no_draw(key, PACK_X, PACK_LENGTHS))
    for b, n in enumerate(PACK_LENGTHS):
        np.testing.assert_array_equal(doubled[b, :n], PACK_X[b, :n] * 2)
    program = no_draw.plan.segments[0].program("pack")
    assert not program.reads_sequence
    assert len(program.exported.in_avals) == len(no_draw.plan.segments[0].convention.slots) + 2


@functools.cache
def _bits_and_sums(layout):
    T = px.LengthVar("T", min=1, max=16)
    B = px.LengthVar("B", max=8)
    return px.bucketed(lambda key, x, lengths: (jax.random.bits(key, x.shape), jnp.sum(x, 1)),
                       (None, px.Spec("B T 3", jnp.float32),
                        px.Spec("B", jnp.int32, lengths_of="T")),
                       buckets={T: [16], B: [8]}, layout=layout, strict=True)


@given(st.lists(st.integers(0, 16), min_size=1, max_size=8), st.integers(0, 2**31 - 1))
def test_any_packing_draws_the_padded_bits_at_every_real_cell(lengths, seed):
    """Whatever the lengths (empty sequences, which hold a cell for their sums, included) and
    so wherever first-fit packs each sequence, its cells draw the pad layout's bits."""
    lengths = np.asarray(lengths, np.int32)
    x = np.ones((len(lengths), 16, F), np.float32)
    key = jax.random.key(seed)
    (want, want_sums), (got, got_sums) = (_bits_and_sums(layout)(key, x, lengths)
                                          for layout in ("pad", "pack"))
    assert _bits_and_sums("pack").plan.can_pack
    np.testing.assert_array_equal(got_sums, want_sums)
    for b, n in enumerate(lengths):
        np.testing.assert_array_equal(np.asarray(got)[b, :n], np.asarray(want)[b, :n])


def test_a_saved_dropout_plan_runs_and_draws_what_the_packed_call_draws(tmp_path):
    """A plan file holds the padded program (a packed one is not saved): loaded without the
    Python code, it draws the mask the packed call draws."""
    key = jax.random.key(9)
    f = ragged("pack")
    packed_sums, packed_kept = f(key, TOKENS, LENGTHS)
    assert f.plan.can_pack, f.plan.packing_reason
    f.plan.save(tmp_path / "dropout.plan")
    loaded = px.bucketed(px.Plan.load(tmp_path / "dropout.plan"))
    sums, kept = loaded(jax.random.key_data(key), TOKENS, LENGTHS)
    np.testing.assert_allclose(sums, packed_sums, rtol=1e-6)
    for row, n in enumerate(LENGTHS):
        np.testing.assert_array_equal(kept[row, :n], packed_kept[row, :n])


def per_sequence_noise(key, x, lengths):     # a (B, F) draw: one per sequence, no length axis
    noise = jax.random.normal(key, (x.shape[0], F))
    return jnp.sum(x, axis=1) * noise, noise


def test_a_per_sequence_draw_packs_as_each_rows_padded_draw():
    """A draw along the rows alone (``(B, F)``: per sequence) draws by the sequence's index in
    the call: row b's ``normal(fold_in(key, b), (F,))`` in any bucket, padded or packed
    wherever first-fit puts it (the padding is NaN: nothing reads it)."""
    T = px.LengthVar("T", max=64)
    B = px.LengthVar("B", max=64)
    specs = (None, px.Spec("B T 3", jnp.float32), px.Spec("B", jnp.int32, lengths_of="T"))
    x = np.where(np.arange(PACK_X.shape[1])[None, :, None] < PACK_LENGTHS[:, None, None],
                 PACK_X, np.nan).astype(np.float32)
    key = jax.random.key(1)
    runs = {}
    for layout, t in (("pad", [16]), ("pad", [32]), ("pack", [16])):
        f = px.bucketed(per_sequence_noise, specs, buckets={T: t, B: [8]}, layout=layout,
                        strict=True)
        runs[layout, t[0]] = f(key, x, PACK_LENGTHS)
    assert f.plan.can_pack, f.plan.packing_reason
    want_sums, want_noise = runs["pad", 16]
    np.testing.assert_allclose(want_noise, [jax.random.normal(jax.random.fold_in(key, b), (F,))
                                            for b in range(len(PACK_LENGTHS))], rtol=1e-6)
    for sums, noise in runs.values():
        np.testing.assert_array_equal(noise, want_noise)
        np.testing.assert_allclose(sums, want_sums, rtol=1e-6)
    np.testing.assert_allclose(want_sums, [x[b, :n].sum(0) * want_noise[b]
                                           for b, n in enumerate(PACK_LENGTHS)], rtol=1e-5)


@pytest.mark.parametrize("layout", ["pad", "pack"])
def test_the_keep_rate_over_real_cells_is_p(layout):
    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 64, size=96).astype(np.int32)
    x = np.ones((96, lengths.max()), np.float32)
    T = px.LengthVar("T", max=64)
    B = px.LengthVar("B", max=128)
    f = px.bucketed(lambda key, x, n: jnp.where(jax.random.bernoulli(key, 0.5, x.shape), x, 0.0),
                    in_specs=(None, px.Spec("B T", jnp.float32),
                              px.Spec("B", jnp.int32, lengths_of="T")),
                    buckets={T: [64], B: [128]}, layout=layout, strict=True)
    kept = np.asarray(f(jax.random.key(0), x, lengths))
    assert f.plan.can_pack == (layout == "pack"), f.plan.packing_reason
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
