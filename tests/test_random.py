"""Random draws shaped by a length (dropout: ``jax.random.bernoulli(key, p, x.shape)``,
``eqx.nn.Dropout``, ``uniform``/``normal`` of ``x.shape``) are JAX's own (DESIGN.md): every real
cell's bits equal, bit for bit, those ``jax.jit`` draws on the exact-size input (each ragged
axis at its longest row), in every bucket and in the padded, ragged and packed layouts -- so
also the same in every bucket and layout. Where that cannot hold, the plan says so by line."""

import functools
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import polyexec as px

F = 2
W = np.float32(0.7)


def draws(key, x):
    """Every way a model draws along a length, from one key: samplers of each bit width, a raw
    ``uint32[2]`` key, ``split``/``fold_in`` keys, a batch of keys under ``vmap``, a draw
    inside ``scan``, the lengths in another order (``(T, B, F)``), and attention's ``(B, T,
    T)``."""
    b, t, f = x.shape
    k1, k2 = jax.random.split(key)

    def per_step(carry, i):
        return carry, jax.random.uniform(jax.random.fold_in(k2, i), x.shape)

    return {
        "bits": jax.random.bits(key, x.shape),
        "normal": jax.random.normal(jax.random.fold_in(key, 3), x.shape),
        "bernoulli": jax.random.bernoulli(k2, 0.3, x.shape),
        "raw key, 16 bits": jax.random.bits(jax.random.key_data(k1), x.shape, jnp.uint16),
        "vmap keys, 8 bits": jax.vmap(lambda k: jax.random.bits(k, x.shape, jnp.uint8))(
            jax.random.split(key, 2)),
        "scan": jax.lax.scan(per_step, 0, jnp.arange(2))[1],
        "T B F": jax.random.bits(k2, (t, b, f)),
        "B T T": jax.random.uniform(key, (b, t, t)),
    }


def comparable(out):
    """The draws as each layout returns them: ``(B, ...)`` outputs, and of the pairs draw
    each cell's largest pair within its row (a packed row returns no ``(B, T, T)`` value)."""
    out = dict(out)
    out["T B F"] = jnp.swapaxes(out["T B F"], 0, 1)
    out["B T T"] = jnp.max(out["B T T"], axis=2)
    return out


def real_cells(name, out, b, n):
    """Row b's real cells (n of them) of an output; the pairs draw reduced over them here."""
    if name in ("vmap keys, 8 bits", "scan"):
        return out[:, b, :n]
    if name == "B T T" and out.ndim == 3:           # jax.jit's own draw
        return out[b, :n, :n].max(axis=1, initial=-np.inf)
    return out[b, :n]


@functools.cache
def bucketed_draws(layout):
    T = px.LengthVar("T", max=16)
    B = px.LengthVar("B", max=8)
    x_spec = px.Spec("B T 2", jnp.float32)
    if layout == "pad":         # no lengths: every row real up to T
        return px.bucketed(lambda key, x: comparable(draws(key, x)), (None, x_spec),
                           buckets={T: [8, 16], B: [8]}, strict=True)
    return px.bucketed(lambda key, x, lengths: comparable(draws(key, x)),
                       (None, x_spec, px.Spec("B", jnp.int32, lengths_of="T")),
                       buckets={T: [8, 16], B: [8]},
                       layout="pad" if layout == "ragged" else "pack", strict=True)


@functools.cache
def jit_draws():
    return jax.jit(draws)


@st.composite
def batches(draw):
    """Lengths of a batch whose exact size is one of three (jax.jit's reference compiles once
    for each, about 2 s here), so hypothesis varies the other rows' lengths and the keys."""
    rows, longest = draw(st.sampled_from([(2, 3), (5, 9), (3, 16)]))
    lengths = draw(st.lists(st.integers(0, longest), min_size=rows, max_size=rows))
    lengths[draw(st.integers(0, rows - 1))] = longest
    return lengths


@pytest.mark.parametrize("layout", ["pad", "ragged", "pack"])
@settings(max_examples=8)
@given(lengths=batches(), seed=st.integers(0, 2**32 - 1), typed=st.booleans())
def test_every_real_cell_draws_what_jax_jit_draws_on_the_exact_size_input(
        layout, lengths, seed, typed):
    """Bit for bit, each sampler and key form, in any bucket (T padded to 8 or 16; packed
    rows wherever first-fit puts each sequence; empty rows included). The padding is NaN: no
    draw reads it."""
    lengths = np.asarray(lengths, np.int32)
    if layout == "pad":
        lengths[:] = lengths.max()
    longest = int(lengths.max())
    x = np.full((len(lengths), longest, F), np.nan, np.float32)
    key = jax.random.key(seed) if typed else jax.random.PRNGKey(seed)
    f = bucketed_draws(layout)
    got = f(key, x) if layout == "pad" else f(key, x, lengths)
    if layout == "pack":
        assert f.plan.can_pack, f.plan.packing_reason
    want = jit_draws()(jax.random.key(seed), x)     # a raw key wraps to this typed one
    want["T B F"] = jnp.swapaxes(want["T B F"], 0, 1)
    assert set(got) == set(want)
    for name in want:
        for b, n in enumerate(lengths):
            np.testing.assert_array_equal(real_cells(name, np.asarray(got[name]), b, n),
                                          real_cells(name, np.asarray(want[name]), b, n),
                                          err_msg=f"{name}, row {b} of {lengths}")


def test_the_issues_dropout_equals_jax_jit_with_no_warning():
    """The example that broke: a ``(T, 4)`` dropout mean at T = 7, and a ``(B, T)`` keep count
    per row with lengths [5, 3, 7], padded and packed."""
    def mean_dropout(x):
        keep = jax.random.bernoulli(jax.random.PRNGKey(0), 0.8, x.shape)
        return jnp.where(keep, x / 0.8, 0.0).mean(0)

    T = px.LengthVar("T", max=64)
    x = np.random.default_rng(0).normal(size=(7, 4)).astype(np.float32)
    f = px.bucketed(mean_dropout, in_specs=(px.Spec("T 4", jnp.float32),), buckets={T: [16]},
                    strict=True)
    np.testing.assert_array_equal(f(x), jax.jit(mean_dropout)(x))

    B = px.LengthVar("B", max=8)
    lengths = np.array([5, 3, 7], np.int32)
    ones = np.ones((3, 7), np.float32)
    key = jax.random.key(0)
    want = np.asarray(jax.jit(lambda k, x: jnp.where(jax.random.bernoulli(k, 0.5, x.shape),
                                                     x, 0))(key, ones))
    for layout in ("pad", "pack"):
        kept = px.bucketed(
            lambda key, x, n: jnp.where(jax.random.bernoulli(key, 0.5, x.shape), x, 0).sum(1),
            in_specs=(None, px.Spec("B T", jnp.float32), px.Spec("B", jnp.int32, lengths_of="T")),
            buckets={T: [16], B: [4]}, layout=layout, strict=True)
        np.testing.assert_array_equal(kept(key, ones, lengths),
                                      [want[b, :n].sum() for b, n in enumerate(lengths)])


def where_dropout(w, key, x):              # x: (B, T, F)
    h = jnp.tanh(x * w)
    keep = jax.random.bernoulli(key, 0.5, h.shape)
    return jnp.sum(jnp.where(keep, h, 0.0) ** 2)


def eqx_dropout(w, key, x):
    return jnp.sum(eqx.nn.Dropout(0.5)(jnp.tanh(x * w), key=key) ** 2)


def attention_dropout(w, key, x, real=None):    # x: (B, T, F); weights (B, T, T) dropped
    h = jnp.tanh(x * w)
    scores = jnp.einsum("btf,bsf->bts", h, h)
    if real is not None:        # jax.jit's reference masks the keys past each row's end
        scores = jnp.where(real[:, None, :, 0], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    keep = jax.random.bernoulli(key, 0.7, weights.shape)
    out = jnp.einsum("bts,bsf->btf", jnp.where(keep, weights, 0.0) / 0.7, h)
    return jnp.sum(out ** 2 if real is None else jnp.where(real, out, 0.0) ** 2)


def shifted_dropout(w, key, x):             # a draw along ``T - 1`` of a sliced value
    h = jnp.tanh(x * w)[:, 1:] * x[:, :-1]
    return jnp.sum(eqx.nn.Dropout(0.5)(h, key=key) ** 2)


def two_keys_dropout(w, key, x):            # a batch of two keys, each its own mask
    h = jnp.tanh(x * w)
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 0.5, h.shape))(jax.random.split(key))
    return jnp.sum(jnp.where(keep, h, 0.0) ** 2)


def sequence_noise(w, key, x):              # a (B, F) draw: one per sequence, no length axis
    noise = jax.random.normal(key, (x.shape[0], x.shape[2]))
    return jnp.sum(jnp.tanh(jnp.sum(x, axis=1) * w) * noise)


def shared_along_t_dropout(w, key, x):      # a (B, 1, F) mask: per sequence, shared along T
    keep = jax.random.bernoulli(key, 0.5, (x.shape[0], 1, x.shape[2]))
    return jnp.sum(jnp.where(keep, jnp.tanh(x * w), 0.0) ** 2)


# Eight sequences, the longest 9: packed into fewer rows of 16 than there are sequences, so
# most sequences start mid-row (their column is not their position) and share a row.
PACK_LENGTHS = np.array([9, 3, 6, 1, 5, 8, 2, 7], np.int32)
REAL = np.arange(9)[None, :, None] < PACK_LENGTHS[:, None, None]
PACK_X = np.where(REAL, np.random.default_rng(3).normal(size=(8, 9, 3)), 0).astype(np.float32)


def step(loss):
    return lambda key, w, x: jax.value_and_grad(loss, argnums=(0, 2))(w, key, x)


@pytest.mark.parametrize("loss", [where_dropout, eqx_dropout, attention_dropout,
                                  shifted_dropout, two_keys_dropout, sequence_noise,
                                  shared_along_t_dropout])
def test_dropout_values_and_gradients_equal_jax_jit_padded_and_packed(loss):
    """Each loss and its gradients, ragged rows padded and packed, equal ``jax.jit`` on the
    exact-size batch (zeros past each row's end add nothing there; attention masks them by
    hand) while polyexec is handed NaN there: the masks are jax.jit's, cell for cell."""
    key = jax.random.key(7)
    reference = functools.partial(attention_dropout, real=REAL) if loss is attention_dropout \
        else loss
    want_value, (want_gw, want_gx) = jax.jit(step(reference))(key, W, PACK_X)
    nan_padded = np.where(REAL, PACK_X, np.nan).astype(np.float32)
    T = px.LengthVar("T", max=64)
    B = px.LengthVar("B", max=64)
    for layout in ("pad", "pack"):
        f = px.bucketed(lambda key, w, x, lengths: step(loss)(key, w, x),
                        in_specs=(None, None, px.Spec("B T 3", jnp.float32),
                                  px.Spec("B", jnp.int32, lengths_of="T")),
                        buckets={T: [16], B: [2, 4, 8, 16]}, layout=layout, strict=True)
        value, (gw, gx) = f(key, W, nan_padded, PACK_LENGTHS)
        if layout == "pack":
            assert f.plan.can_pack, f.plan.packing_reason
            ((rows, n_rows), _), = f.stats.buckets.keys()
            assert rows == "rows(B)" and n_rows < len(PACK_LENGTHS)
        np.testing.assert_allclose(value, want_value, rtol=1e-5, err_msg=layout)
        np.testing.assert_allclose(gw, want_gw, rtol=1e-5, err_msg=layout)
        np.testing.assert_allclose(np.where(REAL, gx, 0), np.where(REAL, want_gx, 0),
                                   rtol=1e-5, atol=1e-6,
                                   err_msg=layout)


def test_a_packed_program_takes_the_sequence_index_only_when_it_draws_along_the_rows():
    T = px.LengthVar("T", max=64)
    B = px.LengthVar("B", max=64)
    specs = (None, px.Spec("B T 3", jnp.float32), px.Spec("B", jnp.int32, lengths_of="T"))
    draw = px.bucketed(lambda key, x, lengths: jax.random.bits(key, x.shape), specs,
                       buckets={T: [16], B: [2, 4]}, layout="pack", strict=True)
    draw(jax.random.key(5), PACK_X, PACK_LENGTHS)
    assert draw.plan.segments[0].program("pack").reads_sequence
    no_draw = px.bucketed(lambda key, x, lengths: x * 2, specs, buckets={T: [16], B: [2, 4]},
                          layout="pack", strict=True)
    doubled = np.asarray(no_draw(jax.random.key(5), PACK_X, PACK_LENGTHS))
    for b, n in enumerate(PACK_LENGTHS):
        np.testing.assert_array_equal(doubled[b, :n], PACK_X[b, :n] * 2)
    program = no_draw.plan.segments[0].program("pack")
    assert not program.reads_sequence
    assert len(program.exported.in_avals) == len(no_draw.plan.segments[0].convention.slots) + 2


LENGTHS = np.array([10, 4, 7, 1], np.int32)
TOKENS = np.random.default_rng(1).normal(size=(4, 10)).astype(np.float32)


def ragged_dropout(key, x, lengths):        # x: (B, T), T ragged along B
    keep = jax.random.bernoulli(key, 0.5, x.shape)
    return jnp.sum(jnp.where(keep, x, 0.0) ** 2, axis=1), jnp.where(keep, x, 0.0)


def test_a_saved_dropout_plan_runs_and_draws_what_the_packed_call_draws(tmp_path):
    """A plan file holds the padded program (a packed one is not saved): loaded without the
    Python code, it draws the mask the packed call draws."""
    key = jax.random.key(9)
    T = px.LengthVar("T", max=64)
    B = px.LengthVar("B", max=64)
    f = px.bucketed(ragged_dropout, in_specs=(None, px.Spec("B T", jnp.float32),
                                              px.Spec("B", jnp.int32, lengths_of="T")),
                    buckets={T: [16], B: [4, 8]}, layout="pack")
    packed_sums, packed_kept = f(key, TOKENS, LENGTHS)
    assert f.plan.can_pack, f.plan.packing_reason
    f.plan.save(tmp_path / "dropout.plan")
    loaded = px.bucketed(px.Plan.load(tmp_path / "dropout.plan"))
    sums, kept = loaded(jax.random.key_data(key), TOKENS, LENGTHS)
    np.testing.assert_allclose(sums, packed_sums, rtol=1e-6)
    for row, n in enumerate(LENGTHS):
        np.testing.assert_array_equal(kept[row, :n], packed_kept[row, :n])


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


def keep_mask(key, x):
    return jnp.where(jax.random.bernoulli(key, 0.5, x.shape), x, 0.0)


def test_an_rbg_keys_draw_along_a_length_is_flagged_by_line():
    """RBG keys draw by the whole shape (XLA's RngBitGenerator): the bucket changes a real
    cell's bits, so the plan says so, naming the user's line, and strict mode raises."""
    T = px.LengthVar("T", max=64)
    B = px.LengthVar("B", max=8)
    specs = (None, px.Spec("B T", jnp.float32))
    f = px.bucketed(keep_mask, in_specs=specs, buckets={T: [16], B: [2]})
    with pytest.warns(UserWarning, match="not padding-safe"):
        f(jax.random.key(0, impl="rbg"), np.ones((2, 5), np.float32))
    assert "test_random.py" in f.plan.padding_reason and "'rbg'" in f.plan.padding_reason
    strict = px.bucketed(keep_mask, in_specs=specs, buckets={T: [16], B: [2]}, strict=True)
    with pytest.raises(px.PolymorphismError, match="rbg"):
        strict(jax.random.key(0, impl="rbg"), np.ones((2, 5), np.float32))


def test_a_draw_with_partitionable_threefry_off_is_flagged_by_line():
    """Without ``jax_threefry_partitionable`` every cell's bits depend on the whole shape's
    size, even a ``(T, F)`` draw: flagged, never other draws without a word."""
    T = px.LengthVar("T", max=64)
    with jax.threefry_partitionable(False):
        f = px.bucketed(keep_mask, in_specs=(None, px.Spec("T 3", jnp.float32)),
                        buckets={T: [16]})
        with pytest.warns(UserWarning, match="not padding-safe"):
            f(jax.random.key(0), np.ones((5, 3), np.float32))
        assert "jax_threefry_partitionable" in f.plan.padding_reason
        assert "test_random.py" in f.plan.padding_reason
    with warnings.catch_warnings():         # on again (the default): exact, no warning
        warnings.simplefilter("error")
        g = px.bucketed(keep_mask, in_specs=(None, px.Spec("T 3", jnp.float32)),
                        buckets={T: [16]}, strict=True)
        x = np.ones((5, 3), np.float32)
        np.testing.assert_array_equal(g(jax.random.key(0), x),
                                      jax.jit(keep_mask)(jax.random.key(0), x))


def test_a_draw_along_ragged_rows_counted_together_is_flagged_and_an_unragged_one_is_exact():
    """Along ``B*T`` (``x.reshape(-1, F)``) the real cells of ragged rows lie end to end, where
    jax.jit's exact-size draw spaces them by the longest row: flagged by line (it was exact by
    no contract). Unragged, ``B*T`` is row-major at the real sizes: jax.jit's own bits."""
    def flat_dropout(key, x, *lengths):
        b, t, f = x.shape
        flat = x.reshape(b * t, f)
        return jnp.sum(jnp.where(jax.random.bernoulli(key, 0.5, flat.shape), flat, 0.0), 0)

    def flat_bits(key, x):
        b, t, f = x.shape
        return jax.random.bits(key, (b * t, f)).reshape(b, t, f)

    T = px.LengthVar("T", max=16)
    B = px.LengthVar("B", max=8)
    x = np.ones((3, 7, F), np.float32)
    ragged = px.bucketed(flat_dropout, (None, px.Spec("B T 2", jnp.float32),
                                        px.Spec("B", jnp.int32, lengths_of="T")),
                         buckets={T: [8], B: [4]}, strict=True)
    with pytest.raises(px.PolymorphismError, match="random_bits: a random draw along B\\*T"):
        ragged(jax.random.key(1), x, np.array([5, 3, 7], np.int32))
    unragged = px.bucketed(flat_bits, (None, px.Spec("B T 2", jnp.float32)),
                           buckets={T: [8], B: [4]}, strict=True)
    np.testing.assert_array_equal(unragged(jax.random.key(1), x),
                                  jax.jit(flat_bits)(jax.random.key(1), x))


KEY_FORMS = {
    # a key per position, folded in or split off (flat index t in (T,): a prefix in any bucket)
    "fold_in(key, t)": lambda key, x, k: x[..., 0] + jax.vmap(
        lambda t: jax.random.uniform(jax.random.fold_in(key, t)))(jnp.arange(x.shape[1])),
    "split(key, T)": lambda key, x, k: x[..., 0] + jax.vmap(jax.random.uniform)(
        jax.random.split(key, x.shape[1])),
    # a key per row: each row's draw along its own length
    "fold_in(key, k[b])": lambda key, x, k: jax.vmap(
        lambda r, kb: r + jax.random.uniform(jax.random.fold_in(key, kb), r.shape))(x, k),
    "fold_in(key, k[b]), (2, T)": lambda key, x, k: jax.vmap(lambda r, kb: r + jax.random.uniform(
        jax.random.fold_in(key, kb), r.shape[::-1]).T)(x, k),
    "split(key, B)": lambda key, x, k: jax.vmap(
        lambda r, kb: r + jax.random.uniform(kb, r.shape))(x, jax.random.split(key, x.shape[0])),
}


@pytest.mark.parametrize("layout", ["pad", "pack"])
@pytest.mark.parametrize("name", list(KEY_FORMS))
def test_keys_made_per_position_or_per_row_draw_what_jax_jit_draws(name, layout):
    """Key arrays (``fold_in``, ``split``, ``wrap``) are made key by key, so a key per
    position of a length or per row is the same key in every bucket, and its draws are
    ``jax.jit``'s on the exact-size input. They were flagged as not padding-safe. Packed, a
    sequence's key draws at each cell of it what its padded row draws there."""
    draw = KEY_FORMS[name]
    lengths = np.array([5, 2, 7], np.int32)
    x = np.where(np.arange(7)[None, :, None] < lengths[:, None, None], np.ones((1, 1, 2)),
                 np.nan).astype(np.float32)
    k = np.array([3, 11, 4], np.int32)
    T, B = px.LengthVar("T", max=16), px.LengthVar("B", max=8)
    f = px.bucketed(lambda key, x, k, lengths: draw(key, x, k),
                    (None, px.Spec("B T 2", jnp.float32), px.Spec("B", jnp.int32),
                     px.Spec("B", jnp.int32, lengths_of="T")), buckets={T: [16], B: [4]},
                    layout=layout, strict=True)
    got = np.asarray(f(jax.random.key(2), x, k, lengths))
    assert f.plan.can_pack or layout == "pad", f.plan.packing_reason
    want = np.asarray(jax.jit(draw)(jax.random.key(2), x, k))   # uniform: bits, no rounding
    for b, n in enumerate(lengths):
        np.testing.assert_array_equal(got[b, :n], want[b, :n], err_msg=f"row {b}")


def test_a_split_into_keys_along_a_later_length_is_flagged_by_line():
    """``split(key, (B, T))`` numbers its keys row-major over the bucket's T: refused."""
    def draw(key, x):
        keys = jax.random.split(key, x.shape[:2])
        return x[..., 0] + jax.vmap(jax.vmap(jax.random.normal))(keys)
    T, B = px.LengthVar("T", max=16), px.LengthVar("B", max=8)
    f = px.bucketed(draw, (None, px.Spec("B T 2", jnp.float32)), buckets={T: [16], B: [4]},
                    strict=True)
    with pytest.raises(px.PolymorphismError, match="random_split: a split of a key into"):
        f(jax.random.key(0), np.ones((3, 5, 2), np.float32))
