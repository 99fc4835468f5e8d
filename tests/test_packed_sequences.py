"""layout="pack" with per-sequence values: one entry per sequence, which has no cell of its own
in a packed row -- a scan's final carry, ``x[:, -1]``, a mean or a max over T, ``argmax``
along T, ``x.shape[1]`` as a number, and ``(B,)`` inputs such as the lengths and the labels.
The model code is unchanged; each sequence gets its own.

1. Packed == padded, for the loss, the per-sequence outputs and the gradients, on lengths where
   packing bugs live (0, 1, a row filled exactly, many tiny sequences in one row), inputs
   poisoned beyond each length (NaN) and in the executor's padding (1e3).
2. The per-sequence outputs equal each sequence run alone (numpy).
3. A classifier on the final carry: the packed gradient equals the mean of each sequence's own
   gradient, each computed by jax.jit at its exact length.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import example, given, strategies as st

import polyexec as px

from conftest import assert_trees_close, packed_and_padded, train_step

T = px.LengthVar("T", min=2, max=32)
B = px.LengthVar("B", max=8)
F, H, C = 3, 4, 2
PAD = 1e3
SPECS = (None, px.Spec("B T 3", jnp.float32, pad=PAD), px.Spec("B", jnp.int32, lengths_of="T"),
         px.Spec("B", jnp.int32))
BUCKETS = {T: [8, 32], B: [8]}

_rng = np.random.default_rng(0)
PARAMS = {name: jnp.asarray(_rng.normal(size=shape) * scale, jnp.float32)
          for name, shape, scale in [("W", (H, H), 0.6), ("U", (F, H), 1.0), ("V", (H,), 1.0),
                                     ("head", (H, C), 1.0), ("h0", (H,), 0.5)]}


def rnn(p, x, h0, reverse=False):
    """(B, T, F) -> final carry (B, H), outputs (B, T, H): an Elman RNN, plain lax.scan."""
    def step(h, xt):
        h = jnp.tanh(h @ p["W"] + xt @ p["U"])
        return h, h
    h, hs = jax.lax.scan(step, h0, jnp.swapaxes(x, 0, 1), reverse=reverse)
    return h, jnp.swapaxes(hs, 0, 1)


def zeros(x):
    return jnp.zeros((x.shape[0], H))


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# Each: (params, x, lengths, labels) -> (loss, per-sequence output). No mask, no segment ids.

def final_carry(p, x, lengths, labels):
    h, _ = rnn(p, x, zeros(x))
    return cross_entropy(h @ p["head"], labels), h @ p["head"]


def reverse_from_learned_state(p, x, lengths, labels):
    # The initial carry broadcast from a parameter; the final carry of a reverse scan is each
    # sequence's state after its first token.
    h, _ = rnn(p, x, jnp.broadcast_to(p["h0"], (x.shape[0], H)), reverse=True)
    return cross_entropy(h @ p["head"], labels), h


def mean_pooled(p, x, lengths, labels):
    _, hs = rnn(p, x, zeros(x))
    pooled = jnp.mean(hs, axis=1)                       # divides by x.shape[1]: each length
    return cross_entropy(pooled @ p["head"], labels), pooled


def last_token(p, x, lengths, labels):
    _, hs = rnn(p, x, zeros(x))
    last = hs[:, -1]
    return jnp.mean((last @ p["head"]) ** 2), last


def first_token(p, x, lengths, labels):
    _, hs = rnn(p, x, zeros(x))
    first = hs[:, 0]
    return jnp.mean((first @ p["head"]) ** 2), first


def ends_per_example(p, x, lengths, labels):
    # Written for one example and vmapped: r[0] and r[-1] index each sequence's own ends.
    _, hs = rnn(p, x, zeros(x))
    ends = jax.vmap(lambda r: r[0] * r[-1])(hs)
    return jnp.mean((ends @ p["head"]) ** 2), ends


def attention_pooled(p, x, lengths, labels):
    # Softmax over each sequence's own tokens, then a contraction along T alone.
    _, hs = rnn(p, x, zeros(x))
    w = jax.nn.softmax(hs @ p["V"], axis=1)
    pooled = jnp.einsum("bt,bth->bh", w, hs)
    return cross_entropy(pooled @ p["head"], labels), pooled


def max_pooled_and_argmax(p, x, lengths, labels):
    _, hs = rnn(p, x, zeros(x))
    return cross_entropy(jnp.max(hs, axis=1) @ p["head"], labels), jnp.argmax(hs, axis=1)


def encoder_decoder(p, x, lengths, labels):
    # The decoder starts from each sequence's encoder state: a per-sequence initial carry.
    h, _ = rnn(p, x, zeros(x))
    _, hs = rnn(p, jnp.flip(x, 1) * 0.5, h)
    out = hs @ p["V"]
    return jnp.sum(out ** 2) / x.shape[0], h


def context_in_every_step(p, x, lengths, labels):
    # A per-sequence constant read at every step of a scan.
    context = jnp.tanh(jnp.mean(x, axis=1) @ p["U"])

    def step(h, xt):
        h = jnp.tanh(h @ p["W"] + xt @ p["U"] + context)
        return h, h @ p["V"]
    _, ys = jax.lax.scan(step, zeros(x), jnp.swapaxes(x, 0, 1))
    return jnp.sum(ys ** 2) / jnp.sum(lengths), context


def hand_masked(p, x, lengths, labels):
    # Masks written by hand for padded batches run packed too: the lengths are per sequence.
    _, hs = rnn(p, x, zeros(x))
    mask = px.sequence_mask(lengths, hs, axis=1)
    per_token = jnp.where(mask, hs @ p["V"], 0.0)
    return jnp.sum(per_token ** 2) / jnp.maximum(jnp.sum(mask), 1), jnp.sum(per_token, axis=1)


def centred(p, x, lengths, labels):
    # Each sequence's own mean broadcast back along it, and its length as a number.
    y = jnp.tanh((x - jnp.mean(x, axis=1, keepdims=True)) @ p["U"]) / x.shape[1]
    return jnp.sum(y ** 2), jnp.sum(y, axis=1)


def another_sequences_first_token(p, x, lengths, labels):
    # ``jnp.arange(B)`` counts the sequences (not the packed rows), and ``hs[rows, k]`` reads
    # the sequence each row names wherever it is packed: the next one's first state here.
    _, hs = rnn(p, x, zeros(x))
    b = jnp.arange(x.shape[0])
    picked = hs[(b + 1) % x.shape[0], 0] + b[:, None]
    return jnp.mean((picked @ p["head"]) ** 2), picked


CASES = [final_carry, reverse_from_learned_state, mean_pooled, last_token, first_token,
         ends_per_example, attention_pooled, another_sequences_first_token,
         max_pooled_and_argmax, encoder_decoder, context_in_every_step, hand_masked, centred]


@functools.cache
def functions(case):
    return packed_and_padded(case, SPECS, BUCKETS)


def batch(lengths, seed):
    lengths = np.asarray(lengths, np.int32)
    rng = np.random.default_rng(seed)
    x = np.full((len(lengths), max(int(lengths.max()), T.min), F), np.nan, np.float32)
    for b, n in enumerate(lengths):
        x[b, :n] = rng.normal(size=(n, F))
    return x, lengths, rng.integers(0, C, len(lengths)).astype(np.int32)


lengths_strategy = st.one_of(
    st.lists(st.sampled_from([0, 1, 2, 3, 7, 8, 9, 31, 32]) | st.integers(1, T.max),
             min_size=1, max_size=B.max),
    st.lists(st.integers(1, 3), min_size=4, max_size=B.max),                  # many tiny ones
    st.sampled_from([8, 32]).flatmap(
        lambda row: st.integers(1, row - 1).map(lambda k: [row, k, row - k])),  # exact fill
)


def close(a, b, what, rtol=1e-4, atol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol, err_msg=what,
                               equal_nan=True)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_per_sequence_values_packed_equal_padded(case):
    packed, padded = functions(case)

    @given(lengths=lengths_strategy, seed=st.integers(0, 2 ** 16))
    @example(lengths=[5, 1, 8, 3, 2, 1, 4, 7], seed=2)  # row length 8: 8 | 7+1 | 5+3 | 4+2+1
    @example(lengths=[1] * 8, seed=3)                   # eight sequences in one row
    @example(lengths=[32], seed=1)                      # one sequence fills the row
    @example(lengths=[2, 0, 3, 0], seed=5)               # empty sequences: a cell each
    def check(lengths, seed):
        if case in (last_token, first_token, ends_per_example,  # an empty sequence: no token
                    another_sequences_first_token):
            lengths = [max(k, 1) for k in lengths]
        x, n, labels = batch(lengths, seed)
        got, want = packed(PARAMS, x, n, labels), padded(PARAMS, x, n, labels)
        where = f"{case.__name__}, lengths {list(lengths)}"
        close(got["loss"], want["loss"], f"loss, {where}")
        assert np.shape(got["out"]) == np.shape(want["out"]), where
        close(got["out"], want["out"], f"per-sequence output, {where}")
        assert_trees_close(got["grad"], want["grad"], rtol=1e-4, atol=1e-4)

    check()
    assert packed.plan.can_pack, packed.plan.packing_reason
    assert packed.traces == 1 and all(s.compiles == 1 for s in packed.stats.buckets.values())
    assert all(k[0][0] == "rows(B)" for k in packed.stats.buckets)


def _np_rnn(r, h=None, reverse=False):
    W, U = (np.asarray(PARAMS[k], np.float64) for k in "WU")
    h = np.zeros(H) if h is None else h
    hs = []
    for xt in (r[::-1] if reverse else r):
        h = np.tanh(h @ W + xt @ U)
        hs.append(h)
    hs = np.array(hs[::-1] if reverse else hs).reshape(len(r), H)
    return h, hs


HEAD = np.asarray(PARAMS["head"], np.float64)


def _np_pooled(hs):
    s = hs @ np.asarray(PARAMS["V"], np.float64)
    w = np.exp(s - s.max())
    return (w / w.sum()) @ hs
# The per-sequence output of each case for one sequence alone, in numpy.
ALONE = {
    final_carry: lambda r: _np_rnn(r)[0] @ HEAD,
    reverse_from_learned_state: lambda r: _np_rnn(r, np.asarray(PARAMS["h0"]), True)[0],
    mean_pooled: lambda r: _np_rnn(r)[1].mean(0),
    last_token: lambda r: _np_rnn(r)[1][-1],
    first_token: lambda r: _np_rnn(r)[1][0],
    ends_per_example: lambda r: _np_rnn(r)[1][0] * _np_rnn(r)[1][-1],
    attention_pooled: lambda r: _np_pooled(_np_rnn(r)[1]),
    max_pooled_and_argmax: lambda r: _np_rnn(r)[1].argmax(0),
    centred: lambda r: np.tanh((r - r.mean(0)) @ np.asarray(PARAMS["U"])).sum(0) / len(r),
}


@pytest.mark.parametrize("case", list(ALONE), ids=lambda c: c.__name__)
def test_per_sequence_outputs_equal_each_sequence_alone(case):
    packed, _ = functions(case)
    for lengths in ([5, 1, 8, 3, 2, 1, 4, 7], [31, 1, 16, 16], [2, 2, 2]):
        x, n, labels = batch(lengths, seed=len(lengths))
        out = np.asarray(packed(PARAMS, x, n, labels)["out"])
        assert out.shape[0] == len(lengths)
        for b, k in enumerate(lengths):
            close(out[b], ALONE[case](x[b, :k].astype(np.float64)),
                  f"{case.__name__}: sequence {b} (length {k}) of {lengths}")


def test_a_classifier_on_the_final_carry_trains_exactly():
    packed = px.bucketed(train_step(final_carry), SPECS, buckets={T: [8], B: [8]},
                         layout="pack", strict=True)
    lengths = [5, 1, 8, 3, 2, 7, 8, 1]
    x, n, labels = batch(lengths, seed=11)
    got = packed(PARAMS, x, n, labels)
    alone = jax.jit(jax.value_and_grad(lambda p, r, y: final_carry(p, r, None, y)[0]))
    losses, grads = zip(*(alone(PARAMS, x[b:b + 1, :k], labels[b:b + 1])
                          for b, k in enumerate(lengths)))
    close(got["loss"], np.mean(losses), "the loss: the mean over sequences alone", rtol=1e-5)
    assert_trees_close(got["grad"], jax.tree.map(lambda *g: np.mean(g, axis=0), *grads),
                       rtol=1e-4, atol=1e-5)
    # Rows of 8 hold 8 | 8 | 7 + 1 | 5 + 3 | 2: 5 rows, run at B's bucket of 8.
    assert set(packed.stats.buckets) == {(("rows(B)", 8), ("row_length(T)", 8))}


def rows_reshaped(x, lengths):
    pooled = jnp.sum(x, axis=1)                                  # (B, 3): per sequence
    return jnp.reshape(pooled, (3, -1))  # refused: the rows' entries move to other rows


def test_an_equation_mixing_the_sequences_of_a_per_sequence_value_is_refused_at_its_line():
    # Run per column, a reshape (B, 3) -> (3, B) would mix the sequences sharing a column.
    specs = SPECS[1:3]
    packed = px.bucketed(rows_reshaped, specs, buckets={T: [8], B: [8]}, layout="pack")
    padded = px.bucketed(rows_reshaped, specs, buckets={T: [8], B: [8]}, layout="pad")
    x, n, _ = batch([5, 3, 8], seed=0)
    with pytest.warns(UserWarning, match="cannot run packed rows"):
        got = packed(x, n)
    close(got, padded(x, n), "the fallback to the pad layout")
    assert not packed.plan.can_pack
    assert "`return jnp.reshape(pooled, (3, -1))  # refused" in packed.plan.packing_reason
