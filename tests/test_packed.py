"""layout="pack": several sequences share each physical row, and nothing a sequence computes
may see another one or the padding.

1. Packable programs (plain JAX, no masks): packed == padded == each sequence alone, for
   values, per-token outputs and gradients. The exact reference is the same per-token code run
   on every sequence alone in a fixed zero-padded buffer (causality keeps the zeros out of the
   real positions; a centred convolution reads them as its own zero padding) with the sums
   and means masked by hand -- one compile, not one per length.
   Inputs are poisoned: NaN beyond each sequence's length, a large pad value (1e3) in the
   executor's own padding cells, so reading padding shows. Lengths where packing bugs live:
   0, 1, the LengthVar's min, a sequence exactly filling a row, many tiny ones per row, the
   bucket edges.
2. Unpackable programs: the verdict names the line, the call falls back to the pad layout
   (same results, one warning), strict raises.
3. Traces, compiles per (rows, row_length) bucket and padding efficiency, counted.
4. The char-LM example's train step, packed vs padded vs masked by hand.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import buckets
import polyexec as px
from polyexec.testing import edge_lengths

from conftest import assert_trees_close

T = px.LengthVar("T", min=2, max=32)     # T - 1 >= 1: x[:, 1:] can be scanned
B = px.LengthVar("B", max=8)
F, H, L, S = 3, 4, 32, 8          # features, hidden, the reference's buffer length and batch
PAD = 1e3                          # the executor's padding cells (every layout): read = wrong
SPECS = (None, px.Spec("B T 3", jnp.float32, pad=PAD), px.Spec("B", jnp.int32, lengths_of="T"))
BUCKETS = {T: [8, 32], B: [8]}

_rng = np.random.default_rng(0)
PARAMS = {
    "W": jnp.asarray(_rng.normal(size=(H, H)) * 0.6, jnp.float32),
    "U": jnp.asarray(_rng.normal(size=(F, H)), jnp.float32),
    "V": jnp.asarray(_rng.normal(size=(H,)), jnp.float32),
    "w": jnp.asarray(_rng.normal(size=(F,)), jnp.float32),
    "K": jnp.asarray(_rng.normal(size=(3, F, F)), jnp.float32),     # conv taps (W, I, O)
    "D": jnp.asarray(_rng.normal(size=(3, 1, F)), jnp.float32),     # depthwise taps
}
PE = jnp.asarray(_rng.normal(size=(L, F)), jnp.float32)   # a positional table (a constant)


# -- the functions: plain JAX, no mask, no lengths ---------------------------------------------

def _rnn(p, r, reverse=False):
    """One sequence (n, F) -> one output per token (n,): an Elman RNN via lax.scan."""
    def step(h, xt):
        h = jnp.tanh(h @ p["W"] + xt @ p["U"])
        return h, h @ p["V"]
    return jax.lax.scan(step, jnp.zeros(H), r, reverse=reverse)[1]


def rnn(p, x):
    return jax.vmap(_rnn, (None, 0))(p, x)                              # (B, T)


def reverse_rnn(p, x):
    # Over x[:, 1:] (a length of T - 1): the frame of each sequence ends one cell early.
    return jax.vmap(lambda p, r: _rnn(p, r, reverse=True), (None, 0))(p, x[:, 1:])  # (B, T - 1)


def bidirectional(p, x):
    # jnp.flip along the length: each sequence reversed in place, run forward, reversed back
    # -- the backward half of a bidirectional RNN. Packed, a neighbour never enters it; in the
    # reference buffer the flipped zeros come first, and keep the RNN's state at 0.
    return rnn(p, x) + jnp.flip(rnn(p, jnp.flip(x, 1)), 1)                # (B, T)


def shifted(p, x):
    return x[:, 1:] * x[:, :-1] * p["w"]                                # (B, T - 1, F)


def running_sum(p, x):
    # cumsum along the length: each sequence's own running total; its gradient is a reversed
    # cumsum, which restarts at each sequence's last cell.
    return jnp.tanh(jnp.cumsum(x * p["w"], axis=1))                     # (B, T, F)


def flipped_pairs(p, x):
    # Reversed over a length of T - 1: each sequence's part ends one cell early.
    return jnp.flip(shifted(p, jnp.flip(x, 1)), 1)                      # (B, T - 1, F)


def feature_cumsum(p, x):
    return jnp.cumsum(x * p["w"], axis=-1)                              # (B, T, F)


def positional(p, x):
    # jnp.broadcast_to: `x + PE[:T]` itself is packed wrong (see
    # test_positional_values_follow_each_sequence below).
    return jnp.tanh(x * p["w"] + jnp.broadcast_to(PE[:x.shape[1]], x.shape))  # (B, T, F)


NWC = ("NWC", "WIO", "NWC")     # convolutions: (B, T, F) inputs, (taps, F in, F out) kernels
conv1d = functools.partial(jax.lax.conv_general_dilated, dimension_numbers=NWC)


def causal_conv(p, x):
    # Causal: each sequence's first outputs read zeros before it, never the previous sequence.
    y = conv1d(x, p["K"], (1,), [(2, 0)])
    return jnp.tanh(y)                                                  # (B, T, F)


def same_conv(p, x):
    # Centred, dilated 2 and depthwise: taps reach two cells past each end of a sequence, into
    # its neighbours in a packed row, where the exact convolution reads zeros.
    return conv1d(x, p["D"], (1,), "SAME", rhs_dilation=(2,), feature_group_count=F)  # (B, T, F)


def valid_conv(p, x):
    # No padding: T - 2 outputs, the last two cells of each sequence start none.
    return conv1d(x, p["K"], (1,), "VALID")


class Case:
    """``per_token(params, x)`` -> (B, e(T), ...) with e(T) = T - ``shift``. The function under
    test returns the sum of squares over every token, the mean over every real token (jnp.mean
    over B and T at once, per feature), the gradients of their total with respect to the
    parameters and to ``x``, and the per-token outputs -- no mask anywhere. ``right`` aligns each
    sequence at the end of the reference buffer (a reverse scan's causality runs backwards)."""

    def __init__(self, per_token, shift=0, right=False):
        self.per_token, self.shift, self.right = per_token, shift, right
        self.name = per_token.__name__

    def user(self):
        def loss(p, x):
            out = self.per_token(p, x)
            total, mean = jnp.sum(out ** 2), jnp.mean(out, axis=(0, 1))
            return total + jnp.sum(mean), (out, total, mean)

        def fn(p, x, lengths):
            (_, (out, total, mean)), (gp, gx) = jax.value_and_grad(
                loss, argnums=(0, 1), has_aux=True)(p, x)
            return {"sum": total, "mean": mean, "grad": gp, "out": out, "grad_x": gx}
        fn.__name__ = self.name
        return fn

    def reference(self):
        """The exact computation: every sequence alone in a zero-padded (S, L, F) buffer (the
        per-token code is causal, so its real positions never see the zeros, or reads them as
        a convolution's zero padding), the sum and the mean over the real positions only, by
        hand."""
        shift = self.shift

        def fn(p, buf, n):
            t = jnp.arange(L - shift)[None, :]
            real = (t >= L - n[:, None]) if self.right else (t < n[:, None] - shift)

            def loss(p, buf):
                out = self.per_token(p, buf)
                keep = real.reshape(real.shape + (1,) * (out.ndim - 2))
                total = jnp.sum(jnp.where(keep, out ** 2, 0.0))
                mean = (jnp.sum(jnp.where(keep, out, 0.0), axis=(0, 1))
                        / jnp.sum(jnp.maximum(n - shift, 0)))
                return total + jnp.sum(mean), (out, total, mean)
            (_, (out, total, mean)), (gp, gx) = jax.value_and_grad(
                loss, argnums=(0, 1), has_aux=True)(p, buf)
            return {"sum": total, "mean": mean, "grad": gp, "out": out, "grad_x": gx}
        return jax.jit(fn)


def causal_attention(p, x):
    """Scores for every pair of positions (B, T, T), a learned (T, T) table added by position,
    causal, softmax over the keys: packed, a row's pairs of two sequences are never read."""
    def one(r):
        n = r.shape[0]
        q, k = r @ p["U"], jnp.tanh(r @ p["U"]) @ p["W"]
        s = q @ k.T + BIAS[:n, :n]
        s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, jnp.finfo(s.dtype).min)
        return jax.nn.softmax(s, axis=-1) @ r
    return jax.vmap(one)(x)                                              # (B, T, F)


BIAS = jnp.asarray(_rng.normal(size=(L, L)), jnp.float32)

CASES = [Case(rnn), Case(reverse_rnn, shift=1, right=True), Case(bidirectional),
         Case(shifted, shift=1), Case(flipped_pairs, shift=1), Case(running_sum),
         Case(feature_cumsum), Case(positional), Case(causal_attention), Case(causal_conv),
         Case(same_conv), Case(valid_conv, shift=2)]


# -- batches -------------------------------------------------------------------------------------

def batch(lengths, seed):
    """(x: NaN beyond each length, the reference buffers: left- and right-aligned zeros)."""
    lengths = np.asarray(lengths, np.int32)
    rng = np.random.default_rng(seed)
    x = np.full((len(lengths), max(int(lengths.max()), T.min), F), np.nan, np.float32)
    left, right = np.zeros((S, L, F), np.float32), np.zeros((S, L, F), np.float32)
    for b, n in enumerate(lengths):
        x[b, :n] = rng.normal(size=(n, F))
        left[b, :n], right[b, L - n:] = x[b, :n], x[b, :n]
    return x, left, right


EDGES = edge_lengths(T, BUCKETS[T])        # 0 (an empty sequence), 1, 2, 3, 7, 8, 9, 31, 32


lengths_strategy = st.one_of(
    st.lists(st.sampled_from(EDGES) | st.integers(1, T.max), min_size=1, max_size=B.max),
    st.lists(st.integers(1, 3), min_size=4, max_size=B.max),                  # many tiny ones
    st.sampled_from([8, 32]).flatmap(
        lambda row: st.integers(1, row - 1).map(lambda k: [row, k, row - k])),  # exact fill
)


def close(a, b, what, rtol=2e-5, atol=2e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol, err_msg=what)


def per_sequence(got, want, lengths, shift, what, right=False):
    """``got``: (sequences, e(longest), ...) as the pad layout returns it; ``want``: the
    reference buffer. Each sequence's own e(n) positions equal; exact zeros after them."""
    got = np.asarray(got)
    longest = int(max(lengths))
    assert got.shape[:2] == (len(lengths), max(longest - shift, 0)), (what, got.shape)
    for b, n in enumerate(int(n) for n in lengths):
        e = max(n - shift, 0)
        ref = np.asarray(want)[b, want.shape[1] - e:] if right else np.asarray(want)[b, :e]
        close(got[b, :e], ref, f"{what}: sequence {b} (length {n}) of {list(lengths)}")
        assert np.all(got[b, e:] == 0), f"{what}: sequence {b} (length {n}): not 0 after it"


# -- 1. packed == padded == exact ----------------------------------------------------------------

@pytest.fixture(scope="module")
def functions():
    made = {}

    def get(case):
        if case.name not in made:
            user = case.user()
            made[case.name] = (px.bucketed(user, SPECS, buckets=BUCKETS, layout="pack",
                                           strict=True),
                               px.bucketed(user, SPECS, buckets=BUCKETS, layout="pad",
                                           strict=True),
                               case.reference())
        return made[case.name]
    return get


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_packed_equals_padded_equals_each_sequence_alone(case, functions):
    packed, padded, reference = functions(case)

    @given(lengths=lengths_strategy, seed=st.integers(0, 2 ** 16))
    @example(lengths=[1], seed=0)
    @example(lengths=[32], seed=1)                      # one sequence fills the row exactly
    @example(lengths=[5, 1, 8, 3, 2, 1, 4, 7], seed=2)  # row length 8: 8 | 7+1 | 5+3 | 4+2+1
    @example(lengths=[1] * 8, seed=3)                   # eight sequences in one row
    @example(lengths=[31, 1, 16, 16, 9, 23], seed=4)    # rows of 32 filled exactly
    @example(lengths=[0, 3, 0, 1], seed=5)               # empty sequences take no cells
    def check(lengths, seed):
        x, left, right = batch(lengths, seed)
        lengths = np.asarray(lengths, np.int32)
        n = np.zeros(S, np.int32)
        n[:len(lengths)] = lengths
        got = packed(PARAMS, x, lengths)
        assert packed.plan.can_pack, packed.plan.packing_reason
        pad = padded(PARAMS, x, lengths)
        want = reference(PARAMS, right if case.right else left, n)
        where = f"{case.name}, lengths {lengths.tolist()}"
        for name in ("sum", "mean"):
            close(got[name], want[name], f"{name}, packed vs exact, {where}", rtol=1e-4)
            close(pad[name], want[name], f"{name}, padded vs exact, {where}", rtol=1e-4)
            close(got[name], pad[name], f"{name}, packed vs padded, {where}")
        assert_trees_close(got["grad"], want["grad"], rtol=1e-4, atol=1e-4)
        assert_trees_close(got["grad"], pad["grad"], rtol=1e-4, atol=1e-4)
        for name in ("out", "grad_x"):
            shift = case.shift if name == "out" else 0
            per_sequence(got[name], want[name], lengths, shift, f"packed {name}, {where}",
                         case.right)
            per_sequence(pad[name], want[name], lengths, shift, f"padded {name}, {where}",
                         case.right)

    check()
    assert packed.traces == 1 and padded.traces == 1
    assert all(s.compiles == 1 for s in packed.stats.buckets.values())


# -- 2. what cannot be packed: the verdict, the fallback, strict ---------------------------------

SPECS_V = (px.Spec("B T 3", jnp.float32), px.Spec("B", jnp.int32, lengths_of="T"))


def key_argmax(x, lengths):
    return jax.vmap(lambda r: jnp.argmax(r @ r.T, axis=-1))(x)  # verdict: argmax


TABLE = jnp.asarray(_rng.normal(size=(L, F, 2)), jnp.float32)


KS = jnp.asarray(_rng.normal(size=(2, F, F)), jnp.float32)


def strided_conv(x, lengths):
    return conv1d(x, KS, (2,), "VALID")  # verdict: strided conv


def _np_strided_conv(r):
    return np.stack([r[j] @ np.asarray(KS[0]) + r[j + 1] @ np.asarray(KS[1])
                     for j in range(0, len(r) - 1, 2)] or [np.zeros(F)])


def segment_sums(x, lengths):
    segments = lambda r: jnp.arange(r.shape[0]) // 2
    return jax.vmap(lambda r: jax.ops.segment_sum(r, segments(r), 4))(x)  # verdict: segment_sum


def segment_sums_by_ids(x, lengths):
    ids = jnp.broadcast_to(jnp.arange(x.shape[1]) // 2, x.shape[:2])
    return jax.vmap(lambda r, i: jax.ops.segment_sum(r, i, 4))(x, ids)  # verdict: segment ids


def _np_segment_sums(r):
    return np.stack([r[2 * k:2 * k + 2].sum(0) for k in range(4)])


# name -> (function, the tag of the line its reason names, each sequence alone (numpy), per token)
UNPACKABLE = {
    # Which key: a column of the row, not a position of the sequence.
    "argmax over the keys": (key_argmax, "argmax", lambda r: np.argmax(r @ r.T, -1), True),
    # Strided: each sequence's outputs would start at another column than its inputs.
    "strided convolution": (strided_conv, "strided conv", _np_strided_conv, True),
    # Segments by position: each packed row summed its sequences into one set of segments,
    # by column (silently wrong before: the index was read by column).
    "segment_sum by positions": (segment_sums, "segment_sum", _np_segment_sums, False),
    "segment_sum by ids": (segment_sums_by_ids, "segment ids", _np_segment_sums, False),
}


def line_of(tag):
    """``test_packed.py:N: `line``` for the one line of this file marked ``# verdict: tag``."""
    with open(__file__) as f:
        lines = f.read().splitlines()
    hits = [i for i, line in enumerate(lines) if line.rstrip().endswith("# verdict: " + tag)]
    assert len(hits) == 1, tag
    return f"test_packed.py:{hits[0] + 1}: `{lines[hits[0]].strip()}`"


@pytest.mark.parametrize("name", list(UNPACKABLE))
def test_unpackable_programs_name_the_line_and_fall_back_to_pad(name):
    fn, tag, alone, per_token = UNPACKABLE[name]
    f = px.bucketed(fn, SPECS_V, buckets={T: [8], B: [8]}, layout="pack")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for lengths in ([5, 1, 8, 3], [2, 4, 2]):          # three sequences could share a row
            x, _, _ = batch(lengths, seed=len(lengths))
            got = np.asarray(f(x, np.asarray(lengths, np.int32)))
            assert got.shape[0] == len(lengths)
            for b, n in enumerate(lengths):
                want = alone(x[b, :n].astype(np.float64))
                close(got[b, :len(want)] if per_token else got[b], want,
                      f"{name}: sequence {b} (length {n}) of {lengths}", rtol=1e-5, atol=1e-5)
                if per_token:
                    assert np.all(got[b, n:] == 0)
    assert not f.plan.can_pack and f.plan.padding_safe
    named = line_of(tag) if tag else ""
    assert named in f.plan.packing_reason, f.plan.packing_reason
    fallback = [w for w in caught if "cannot run packed rows" in str(w.message)]
    assert len(fallback) == 1 and named in str(fallback[0].message)
    assert len(caught) == 1, [str(w.message) for w in caught]
    # It ran the pad layout: one sequence per row of the (B, T) bucket, never a packed row.
    assert set(f.stats.buckets) == {(("B", 8), ("T", 8))} and f.traces == 1
    strict = px.bucketed(fn, SPECS_V, buckets={T: [8], B: [8]}, layout="pack", strict=True)
    x, _, _ = batch([3, 2], seed=0)
    with pytest.raises(px.PolymorphismError) as raised:
        strict(x, np.asarray([3, 2], np.int32))
    assert named in str(raised.value) and str(raised.value) == f.plan.packing_reason


def attention(x, lengths):
    """Not causal: every position attends to its whole sequence, and only to it."""
    def loss(x):
        out = jax.vmap(lambda r: jax.nn.softmax(r @ r.T, axis=-1) @ r)(x)
        return jnp.sum(jnp.sin(out)), out
    (_, out), grad = jax.value_and_grad(loss, has_aux=True)(x)
    return out, grad


def _np_attention(r):
    s = r @ r.T
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ r


@given(lengths=lengths_strategy, seed=st.integers(0, 2 ** 16))
@example(lengths=[5, 1, 8, 3, 2, 1, 4, 7], seed=2)
@example(lengths=[1] * 8, seed=3)
def test_attention_sees_only_its_own_sequence(lengths, seed):
    packed = _attention_functions("pack")
    padded = _attention_functions("pad")
    x, _, _ = batch(lengths, seed)
    n = np.asarray(lengths, np.int32)
    (out, grad), (pad_out, pad_grad) = packed(x, n), padded(x, n)
    assert packed.plan.can_pack, packed.plan.packing_reason
    for b, k in enumerate(lengths):
        where = f"sequence {b} (length {k}) of {lengths}"
        if k:
            close(out[b, :k], _np_attention(x[b, :k].astype(np.float64)), where, rtol=1e-4,
                  atol=1e-5)
        assert np.all(np.asarray(out)[b, k:] == 0) and np.all(np.asarray(grad)[b, k:] == 0)
    close(out, pad_out, f"packed vs padded, {lengths}", rtol=1e-4, atol=1e-5)
    close(grad, pad_grad, f"the gradient, packed vs padded, {lengths}", rtol=1e-4, atol=1e-5)
    assert all(s.compiles == 1 for s in packed.stats.buckets.values())


def pair_mean(x, lengths):
    return jnp.mean(jnp.einsum("btf,bsf->bts", x, x))


@pytest.mark.parametrize("lengths", [[5, 1, 8, 3], [1] * 8, [32], [0, 3, 2]])
def test_a_mean_over_pairs_of_positions_counts_each_sequences_own_pairs(lengths):
    f = px.bucketed(pair_mean, SPECS_V, buckets=BUCKETS, layout="pack", strict=True)
    x, _, _ = batch(lengths, seed=7)
    total = sum(float(np.sum(x[b, :k] @ x[b, :k].T)) for b, k in enumerate(lengths))
    close(f(x, np.asarray(lengths, np.int32)), total / sum(k * k for k in lengths),
          f"lengths {lengths}", rtol=1e-5)
    assert f.plan.can_pack


MASKS_FROM_POSITIONS = {
    "tril": lambda pos, n: jnp.tril(jnp.ones((n, n), bool)),
    "causal": lambda pos, n: pos[:, None] >= pos[None, :],
    "sliding window": lambda pos, n: (pos[:, None] >= pos[None, :])
                                     & (pos[:, None] - pos[None, :] <= 2),
}


def test_masks_made_from_positions_are_compared_per_cell_not_gathered():
    """A mask made from positions alone (``jnp.tril(jnp.ones((T, T)))``, ``pos[:, None] >=
    pos[None, :]``, a sliding window) meets packed rows' ``(B, T, T)`` scores: each pair cell
    compares its own two positions, as hand-written segment ids do, instead of gathering the
    ``(T, T)`` mask there (two gathers over the scores, before). Values and input gradients
    equal each sequence's alone. (One function for the three masks: one compile.)"""
    def one(r, mask):
        pos = jnp.arange(r.shape[0])
        s = jnp.where(MASKS_FROM_POSITIONS[mask](pos, r.shape[0]), r @ r.T,
                      jnp.finfo(r.dtype).min)
        return jax.nn.softmax(s, axis=-1) @ r

    def each(x):
        return [jax.vmap(lambda r: one(r, mask))(x) for mask in MASKS_FROM_POSITIONS]

    def scores(x, lengths):
        return each(x), jax.grad(lambda x: sum(jnp.sum(o ** 2) for o in each(x)))(x)

    f = px.bucketed(scores, SPECS_V, buckets=BUCKETS, layout="pack", strict=True)
    lengths = [5, 1, 4, 3, 2, 1]                  # rows of 8: 5+3 | 4+2+1+1
    x, _, _ = batch(lengths, seed=11)
    outs, grad = f(x, np.asarray(lengths, np.int32))
    alone = jax.jit(lambda r: (each(r[None])[0][0], each(r[None])[1][0], each(r[None])[2][0],
                               jax.grad(lambda r: sum(jnp.sum(o ** 2) for o in each(r)))(
                                   r[None])[0]))
    for b, n in enumerate(lengths):
        *want, want_grad = alone(jnp.asarray(x[b, :n]))
        for mask, out, w in zip(MASKS_FROM_POSITIONS, outs, want):
            close(out[b, :n], w, f"{mask}: sequence {b}", rtol=1e-5)
        close(grad[b, :n], want_grad, f"gradient of sequence {b}", rtol=1e-4, atol=1e-5)
    B_, T_ = jax.export.symbolic_shape("B, T", constraints=["T <= 16"])
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)
    avals = [jax.ShapeDtypeStruct((B_, T_, 3), np.float32), i32(B_)]
    program = jax.jit(lambda x, n, b, t: scores(x, n)).trace(*avals, i32(), i32()).jaxpr
    packed = px._logical.rewrite_packed(program, {"B": 2, "T": 3}, {"T": (1, "B")})
    assert not packed.unsupported
    logical = jax.make_jaxpr(packed.fn)(*avals, i32(), i32(), i32(B_, T_), i32(B_, T_))
    gathers = [e.outvars[0].aval.shape for e in _equations(logical.jaxpr)
               if e.primitive.name == "gather"]
    assert not [s for s in gathers if len(s) >= 3], gathers


def _equations(jaxpr):
    """Every equation of ``jaxpr`` and of the programs its equations call (jnp's ``pjit``)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _equations(sub)


SPECS_HEADS = (px.Spec("B T 8", jnp.float32), px.Spec("B", jnp.int32, lengths_of="T"))


def jax_attention(causal):
    """``jax.nn.dot_product_attention`` over two heads, and its gradient."""
    def fn(x, lengths):
        def loss(q):
            out = jax.nn.dot_product_attention(q, q * 0.5, q, is_causal=causal)
            return jnp.sum(jnp.tanh(out)), out
        q = x.reshape(*x.shape[:2], 2, 4)
        (_, out), grad = jax.value_and_grad(loss, has_aux=True)(q)
        return out, grad
    return fn


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_jax_dot_product_attention_packs_within_each_sequence(causal):
    fn = jax_attention(causal)
    packed = px.bucketed(fn, SPECS_HEADS, buckets=BUCKETS, layout="pack", strict=True)

    @jax.jit
    def alone(x, n):
        """Every sequence alone in an (S, L) buffer, masked by hand (JAX's own key lengths)."""
        def loss(q):
            out = jax.nn.dot_product_attention(q, q * 0.5, q, is_causal=causal,
                                               key_value_seq_lengths=n)
            real = jnp.arange(L)[None, :, None, None] < n[:, None, None, None]
            return jnp.sum(jnp.where(real, jnp.tanh(out), 0.0)), out
        (_, out), grad = jax.value_and_grad(loss, has_aux=True)(x.reshape(S, L, 2, 4))
        return out, grad

    @given(lengths=lengths_strategy, seed=st.integers(0, 2 ** 16))
    @example(lengths=[5, 1, 8, 3, 2, 1, 4, 7], seed=2)
    def check(lengths, seed):
        rng = np.random.default_rng(seed)
        x = np.full((len(lengths), max(max(lengths), T.min), 8), np.nan, np.float32)
        for b, k in enumerate(lengths):
            x[b, :k] = rng.normal(size=(k, 8))
        out, grad = packed(x, np.asarray(lengths, np.int32))
        buffer, n = np.zeros((S, L, 8), np.float32), np.zeros(S, np.int32)
        for b, k in enumerate(lengths):
            buffer[b, :k], n[b] = x[b, :k], k
        want_out, want_grad = alone(buffer, n)
        for b, k in enumerate(lengths):
            where = f"sequence {b} (length {k}) of {lengths}"
            close(out[b, :k], want_out[b, :k], where, rtol=1e-4, atol=1e-5)
            close(grad[b, :k], want_grad[b, :k], f"gradient, {where}", rtol=1e-4, atol=1e-5)
            assert np.all(np.asarray(out)[b, k:] == 0)

    check()
    assert packed.plan.can_pack and packed.traces == 1


_ATTENTION = {}


def _attention_functions(layout):
    if layout not in _ATTENTION:
        _ATTENTION[layout] = px.bucketed(attention, SPECS_V, buckets=BUCKETS, layout=layout,
                                         strict=True)
    return _ATTENTION[layout]


REL = jnp.asarray(_rng.normal(size=(2 * L + 1,)), jnp.float32)     # a relative-position bias


def _table_gradients(x, lengths):
    """The gradients of two learned position tables: ``pe[:T]`` added to every token, and a
    relative bias ``rel[i - j]`` added to attention's ``(B, T, T)`` scores. Each sums over the
    rows at each position (or pair of positions): per position across packed sequences."""
    def loss(pe, rel):
        i = jnp.arange(x.shape[1])
        h = x + pe[:x.shape[1]]
        scores = jnp.einsum("btf,bsf->bts", h, h) + rel[i[:, None] - i[None, :] + L]
        return jnp.sum(jax.nn.softmax(scores, axis=-1) @ h)
    return jax.grad(loss, argnums=(0, 1))(PE, REL)


@jax.jit      # one program a length: the op-by-op (eager) gradient took ~8x longer
def _table_gradients_alone(x):
    """`_table_gradients` for one sequence at its exact length."""
    return jax.grad(lambda pe, rel: jnp.sum(jax.nn.softmax(
        (x + pe[:len(x)]) @ (x + pe[:len(x)]).T
        + rel[jnp.arange(len(x))[:, None] - jnp.arange(len(x))[None, :] + L], axis=-1)
        @ (x + pe[:len(x)])), argnums=(0, 1))(PE, REL)


@pytest.mark.parametrize("lengths", [[5, 1, 3], [8, 2, 6, 1, 1], [1] * 8, [32, 7]])
def test_position_tables_gradients_sum_each_position_over_every_sequence(lengths):
    f = px.bucketed(_table_gradients, SPECS_V, buckets={T: [8, 32], B: [8]}, layout="pack",
                    strict=True)
    x, _, _ = batch(lengths, seed=len(lengths))
    got = f(x, np.asarray(lengths, np.int32))
    assert f.plan.can_pack
    wants = [_table_gradients_alone(jnp.asarray(x[b, :n])) for b, n in enumerate(lengths)]
    for k, what in enumerate(("d loss / d pe", "d loss / d rel")):
        close(got[k], sum(np.asarray(w[k]) for w in wants), what, rtol=1e-4, atol=1e-4)


# Implicit broadcasting ((T,) -> (1, T) -> add, as jnp and vmap write it) once read a
# per-position value at the row's column: a sequence not at column 0 got another position's.
PE1 = jnp.arange(32, dtype=jnp.float32) * 100
POSITIONAL_FORMS = {
    "x + pe[:T]": lambda x, n: x + PE1[:x.shape[1]],
    "x + arange(T)": lambda x, n: x + 100 * jnp.arange(x.shape[1], dtype=jnp.float32),
    "vmap(r + pe[:len(r)])": lambda x, n: jax.vmap(lambda r: r + PE1[:r.shape[0]])(x),
    # The same value broadcast explicitly to (B, T) follows each sequence (the working form).
    "x + broadcast_to(pe[:T], x.shape)": (
        lambda x, n: x + jnp.broadcast_to(PE1[:x.shape[1]], x.shape)),
}


@pytest.mark.parametrize("form", list(POSITIONAL_FORMS))
def test_positional_values_follow_each_sequence(form):
    specs = (px.Spec("B T", jnp.float32), px.Spec("B", jnp.int32, lengths_of="T"))
    f = px.bucketed(POSITIONAL_FORMS[form], specs, buckets={T: [4], B: [1]}, layout="pack",
                    strict=True)
    x = np.array([[1, 2], [3, np.nan]], np.float32)       # lengths 2 and 1: one row [1 2 3 _]
    got = np.asarray(f(x, np.array([2, 1], np.int32)))
    assert set(f.stats.buckets) == {(("rows(B)", 1), ("row_length(T)", 4))}
    # The second sequence sits at column 2 of the row; its position 0 must read pe[0].
    np.testing.assert_array_equal(got, [[1, 102], [3, 0]])


def _decay(T):
    i = jnp.arange(T)
    return 0.5 ** jnp.abs(i[:, None] - i[None, :]).astype(jnp.float32)


# A fixed (T, T) matrix contracted along T: each cell mixes its own sequence's positions; a
# table of weights per position: each cell its own position's.
MIXING = {
    "einsum(btf,tfg->btg) of weights per position": (
        lambda x: jnp.einsum("btf,tfg->btg", x, TABLE[:x.shape[1]])),
    "einsum(ts,bsf->btf) of tri(T)": lambda x: jnp.einsum("ts,bsf->btf", jnp.tri(x.shape[1]), x),
    "einsum(bsf,st->btf) of triu": (
        lambda x: jnp.einsum("bsf,st->btf", x, jnp.triu(jnp.ones((x.shape[1],) * 2)))),
    "decay(T) @ x, per example": lambda x: jax.vmap(lambda r: _decay(r.shape[0]) @ r)(x),
}


def _packs_like_each_sequence_alone(form, mix, lengths):
    """``sum(sin(mix(x * w)))`` and its gradient, packed, against each sequence's own at its
    exact length (jax.jit)."""
    def value_and_grad(w, x, lengths):
        return jax.value_and_grad(lambda w: jnp.sum(jnp.sin(mix(x * w))))(w)

    f = px.bucketed(value_and_grad, SPECS, buckets={T: [8, 32], B: [8]}, layout="pack",
                    strict=True)
    x, _, _ = batch(lengths, seed=len(lengths))
    loss, grad = f(PARAMS["w"], x, np.asarray(lengths, np.int32))
    assert f.plan.can_pack
    alone = [jax.jit(value_and_grad)(PARAMS["w"], x[b:b + 1, :n], None)
             for b, n in enumerate(lengths)]
    close(loss, sum(a[0] for a in alone), f"{form}: loss", rtol=1e-4, atol=1e-4)
    close(grad, sum(np.asarray(a[1]) for a in alone), f"{form}: gradient", rtol=1e-4,
          atol=1e-4)


def _flipped_rnn(x):
    def step(h, xt):
        h = jnp.tanh(h + xt)
        return h, h
    return jax.lax.scan(step, jnp.zeros(x.shape[::2]), jnp.swapaxes(x[:, ::-1], 0, 1))[1]


# Positions meeting each sequence's own length, without the rows axis: per cell.
PER_CELL = {
    "x[:, ::-1]": lambda x: jnp.tanh(x)[:, ::-1],
    "an RNN over x[:, ::-1]": _flipped_rnn,
    "x * (arange(T) / T)[:, None]": (
        lambda x: x * (jnp.arange(x.shape[1]) / x.shape[1])[:, None]),
    "where(arange(T) >= T - 2)": (
        lambda x: jnp.where((jnp.arange(x.shape[1]) >= x.shape[1] - 2)[:, None], x, 0.0)),
}


# Shifts along T by concatenation, as language models write them (and their transposes, a
# split): each sequence's pieces from its own start column, at its own offsets.
SHIFTS = {
    "shift right: concatenate([zeros, x[:, :-1]])": (
        lambda x: rnn(PARAMS, jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1))),
    "shift left: concatenate([x[:, 1:], ones])": (
        lambda x: rnn(PARAMS, jnp.concatenate([x[:, 1:], jnp.ones_like(x[:, :1])], axis=1))),
    "a per-sequence first step: concatenate([mean over T, x[:, :-1]])": (
        lambda x: rnn(PARAMS, jnp.concatenate([jnp.mean(x, axis=1, keepdims=True), x[:, :-1]],
                                              axis=1))),
}


@pytest.mark.parametrize("form", [*MIXING, *PER_CELL, *SHIFTS])
@pytest.mark.parametrize("lengths", [[5, 1, 3], [8, 2, 6, 1, 1], [32, 7], [1] * 8])
def test_positions_mix_and_index_each_sequence_alone(form, lengths):
    _packs_like_each_sequence_alone(form, {**MIXING, **PER_CELL, **SHIFTS}[form], lengths)


def _linspace_positions(x):
    return x * jnp.linspace(0, 1, x.shape[1])[:, None]


# Sequences of at least 2: JAX traces linspace's ``num > 1`` branch at T's min of 2.
@pytest.mark.parametrize("lengths", [[5, 2, 3], [8, 2, 6, 2, 3], [32, 7], [2] * 8])
def test_linspace_along_t_reads_each_sequences_own_length(lengths):
    """``jnp.linspace(0, 1, T)`` joins ``T - 1`` points ``i / (T - 1)`` (per cell: each
    sequence's own T) and its stop value: joined per sequence, from its own first position."""
    _packs_like_each_sequence_alone("linspace", _linspace_positions, lengths)


def _medians(r):
    return jnp.median(r[:, 0]), jnp.percentile(r[:, 1], 30), jnp.median(r, axis=0)


_medians_alone = jax.jit(_medians)     # the reference, one program a length (not op by op)


def test_a_median_along_t_is_each_sequences_own():
    """``jnp.median`` (a sort, then the middle positions of each sequence's own length, a
    ``(B, 1)`` value broadcast along T) packs: each sequence's against it alone, the padding
    NaN. (Its gradient: test_sorting_gathers_and_their_gradients_...)"""
    lengths = np.array([5, 1, 9, 3, 4, 2, 8], np.int32)
    x, _, _ = batch(lengths, seed=3)
    f = px.bucketed(lambda x, n: jax.vmap(_medians)(x), SPECS[1:], buckets=BUCKETS,
                    layout="pack", strict=True)
    got = f(x, lengths)
    assert f.plan.can_pack
    for b, n in enumerate(lengths):
        for i, (have, want) in enumerate(zip(got, _medians_alone(jnp.asarray(x[b, :n])))):
            close(np.asarray(have)[b], want, f"output {i}, sequence {b} (length {n})")


def _unsorted(x):
    b, order = jnp.arange(x.shape[0])[:, None], jnp.argsort(x[..., 0], axis=1)
    return jnp.zeros_like(x).at[b, order].add(x[b, order])


# A gather along T with one index per cell, positions inside the cell's own sequence (a
# sort's permutation), and its transpose, a scatter-add: the values and the gradients of
# sorting code. name -> (B, T, F) -> (B, T, F) or (B, F).
SORTING = {
    "take_along_axis(x, argsort(x))": (
        lambda x: jnp.take_along_axis(x, jnp.argsort(x, axis=1), axis=1)),
    "x[b, argsort]": (                               # a row component: the sequence it names
        lambda x: x[jnp.arange(x.shape[0])[:, None], jnp.argsort(x[..., 0], axis=1)]),
    "take_along_axis, clip past the end": (          # clamped into each sequence's own
        lambda x: jnp.take_along_axis(x, jnp.argsort(x, axis=1) + 2, axis=1, mode="clip")),
    "take_along_axis, fill past the end": (          # each sequence's own n and n + 1: filled
        lambda x: jnp.take_along_axis(x, jnp.argsort(x, axis=1) + 2, axis=1, mode="fill",
                                      fill_value=-7.0)),
    # Scatters with such an index: the cells outside every sequence (whose argsort is 0)
    # must not write into the real cell at their row's column 0.
    "zeros.at[b, argsort].add(1)": (                 # a permutation: every real cell once
        lambda x: jnp.zeros_like(x).at[jnp.arange(x.shape[0])[:, None],
                                       jnp.argsort(x[..., 0], axis=1)].add(1.0)),
    "zeros.at[b, argsort].add(x[b, argsort])": _unsorted,     # x again
    "sort": lambda x: jnp.sort(x, axis=1),
    "median": lambda x: jnp.median(x, axis=1),
    "percentile": lambda x: jnp.percentile(x, 30, axis=1),
}


def _sorting_loss(form):
    def loss(x):
        y = SORTING[form](x)
        if y.ndim == 2:                              # reduced along T: one per sequence
            return jnp.sum(jnp.sin(y) ** 2)
        # Weights per position, so a gradient sent to the wrong position shows.
        return jnp.sum(jnp.sin(y) * jnp.cos(0.7 * jnp.arange(y.shape[1]))[:, None])
    return loss


@functools.cache
def _sorting_alone(form):
    """The reference: the form's value and gradient on one sequence at its exact length, under
    plain jax.jit (one program a length; op by op it took several times longer)."""
    return jax.jit(lambda x: (SORTING[form](x), jax.grad(_sorting_loss(form))(x)))


@functools.cache
def _sorting_step(form):
    def step(x, lengths):
        return SORTING[form](x), jax.grad(_sorting_loss(form))(x)
    return px.bucketed(step, SPECS[1:], buckets=BUCKETS, layout="pack", strict=True)


@pytest.mark.parametrize("form", list(SORTING))
@pytest.mark.parametrize("lengths", [[5, 1, 0, 7, 3],          # an empty and a 1-long sequence
                                     [8, 3, 5],                # rows of 8 filled: 8 | 5 + 3
                                     [31, 1, 16, 16, 9, 23],   # rows of 32 filled exactly
                                     [1] * 8, [2, 0, 6, 2]])
def test_sorting_gathers_and_their_gradients_read_each_sequences_own_positions(form, lengths):
    """``take_along_axis`` (``x[b, idx]``) along T with a per-cell index of positions inside
    each cell's own sequence reads, for cell (r, c), column ``start + index``; its gradient
    (a scatter-add), a sort's and a median's write there: each sequence's value and gradient
    equal the sequence's own at its exact length, packed."""
    f = _sorting_step(form)
    x, _, _ = batch(lengths, seed=len(lengths))
    value, grad = (np.asarray(a) for a in f(x, np.asarray(lengths, np.int32)))
    assert f.plan.can_pack, f.plan.packing_reason
    assert grad.shape == (len(lengths), max(lengths), F)
    for b, n in enumerate(lengths):
        alone = jnp.asarray(x[b:b + 1, :n])
        where = f"{form}: sequence {b} (length {n}) of {lengths}"
        if n == 0 and value.ndim == 2:
            # JAX's median of an empty array fails to trace; numpy's (and the pad layout's)
            # is NaN, and it has no cell to send a gradient to.
            close(value[b], np.full(F, np.nan), f"value, {where}")
        elif n > 0:
            want, want_grad = (np.asarray(a)[0] for a in _sorting_alone(form)(alone))
            close(value[b, :n] if want.ndim == 2 else value[b], want, f"value, {where}")
            close(grad[b, :n], want_grad, f"gradient, {where}")
        assert np.all(grad[b, n:] == 0), f"gradient past the end, {where}"
        if value.ndim == 3:
            assert np.all(value[b, n:] == 0), f"value past the end, {where}"
    assert f.traces == 1


def _top_two(x):
    """``top_k`` along T of a score per position, ties included (scores rounded to halves)."""
    return jax.lax.top_k(jnp.round(2 * x[..., 0]) / 2 + x[..., 1] * 0, 2)


def _top_two_loss(x):
    values, _ = _top_two(x)
    return jnp.sum(jnp.sin(values) * jnp.array([1.0, 0.3]))


# The reference on one sequence at its exact length: one program a length, not op by op.
_top_two_alone = jax.jit(lambda x: (_top_two(x), jax.grad(_top_two_loss)(x)))


@pytest.mark.parametrize("lengths", [[5, 2, 7, 3], [8, 3, 5], [31, 2, 16, 16, 9, 23]])
def test_top_k_along_t_is_each_sequences_own_with_its_gradient(lengths):
    """``lax.top_k`` along a packed T: each sequence's own k largest and their positions
    (ties to the lower position, as top_k breaks them), and its gradient (a scatter-add of
    each sequence's k updates) back at those positions of that sequence only."""
    f = px.bucketed(lambda x, lengths: (_top_two(x), jax.grad(_top_two_loss)(x)), SPECS[1:],
                    buckets=BUCKETS, layout="pack", strict=True)
    x, _, _ = batch(lengths, seed=len(lengths))
    (values, positions), grad = f(x, np.asarray(lengths, np.int32))
    assert f.plan.can_pack, f.plan.packing_reason
    for b, n in enumerate(lengths):
        alone = jnp.asarray(x[b:b + 1, :n])
        (want_values, want_positions), want_grad = _top_two_alone(alone)
        where = f"sequence {b} (length {n}) of {lengths}"
        close(values[b], want_values[0], f"values, {where}")
        np.testing.assert_array_equal(positions[b], want_positions[0], f"positions, {where}")
        close(grad[b, :n], want_grad[0], f"gradient, {where}")
        assert np.all(np.asarray(grad)[b, n:] == 0), f"gradient past the end, {where}"


def _accumulate_over_time(init):
    def fn(x, lengths):
        def step(total, xt):                                # xt: (B, 3), one time step
            return total + jnp.sum(xt ** 2), None
        return jax.lax.scan(step, init, jnp.swapaxes(x, 0, 1))[0]
    return fn


@pytest.mark.parametrize("init", ["jnp.zeros(())", "0.0"])   # 0.0: a jaxpr literal, weakly typed
def test_a_time_major_scan_accumulating_over_the_rows_packs(init):
    """A scan over time with a scalar carry that sums over the rows (batch-major code
    transposed): the order of the cells does not matter, so it packs."""
    f = px.bucketed(_accumulate_over_time(jnp.zeros(()) if init != "0.0" else 0.0), SPECS_V,
                    buckets={T: [8], B: [8]}, layout="pack", strict=True)
    lengths = [5, 1, 8, 3, 2, 0, 4]
    x, _, _ = batch(lengths, seed=0)
    got = f(x, np.asarray(lengths, np.int32))
    close(got, sum(float(np.sum(x[b, :n] ** 2)) for b, n in enumerate(lengths)), "sum",
          rtol=1e-5)
    assert f.plan.can_pack and next(iter(f.stats.buckets))[0][0] == "rows(B)"


# -- 3. traces, compiles and padding efficiency, counted -------------------------------------------

def first_fit_rows(lengths, row_length):
    """First-fit decreasing, written again: the number of rows it fills."""
    free = []
    for n in sorted((int(n) for n in lengths if n > 0), reverse=True):
        for r, left in enumerate(free):
            if left >= n:
                free[r] -= n
                break
        else:
            free.append(row_length - n)
    return len(free)


def smallest(sizes, n):
    return min(s for s in sizes if s >= n)


def products(x, lengths):
    return jnp.sum(x[:, 1:] * x[:, :-1]), x[:, 1:] * x[:, :-1]


def _np_products(x, lengths):
    return sum(float(np.sum(x[b, 1:n] * x[b, :n - 1])) for b, n in enumerate(lengths))


def test_one_trace_and_one_compile_per_packed_bucket():
    tb, bb = [4, 8, 16, 32], [1, 2, 4, 8]
    f = px.bucketed(products, SPECS_V, buckets={T: tb, B: bb}, layout="pack", strict=True)
    batches = [[1], [4], [2, 2], [3, 1, 1, 3], [5], [8, 8, 8], [7, 1, 6, 2], [16, 15, 1],
               [32], [17, 16, 16, 15], [1] * 8, [4, 4, 4, 4, 4, 4, 4, 4], [2, 3], [32] * 8]
    expected: dict = {}
    with px.count_compiles() as first:
        for i, lengths in enumerate(batches):
            x, _, _ = batch(lengths, seed=i)
            total, _ = f(x, np.asarray(lengths, np.int32))
            close(total, _np_products(x, lengths), f"batch {lengths}", rtol=1e-5)
            row_length = smallest(tb, max(lengths))
            key = (("rows(B)", smallest(bb, first_fit_rows(lengths, row_length))),
                   ("row_length(T)", row_length))
            expected[key] = expected.get(key, 0) + 1
    assert f.traces == 1
    assert {k: (s.calls, s.compiles) for k, s in f.stats.buckets.items()} == \
        {k: (calls, 1) for k, calls in expected.items()}
    assert len(expected) >= 8            # the batches above really spread over the buckets
    assert first.xla_compiles >= len(expected)
    # Every bucket is compiled: the same batches again compile nothing.
    with px.forbid_compiles(), px.count_compiles() as again:
        for i, lengths in enumerate(batches):
            x, _, _ = batch(lengths, seed=i)
            f(x, np.asarray(lengths, np.int32))
    assert again.backend_compiles == 0 and f.traces == 1 and f.stats.compiles == len(expected)


def test_an_output_without_a_length_axis_stays_on_the_device():
    # A train step's loss and parameters: reading them on the host would wait for the step,
    # and the caller could not prepare its next batch while this one runs.
    f = px.bucketed(products, SPECS_V, buckets={T: [8], B: [4]}, layout="pack", strict=True)
    x, _, _ = batch([3, 5], seed=0)
    total, per_token = f(x, np.asarray([3, 5], np.int32))
    assert isinstance(total, jax.Array) and not isinstance(total, np.ndarray)
    assert isinstance(per_token, np.ndarray) and per_token.shape == (2, 4, 3)
    close(total, _np_products(x, [3, 5]), "the sum", rtol=1e-5)


def test_the_plan_times_its_trace_and_each_rewrite_once():
    f = px.bucketed(products, SPECS_V, buckets={T: [8], B: [4]}, layout="auto")
    x, _, _ = batch([3, 5], seed=0)
    f(x, np.asarray([3, 5], np.int32))
    f(x, np.asarray([2, 5], np.int32))
    seconds = dict(f.plan.seconds)
    assert set(seconds) == {"trace", "rewrite", "packed rewrite"}, seconds
    assert all(s > 0 for s in seconds.values()), seconds
    assert f.traces == 1 and dict(f.plan.seconds) == seconds     # made once, not per call


def test_packing_is_at_least_as_efficient_as_padding_on_a_long_tail():
    tb, bb = [8, 16, 32], [1, 2, 4, 8]
    options = dict(buckets={T: tb, B: bb}, strict=True)
    packed = px.bucketed(products, SPECS_V, layout="pack", **options)
    padded = px.bucketed(products, SPECS_V, layout="pad", **options)
    rng = np.random.default_rng(7)
    real = pack_cells = pad_cells = 0
    for i in range(6):
        lengths = np.clip(np.round(rng.lognormal(1.0, 0.9, size=8)), 1, 32).astype(np.int32)
        lengths[0] = rng.integers(20, 33)                         # one long sequence each
        x, _, _ = batch(lengths, seed=i)
        a, b = packed(x, lengths), padded(x, lengths)
        close(a[0], b[0], f"{lengths}")
        close(a[0], _np_products(x, lengths), f"{lengths}", rtol=1e-5)
        row_length = smallest(tb, int(lengths.max()))
        real += int(lengths.sum())
        pack_cells += smallest(bb, first_fit_rows(lengths, row_length)) * row_length
        pad_cells += smallest(bb, len(lengths)) * row_length
    assert packed.stats.padding_efficiency == pytest.approx(real / pack_cells)
    assert padded.stats.padding_efficiency == pytest.approx(real / pad_cells)
    assert packed.stats.padding_efficiency >= 1.5 * padded.stats.padding_efficiency
    assert packed.traces == padded.traces == 1


CUMULATIVE = {
    "cumsum reversed": (functools.partial(jax.lax.cumsum, axis=1, reverse=True),
                        lambda r: np.cumsum(r[::-1], 0)[::-1]),
    "cumprod": (functools.partial(jax.lax.cumprod, axis=1), lambda r: np.cumprod(r, 0)),
    "cummax": (functools.partial(jax.lax.cummax, axis=1), lambda r: np.maximum.accumulate(r)),
    "cummin reversed": (functools.partial(jax.lax.cummin, axis=1, reverse=True),
                        lambda r: np.minimum.accumulate(r[::-1])[::-1]),
    "cumlogsumexp": (functools.partial(jax.lax.cumlogsumexp, axis=1),
                     lambda r: np.logaddexp.accumulate(r)),
    # Windows, forward only: a window's gradient pads the length past each sequence's room
    # (a sum's) or selects and scatters (a max's), both refused.
    "moving sum": (lambda x: jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 3, 1), (1, 1, 1),
                                                   "SAME"),
                   lambda r: _np_window(r, np.sum, 0.0, 3, 1)),
    "dilated sum, no padding": (
        lambda x: jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 1), (1, 1, 1), "VALID",
                                        window_dilation=(1, 2, 1)),
        lambda r: r[:-2] + r[2:] if len(r) > 2 else r[:0]),
    "max window": (lambda x: jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 1),
                                                   (1, 1, 1), "SAME"),
                   lambda r: _np_window(r, np.max, -np.inf, 3, 1)),
    "min window": (lambda x: jax.lax.reduce_window(x, jnp.inf, jax.lax.min, (1, 2, 1),
                                                   (1, 1, 1), "SAME"),
                   lambda r: _np_window(r, np.min, np.inf, 2, 0)),
    # Sorts (their gradients: test_sorting_gathers_and_their_gradients_...).
    "sort": (functools.partial(jnp.sort, axis=1), lambda r: np.sort(r, 0)),
    "argsort, stable": (lambda x: jnp.argsort(jnp.round(x[..., 0]), axis=1, stable=True),
                        lambda r: np.argsort(np.round(r[:, 0]), kind="stable")),   # ties
}


@pytest.mark.parametrize("name", list(CUMULATIVE))
@given(lengths=lengths_strategy, seed=st.integers(0, 2 ** 16))
@example(lengths=[1] * 8, seed=0)
@example(lengths=[5, 1, 8, 3, 2, 1, 4, 7], seed=1)
def test_cumulative_ops_windows_and_sorts_run_per_sequence_in_packed_rows(name, lengths, seed):
    op, alone = CUMULATIVE[name]
    f = _cumulative_step(name)
    x, _, _ = batch(lengths, seed)
    got = np.asarray(f(x, np.asarray(lengths, np.int32)))
    assert f.plan.can_pack, f.plan.packing_reason
    for b, n in enumerate(lengths):
        want = alone(x[b, :n].astype(np.float64))
        close(got[b, :len(want)], want, f"{name}: sequence {b} (length {n}) of {lengths}",
              rtol=1e-5, atol=1e-5)


def _np_window(r, op, init, size, low):
    """Each token's window of ``size`` starting ``low`` before it, ``init`` past the edges."""
    edge = np.full((size,) + r.shape[1:], init)
    padded = np.concatenate([edge[:low], r, edge[:size - 1 - low]])
    if not len(r):
        return r
    return np.stack([op(padded[i:i + size], axis=0) for i in range(len(r))])


@functools.cache
def _cumulative_step(name):
    return px.bucketed(lambda x, lengths: CUMULATIVE[name][0](x), SPECS_V,
                       buckets={T: [8, 32], B: [8]}, layout="pack", strict=True)


# -- room after each sequence: lengths T + c pack ----------------------------------------------
# A value of length T + 2 (``jnp.pad`` by one cell each side) holds positions n and n + 1 of
# each sequence after its own cells: the packed row leaves that room after every sequence.

T1 = px.LengthVar("T", min=1, max=32)           # sequences of one token
ROOM_W = jnp.asarray(np.random.default_rng(38).normal(size=(F, F)), jnp.float32)


def _smooth(q):
    return (q[:-2] + q[1:-1] + q[2:]) / 3


def _mean_pool(h):
    # Window 2, stride 1, padded at the end to T + 1, cut back to T: each token and the next.
    s = jax.lax.reduce_window(h, 0.0, jax.lax.add, (2, 1), (1, 1), ((0, 1), (0, 0)))
    return s[:h.shape[0]] / 2


def _edge_smooth_batched(x):
    # Written over the batch: jnp.pad slices the rows into empty pieces for the (0, 0) axis.
    q = jnp.pad(x, ((0, 0), (1, 1), (0, 0)), mode="edge")
    return (q[:, :-2] + q[:, 1:-1] + q[:, 2:]) / 3


# name -> (one sequence (n, F) -> (e(n), F), the same over the batch, the program's room, T)
ROOM = {
    "edge smoothing": (lambda h: _smooth(jnp.pad(h, ((1, 1), (0, 0)), mode="edge")),
                       None, 2, T1),
    "edge smoothing, batched": (lambda h: _smooth(jnp.pad(h, ((1, 1), (0, 0)), mode="edge")),
                                _edge_smooth_batched, 2, T1),
    "zero smoothing": (lambda h: _smooth(jnp.pad(h, ((1, 1), (0, 0)))), None, 2, T1),
    # Returns T + 2 positions; JAX's reflect needs T >= 2.
    "reflect": (lambda h: jnp.pad(h, ((1, 1), (0, 0)), mode="reflect"), None, 2, T),
    "average pool": (_mean_pool, None, 1, T1),
    # Flax's shift_right: through a length T + 1, then back to T.
    "shift right": (lambda h: jnp.pad(h, ((1, 0), (0, 0)))[:-1], None, 1, T1),
}


def _room_loss(per_token, w, x):
    out = per_token(jnp.tanh(x @ w))
    return jnp.sum(jnp.sin(out) * out), out


@functools.cache
def _room_step(name):
    per_row, batched, _, var = ROOM[name]
    each = batched or jax.vmap(per_row)

    def step(w, x, lengths):
        (total, out), (gw, gx) = jax.value_and_grad(
            lambda w, x: _room_loss(each, w, x), (0, 1), has_aux=True)(w, x)
        return {"sum": total, "out": out, "grad_w": gw, "grad_x": gx}
    specs = (None, px.Spec("B T 3", jnp.float32, pad=PAD),
             px.Spec("B", jnp.int32, lengths_of="T"))
    return px.bucketed(step, specs, buckets={var: [8, 32], B: [8]}, layout="pack", strict=True)


@functools.cache
def _room_alone(name):
    """The reference: one sequence alone at its exact length, its value and the gradients of
    the weights and of the input, under plain jax.jit (one program a length, not op by op)."""
    per_row = ROOM[name][0]
    return jax.jit(jax.value_and_grad(lambda w, r: _room_loss(per_row, w, r), (0, 1),
                                      has_aux=True))


@pytest.mark.parametrize("name", list(ROOM))
@settings(max_examples=2)   # a reference compile per length; the examples cover the edges
@given(lengths=st.lists(st.integers(1, T.max), min_size=1, max_size=B.max))
@example(lengths=[1])
@example(lengths=[8])                        # fills the T columns; its room lies past them
@example(lengths=[3, 3])                     # 3 + 2 + 3 (+ 2 past the row): full to column 7
@example(lengths=[5, 1, 8, 3, 2, 1, 4, 7])
@example(lengths=[30, 1, 32, 2])
def test_lengths_past_t_pack_in_the_room_after_each_sequence(name, lengths):
    _, _, room, var = ROOM[name]
    lengths = [max(n, var.min) for n in lengths]
    f = _room_step(name)
    x, _, _ = batch(lengths, seed=sum(lengths))
    got = f(ROOM_W, x, np.asarray(lengths, np.int32))
    assert f.plan.can_pack, f.plan.packing_reason
    assert f.plan.packing_room == room
    total, grad_w = 0.0, np.zeros((F, F))
    for b, n in enumerate(lengths):
        # Each sequence alone at its exact length: values, and the gradients of the input
        # and of the weights.
        (t, out), (gw, gx) = _room_alone(name)(ROOM_W, x[b, :n])
        total, grad_w = total + float(t), grad_w + np.asarray(gw)
        where = f"{name}: sequence {b} (length {n}) of {lengths}"
        e = out.shape[0]
        close(got["out"][b, :e], out, f"out, {where}", rtol=1e-5, atol=1e-5)
        close(got["grad_x"][b, :n], gx, f"grad_x, {where}", rtol=1e-5, atol=1e-5)
        assert np.all(got["out"][b, e:] == 0) and np.all(got["grad_x"][b, n:] == 0), where
    close(got["sum"], total, f"{name}: the sum, {lengths}", rtol=1e-5, atol=1e-4)
    close(got["grad_w"], grad_w, f"{name}: grad_w, {lengths}", rtol=1e-4, atol=1e-4)
    # Two sequences of 3 share one row of 8 (asked for one row: more would spread them): the
    # first one's room lies between them, the second ends at the row's last column and keeps
    # its room past it.
    row, rows = f.with_layout("pack", {8: 1}).packing_of([3, 3], ROOM_W)
    assert rows == 1 and row.tolist() == [0, 0]


def test_the_room_is_counted_by_the_plan_and_a_program_without_one_packs_as_before():
    """Every packed step a plan of lengths makes with the program's room runs at the rows the
    plan gave it; without the room the plan undercounts. A program with no length past T
    packs exactly as first-fit packs the lengths alone."""
    smooth = _room_step("zero smoothing")
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 33, size=200)
    room = smooth.plan_for(ROOM_W).packing_room
    assert room == 2
    undercounted = 0
    for with_room in (room, 0):
        plan = buckets.packed_batch_plan(lengths, [8, 32], max_tokens=64, seed=0,
                                         room=with_room)
        assert sorted(np.concatenate([b.indices for b in plan]).tolist()) == list(range(200))
        pinned = smooth.with_layout("pack", {8: 64 // 8, 32: 64 // 32})
        for b in plan:
            _, rows = pinned.packing_of(lengths[b.indices], ROOM_W)
            if with_room:
                assert rows == b.rows, (b.row_length, lengths[b.indices].tolist())
            else:
                undercounted += rows > b.rows
    assert undercounted, "the plan without the room should have needed more rows somewhere"
    # k = 0: the layout is first-fit's, unchanged.
    plain = px.bucketed(products, SPECS_V, buckets={T: [8], B: [8]}, layout="pack")
    assert plain.plan_for().packing_room == 0
    for lengths in ([5, 3, 8, 2], [1] * 8, [4, 4, 3, 1, 2, 2]):
        row, rows = plain.packing_of(lengths)
        assert row.tolist() == buckets.balanced_fit(lengths, 8, rows).row.tolist()


def test_auto_layout_packs_when_it_can_and_pads_silently_otherwise():
    x, _, _ = batch([3, 2, 1], seed=0)
    lengths = np.asarray([3, 2, 1], np.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        good = px.bucketed(products, SPECS_V, buckets={T: [8], B: [1, 8]}, layout="auto")
        close(good(x, lengths)[0], _np_products(x, lengths), "auto, packable", rtol=1e-5)
        assert good.plan.can_pack and set(good.stats.buckets) == {
            (("rows(B)", 1), ("row_length(T)", 8))}
        bad = px.bucketed(key_argmax, SPECS_V, buckets={T: [8], B: [1, 8]}, layout="auto")
        close(bad(x, lengths)[1, :2], np.argmax(x[1, :2] @ x[1, :2].T, -1), "auto, unpackable")
        assert not bad.plan.can_pack and set(bad.stats.buckets) == {(("B", 8), ("T", 8))}


# -- 4. the training example ----------------------------------------------------------------------

def test_the_char_lm_trains_the_same_packed_as_padded():
    eqx = pytest.importorskip("equinox")
    from examples.rnn.model import CharLM, loss_fn, masked_loss_fn

    model = CharLM(hidden=8, embed=4, key=jax.random.PRNGKey(0))
    specs = (None, px.Spec("B T", jnp.int32), px.Spec("B", jnp.int32, lengths_of="T"))

    def step(m, tokens, lengths):
        return jax.value_and_grad(loss_fn)(m, tokens, lengths)

    options = dict(buckets={T: [32], B: [8]}, strict=True)
    packed = px.bucketed(step, specs, layout="pack", **options)
    padded = px.bucketed(step, specs, layout="pad", **options)
    # The exact loss: masked by hand at one fixed shape, under plain jax.jit.
    exact = jax.jit(jax.value_and_grad(masked_loss_fn))
    rng = np.random.default_rng(3)
    for lengths in ([5, 17, 3, 30, 9, 2, 12], [1, 2, 32], [4] * 8, [31, 1, 16, 16]):
        lengths = np.asarray(lengths, np.int32)
        tokens = rng.integers(1, 256, (len(lengths), max(int(lengths.max()), 2))).astype(np.int32)
        tokens[np.arange(tokens.shape[1])[None, :] >= lengths[:, None]] = 255  # never read
        buf = np.zeros((8, 32), np.int32)
        buf[:len(lengths), :tokens.shape[1]] = np.where(
            np.arange(tokens.shape[1])[None, :] < lengths[:, None], tokens, 0)
        n = np.zeros(8, np.int32)
        n[:len(lengths)] = lengths
        (l1, g1), (l2, g2), (l3, g3) = (packed(model, tokens, lengths),
                                        padded(model, tokens, lengths), exact(model, buf, n))
        where = f"lengths {lengths.tolist()}"
        close(l1, l2, f"loss packed vs padded, {where}", rtol=1e-5, atol=1e-6)
        close(l1, l3, f"loss packed vs exact, {where}", rtol=1e-5, atol=1e-6)
        a, b, c = (eqx.filter(g, eqx.is_array) for g in (g1, g2, g3))
        assert_trees_close(a, b, rtol=1e-4, atol=1e-6)
        assert_trees_close(a, c, rtol=1e-4, atol=1e-6)
    assert packed.plan.can_pack and packed.traces == 1 and packed.stats.compiles == 1
    assert all(k[0][0] == "rows(B)" for k in packed.stats.buckets)
