"""Strided and VALID convolutions, strided slices and rotary embeddings along a ragged length.

Each form is checked against every row run alone at its exact length, values and gradients,
in the pad layout (rows padded with NaN: one padding cell read makes a result wrong) and with
``layout="pack"``. What JAX cannot trace over a symbolic length (equinox's RoPE layer) is
reshaping-impossible with a verdict that names the user's line, the cause and the form that
traces once; those forms are checked exact here. A strided convolution's gradient, which JAX
refused too, traces since issue 51 (`polyexec._forms`).
"""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polyexec as px
from polyexec._recover import CONCRETE_TRACES

B = px.LengthVar("B", max=8)
LENGTHS = [9, 2, 5, 1, 7]          # short and long rows, one shorter than a window of 3
_rng = np.random.default_rng(0)
K = jnp.asarray(_rng.normal(size=(3, 3, 3)), jnp.float32)      # (taps, in, out)


def bucketed(g, layout, min_length=1, features=3):
    """``g`` run per row (``jax.vmap``) over a batch whose T is ragged along B."""
    t = px.LengthVar("T", min=min_length, max=64)
    specs = (px.Spec((B, t, features), jnp.float32), px.Spec((B,), jnp.int32, lengths_of="T"))
    return px.bucketed(lambda x, lengths: jax.vmap(g)(x), in_specs=specs,
                       buckets={t: [16, 64], B: [8]}, layout=layout)


def ragged_batch(lengths, features=3):
    rng = np.random.default_rng([features, *lengths])   # the same data whichever tests ran first
    x = np.full((len(lengths), max(lengths), features), np.nan, np.float32)
    for b, n in enumerate(lengths):
        x[b, :n] = rng.normal(size=(n, features))
    return x


def with_gradient(g):
    return lambda r: (g(r), jax.grad(lambda r: jnp.sum(jnp.sin(g(r))))(r))  # the gradient


def call(f, x, lengths):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = f(x, np.asarray(lengths, np.int32))
    return got, [str(w.message) for w in caught]


def assert_each_row_alone(got, g, x, lengths):
    """Row b of every output equals ``g`` on row b alone; the cells after it are 0."""
    alone = jax.jit(g)       # one compile per length: op by op, attention's gradient takes 20 s
    for b, n in enumerate(lengths):
        for i, (have, want) in enumerate(zip(got, alone(jnp.asarray(x[b, :n])))):
            have, want = np.asarray(have)[b], np.asarray(want)
            # rtol 1e-4: the bucket's program sums over more (masked) cells in another order;
            # attention's gradient through sin() reached 2.8e-5 on one cell in CI
            np.testing.assert_allclose(have[:len(want)], want, rtol=1e-4, atol=1e-5,
                                       err_msg=f"output {i}, row {b} (length {n})")
            assert np.all(have[len(want):] == 0), f"output {i}, row {b}: not 0 after it"


def conv(r, stride, padding):
    return jax.lax.conv_general_dilated(r[None], K, (stride,), padding,
                                        dimension_numbers=("NWC", "WIO", "NWC"))[0]


# Each traces once and is exact padded, gradients included. Their outputs have another
# length than their inputs (ceil(n / s), (n - k) // s + 1): packed, the part of a sequence
# that starts mid-row would lie past the end of the shorter result row, so pack runs them
# padded, naming the line and saying so.
STRIDED = {
    "stride 1, then ::2": with_gradient(lambda r: conv(r, 1, [(1, 1)])[::2]),  # line: ::2
    "x[::2]": with_gradient(lambda r: r[::2]),  # line: ::2
    "x[1::2]": with_gradient(lambda r: r[1::2] * r[::2][:r[1::2].shape[0]]),  # line: ::2
    "x[::3]": with_gradient(lambda r: jnp.cumsum(r[::3], 0)),  # line: ::2
    "explicit padding, stride 2": with_gradient(lambda r: conv(r, 2, [(1, 1)])),  # strided conv
    "VALID, stride 2": with_gradient(lambda r: conv(r, 2, "VALID")),  # line: strided conv
}


@pytest.mark.parametrize("layout", ["pad", "pack"])
@pytest.mark.parametrize("name", list(STRIDED))
def test_a_strided_form_reads_each_rows_own_positions(name, layout):
    g = STRIDED[name]
    x = ragged_batch(LENGTHS)
    f = bucketed(g, layout)
    got, warned = call(f, x, LENGTHS)
    assert_each_row_alone(got, g, x, LENGTHS)
    assert not f.plan.reshaping_is_impossible and f.plan.padding_safe and f.traces == 1
    if layout == "pad":
        assert warned == []
    else:
        assert not f.plan.can_pack and "test_strided.py" in f.plan.packing_reason
        # In plain words why: the shorter result has no room at each sequence's own column.
        assert "is shorter than its sequence by more than a constant (a stride" in \
            f.plan.packing_reason
        assert "its outputs cannot start at its own column" in f.plan.packing_reason
        assert len(warned) == 1 and "cannot run packed rows" in warned[0]


def test_a_valid_convolution_with_its_gradient_at_a_min_of_the_window():
    """VALID with a window of 3 traces its gradient at T >= 2, and packs at T >= 3 (the
    packed rule asks ``T - 2 >= 1``); a row shorter than the window has no outputs and a zero
    gradient, as alone."""
    g = with_gradient(lambda r: conv(r, 1, "VALID"))
    lengths = [9, 2, 5, 3, 7]
    x = ragged_batch(lengths)
    for layout in ("pad", "pack"):
        f = bucketed(g, layout, min_length=3 if layout == "pack" else 2)
        got, warned = call(f, x, lengths)
        assert_each_row_alone(got, g, x, lengths)
        assert warned == [] and f.traces == 1
        assert f.plan.can_pack if layout == "pack" else f.plan.padding_safe


@pytest.mark.parametrize("padding", [[(1, 1)], "SAME", "VALID"])
def test_a_strided_convolutions_gradient_traces_once_and_is_exact(padding):
    """JAX's transpose of a stride-2 convolution (and ``jax.vmap`` of SAME with a stride)
    passes ``lax.conv_general_dilated`` a padding that depends on T's parity
    (``T - 2 * floordiv(T - 1, 2)``), which its ``operator.index`` check refuses although the
    primitive takes it: while polyexec traces, the padding is taken as given (`_forms`), and
    the logical rule of the convolution makes it exact. (Until issue 51 this was
    reshaping-impossible, the verdict naming the stride-1 form; tests/test_strided_gradients.py
    covers strides, paddings, 2-D and pooling.)"""
    g = with_gradient(lambda r: conv(r, 2, padding))
    f = bucketed(g, "pad")
    x = ragged_batch(LENGTHS)
    got, warned = call(f, x, LENGTHS)
    assert_each_row_alone(got, g, x, LENGTHS)
    assert warned == [] and f.traces == 1
    assert not f.plan.reshaping_is_impossible and f.plan.padding_safe
    # The stride-1 form the old verdict named is equal, position for position.
    r = jnp.asarray(ragged_batch([9])[0])
    np.testing.assert_allclose(conv(r, 2, [(1, 1)]), conv(r, 1, [(1, 1)])[::2], rtol=1e-6)


# -- rotary positional embeddings -----------------------------------------------------------

D = 4
_ROPE = eqx.nn.RotaryPositionalEmbedding(D)
_Q = jnp.asarray(_rng.normal(size=(D, D)), jnp.float32)


def rope(x, theta=10000.0):
    """equinox's RotaryPositionalEmbedding, its angles from the positions (no cache)."""
    freqs = theta ** (-jnp.arange(0, D, 2, dtype=jnp.float32) / D)
    angles = jnp.arange(x.shape[0], dtype=jnp.float32)[:, None] * freqs
    cos, sin = jnp.tile(jnp.cos(angles), (1, 2)), jnp.tile(jnp.sin(angles), (1, 2))
    return x * cos + _ROPE.rotate_half(x) * sin


def causal_attention(embed):
    def attend(r):
        q, k = embed(r @ _Q), embed(r)
        t = r.shape[0]
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), q @ k.T, -jnp.inf)
        return jax.nn.softmax(s, -1) @ r
    return attend


def test_the_rope_form_equals_equinoxs_layer():
    r = jnp.asarray(_rng.normal(size=(11, D)), jnp.float32)
    np.testing.assert_allclose(rope(r), _ROPE(r), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["pad", "pack"])
def test_rope_from_the_positions_in_causal_attention_is_each_rows_own(layout):
    """Pack: each sequence's angles start at its own first cell (the tile of the cos/sin
    over the features is per position)."""
    g = with_gradient(causal_attention(rope))
    x = ragged_batch(LENGTHS, D)
    f = bucketed(g, layout, features=D)
    got, warned = call(f, x, LENGTHS)
    assert_each_row_alone(got, g, x, LENGTHS)
    assert warned == [] and f.traces == 1 and f.plan.padding_safe
    assert f.plan.can_pack if layout == "pack" else not f.plan.reshaping_is_impossible


@pytest.mark.parametrize("cache", [None, 16, 64])
def test_equinoxs_rope_layer_is_recovered_from_concrete_traces_whatever_its_cache(cache):
    """What JAX raises depends on equinox's process-wide cache: empty (``float(T)``), shorter
    than T's max (``T > 16`` undecidable) or long enough (a slice at T evaluated eagerly: an
    unexpected dimension variable, which crashed the planner). Each time the layer is traced
    at three concrete sizes and its program recovered over T (`polyexec._recover`: the table
    at the max, sliced to T), verified at 2: exact, values and gradients, with no warning. Where there are
    too few sizes to recover it, the verdict names the line and the form that traces once."""
    equinox_cache = eqx.nn._embedding.internal_rope_embedding_cache
    saved = dict(equinox_cache)
    equinox_cache.clear()
    try:
        if cache:
            _ROPE(jnp.zeros((cache, D)))
        g = with_gradient(causal_attention(_ROPE))
        f = bucketed(g, "pad", features=D)
        # 2 too: traced below the three, the same program; at 1 JAX writes attention's unit
        # axes otherwise, so a row of 1 is refused.
        lengths = [n for n in LENGTHS if n >= 2]
        x = ragged_batch(lengths, D)
        got, warned = call(f, x, lengths)
        assert_each_row_alone(got, g, x, lengths)
        unrecovered = px.trace(causal_attention(_ROPE), px.Spec("S 4", jnp.float32),
                               variables=[px.LengthVar("S", min=2, max=3)])
    finally:
        equinox_cache.clear()
        equinox_cache.update(saved)
    assert not f.plan.reshaping_is_impossible and f.plan.padding_safe and warned == []
    assert f.traces == 1 + CONCRETE_TRACES + 2     # and at T = 2 (kept), 1 (not)
    reason = unrecovered.reason
    assert unrecovered.reshaping_is_impossible
    assert "test_strided.py" in reason and "q, k = embed(r @ _Q), embed(r)" in reason
    assert "RotaryPositionalEmbedding" in reason
    assert "jnp.arange(x.shape[0])[:, None] * freqs" in reason
