"""layout="pack" for models with several ragged lengths over the same rows: an encoder over a
source ``S`` and a decoder over a target ``T``, both ragged along ``B``. Each example's source
and target go into the same row of their own variable's grid, so cross-attention's
``(B, T, S)`` scores, an encoder state handed to the decoder and attention inside the
decoder's scan see only their own example. The model code is unchanged: no segment ids, no
masks.

1. Packed == padded (loss, per-token and per-example outputs, gradients), on lengths where
   packing bugs live, the source poisoned beyond each length (NaN) and in the executor's
   padding (1e3).
2. Packed == each example alone under jax.jit, token-weighted.
3. A term that couples examples (a dual encoder's in-batch contrastive loss) cannot pack: it
   runs padded with its reason naming the user's line, and still equals the exact result.
4. `joint_first_fit` keeps an example's parts in one row, every example exactly once; a
   warmup compiles each grid once; attention weights come back per example.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, strategies as st

import buckets
import polyexec as px

from conftest import assert_trees_close, packed_and_padded, train_step

B = px.LengthVar("B", max=6)
S = px.LengthVar("S", min=1, max=12)
T = px.LengthVar("T", min=2, max=12)
V, H, F = 7, 4, 3
PAD = 1e3
SPECS = (None, px.Spec("B S 3", jnp.float32, pad=PAD), px.Spec("B T", jnp.int32),
         px.Spec("B", jnp.int32, lengths_of="S"), px.Spec("B", jnp.int32, lengths_of="T"), None)
BUCKETS = {S: [12], T: [12], B: [6]}

_rng = np.random.default_rng(0)
PARAMS = {name: jnp.asarray(_rng.normal(size=shape) * 0.5, jnp.float32)
          for name, shape in [("emb", (V, H)), ("inp", (F, H)), ("pe", (12, H)), ("q", (H, H)),
                              ("k", (H, H)), ("v", (H, H)), ("enc", (H, H)), ("dec", (H, H)),
                              ("out", (H, V))]}


def attend(p, q, kv, causal=False):
    scores = jnp.einsum("btd,bsd->bts", q @ p["q"], kv @ p["k"]) / np.sqrt(H)
    if causal:
        scores = jnp.where(jnp.tri(q.shape[1], dtype=bool), scores, -1e9)
    return jax.nn.softmax(scores, axis=-1) @ (kv @ p["v"])


def rnn(w, x, h0):
    def step(h, xt):
        h = jnp.tanh(xt + h @ w)
        return h, h
    h, hs = jax.lax.scan(step, h0, jnp.swapaxes(x, 0, 1))
    return h, jnp.swapaxes(hs, 0, 1)


def layer_norm(x):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)


def next_token_loss(p, y, tgt):
    logits = y @ p["out"]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tgt[:, 1:, None], -1)[..., 0]
    return jnp.mean(nll), logits


# Each: (params, src (B, S, F), tgt (B, T), src_lengths, tgt_lengths, key) -> (loss, outputs).

def gru_encoder_attention_decoder(p, src, tgt, src_lengths, tgt_lengths, key):
    _, enc = rnn(p["enc"], src @ p["inp"], jnp.zeros((src.shape[0], H)))
    y = p["emb"][tgt[:, :-1]]
    y = y + attend(p, y, y, causal=True)
    y = y + attend(p, y, enc)                                   # cross-attention (B, T, S)
    loss, logits = next_token_loss(p, y, tgt)
    return loss, logits


def transformer_encoder_decoder(p, src, tgt, src_lengths, tgt_lengths, key):
    x = src @ p["inp"] + p["pe"][:src.shape[1]]
    x = layer_norm(x + attend(p, x, x))
    y = p["emb"][tgt[:, :-1]] + p["pe"][:tgt.shape[1] - 1]
    y = layer_norm(y + attend(p, y, y, causal=True))
    y = layer_norm(y + attend(p, y, x))
    k1, k2, k3 = jax.random.split(key, 3)          # dropout on both sides: draws per cell
    x_drop = jnp.where(jax.random.bernoulli(k1, 0.8, x.shape), x / 0.8, 0)
    y = y + 0.1 * jnp.where(jax.random.bernoulli(k2, 0.8, y.shape), y / 0.8, 0)
    # A draw per example and each example's index: made with the rows alone, then met by
    # the target's cells.
    y = y + 0.1 * jax.random.normal(k3, (y.shape[0], H))[:, None] + 0.01 * jnp.arange(
        y.shape[0])[:, None, None]
    loss, logits = next_token_loss(p, y + attend(p, y, x_drop), tgt)
    return loss, logits


def encoder_state_into_decoder(p, src, tgt, src_lengths, tgt_lengths, key):
    # The encoder's final state starts the decoder's scan, and its mean over the source is
    # added at every target step: per-example values moved from the source's grid to the
    # target's. The decoder's final state comes back per example.
    h, enc = rnn(p["enc"], src @ p["inp"], jnp.zeros((src.shape[0], H)))
    y = p["emb"][tgt[:, :-1]] + jnp.mean(enc, axis=1)[:, None, :]
    last, dec = rnn(p["dec"], y, h)
    loss, _ = next_token_loss(p, dec, tgt)
    return loss, {"decoder_state": last, "source_length": src.shape[1] + 0 * tgt_lengths}


def attention_inside_decoder_scan(p, src, tgt, src_lengths, tgt_lengths, key):
    # Bahdanau-style: each decoder step attends the encoder's states, masked by hand from the
    # source lengths, with the previous step's weights (location) and their running sum
    # (coverage) carried over the source's cells.
    _, enc = rnn(p["enc"], src @ p["inp"], jnp.zeros((src.shape[0], H)))
    mask = jnp.arange(src.shape[1])[None, :] < src_lengths[:, None]

    def step(carry, y_t):
        h, previous, coverage = carry
        scores = jnp.einsum("bh,bsh->bs", h @ p["q"], enc @ p["k"]) + previous - coverage
        w = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
        h = jnp.tanh(y_t + jnp.einsum("bs,bsh->bh", w, enc) @ p["v"] + h @ p["dec"])
        return (h, w, coverage + w), (h, w)

    zeros = jnp.zeros(src.shape[:2])
    y = jnp.swapaxes(p["emb"][tgt[:, :-1]], 0, 1)
    (last, _, coverage), (hs, ws) = jax.lax.scan(
        step, (jnp.zeros((src.shape[0], H)), zeros, zeros), y)
    loss, _ = next_token_loss(p, jnp.swapaxes(hs, 0, 1), tgt)
    # The weights come back per example: its (T - 1, S) block.
    return loss, {"coverage": coverage, "decoder_state": last, "weights": jnp.swapaxes(ws, 0, 1)}


CASES = [gru_encoder_attention_decoder, transformer_encoder_decoder,
         encoder_state_into_decoder, attention_inside_decoder_scan]
KEY = jax.random.key(5)


@functools.cache
def functions(case):
    return packed_and_padded(case, SPECS, BUCKETS)


def batch(src_lengths, tgt_lengths, seed):
    src_lengths, tgt_lengths = (np.asarray(n, np.int32) for n in (src_lengths, tgt_lengths))
    rng = np.random.default_rng(seed)
    src = np.full((len(src_lengths), int(src_lengths.max()), F), np.nan, np.float32)
    tgt = np.full((len(tgt_lengths), int(tgt_lengths.max())), -1, np.int32)
    for b, (n, m) in enumerate(zip(src_lengths, tgt_lengths)):
        src[b, :n] = rng.normal(size=(n, F))
        tgt[b, :m] = rng.integers(0, V, m)
    return src, tgt, src_lengths, tgt_lengths


pairs = st.lists(st.tuples(st.integers(S.min, S.max), st.integers(T.min, T.max)),
                 min_size=1, max_size=B.max)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_several_lengths_packed_equal_padded(case):
    packed, padded = functions(case)

    @given(pairs=pairs, seed=st.integers(0, 2 ** 16))
    @example(pairs=[(12, 2), (1, 12), (6, 6), (5, 6)], seed=1)   # full rows either way
    @example(pairs=[(1, 2)] * 6, seed=2)                         # six examples in one row
    def check(pairs, seed):
        args = batch(*zip(*pairs), seed)
        got, want = packed(PARAMS, *args, KEY), padded(PARAMS, *args, KEY)
        assert_trees_close(got, want, rtol=1e-4, atol=1e-5)

    check()
    # Every call ran packed, through one trace.
    assert packed.traces == 1 and packed.plan.packing_reason is None


@pytest.mark.parametrize("case", CASES[:1] + CASES[2:], ids=lambda c: c.__name__)
def test_several_lengths_packed_equal_each_example_alone(case):
    """Token-weighted: the loss is a mean over the batch's target tokens."""
    packed, _ = functions(case)
    src, tgt, src_lengths, tgt_lengths = batch([3, 8, 1, 12], [6, 2, 5, 3], seed=4)
    got = packed(PARAMS, src, tgt, src_lengths, tgt_lengths, KEY)
    alone = jax.jit(train_step(case))
    loss, grads, tokens = 0.0, jax.tree.map(jnp.zeros_like, PARAMS), int(np.sum(tgt_lengths - 1))
    for b, (n, m) in enumerate(zip(src_lengths, tgt_lengths)):
        one = alone(PARAMS, src[b:b + 1, :n], tgt[b:b + 1, :m], src_lengths[b:b + 1],
                    tgt_lengths[b:b + 1], KEY)
        share = (m - 1) / tokens
        loss += float(one["loss"]) * share
        grads = jax.tree.map(lambda g, o: g + o * share, grads, one["grad"])
        first = jax.tree.map(lambda leaf: leaf[0], one["out"])
        # Each output's row of the example, cut to its own positions (logits, coverage).
        mine = jax.tree.map(lambda leaf, f: np.asarray(leaf)[b][tuple(map(slice, f.shape))],
                            got["out"], first)
        assert_trees_close(mine, first, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(got["loss"]), loss, rtol=1e-5)
    assert_trees_close(got["grad"], grads, rtol=1e-4, atol=1e-5)


def dual_encoder(p, queries, docs, query_lengths, doc_lengths):
    # Two towers, pooled, and an in-batch contrastive loss: every query meets every document.
    _, q = rnn(p["enc"], queries @ p["inp"], jnp.zeros((queries.shape[0], H)))
    _, d = rnn(p["dec"], p["emb"][docs], jnp.zeros((docs.shape[0], H)))
    scores = q.mean(1) @ d.max(1).T
    return -jnp.mean(jnp.diag(jax.nn.log_softmax(scores, axis=-1)))


def test_a_term_coupling_examples_runs_padded_naming_its_line():
    specs = SPECS[:-1]
    src, tgt, src_lengths, tgt_lengths = batch([3, 12, 1, 7], [12, 2, 5, 9], seed=6)
    f = px.bucketed(jax.value_and_grad(dual_encoder), specs, buckets=BUCKETS, layout="pack")
    with pytest.warns(UserWarning, match=r"cannot run packed rows.*scores = q.mean\(1\) @ d"):
        loss, grads = f(PARAMS, src, tgt, src_lengths, tgt_lengths)
    assert "test_several_lengths.py" in f.plan.packing_reason

    # The exact result: each tower alone at its example's lengths, the loss over the batch.
    def towers(p, b):
        n, m = src_lengths[b], tgt_lengths[b]
        _, q = rnn(p["enc"], src[b:b + 1, :n] @ p["inp"], jnp.zeros((1, H)))
        _, d = rnn(p["dec"], p["emb"][tgt[b:b + 1, :m]], jnp.zeros((1, H)))
        return q.mean(1)[0], d.max(1)[0]

    def exact(p):
        q, d = (jnp.stack(v) for v in zip(*(towers(p, b) for b in range(len(src)))))
        return -jnp.mean(jnp.diag(jax.nn.log_softmax(q @ d.T, axis=-1)))

    want_loss, want_grads = jax.jit(jax.value_and_grad(exact))(PARAMS)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    assert_trees_close(grads, want_grads, rtol=1e-4, atol=1e-5)
    strict = px.bucketed(jax.value_and_grad(dual_encoder), specs, buckets=BUCKETS,
                         layout="pack", strict=True)
    with pytest.raises(px.PolymorphismError, match="pairs the sequences"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        strict(PARAMS, src, tgt, src_lengths, tgt_lengths)


@given(cells=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 5)), max_size=40))
def test_joint_first_fit_keeps_each_examples_parts_in_one_row(cells):
    widths = {"S": 9, "T": 5}
    need = {"S": np.array([c[0] for c in cells], np.int64),
            "T": np.array([c[1] for c in cells], np.int64)}
    row, start, rows = buckets.joint_first_fit(need, widths)
    for var, width in widths.items():
        taken = np.zeros((max(rows, 1), width), np.int32)
        for i in range(len(cells)):
            assert 0 <= row[i] < max(rows, 1) and start[var][i] + need[var][i] <= width
            taken[row[i], start[var][i]:start[var][i] + need[var][i]] += 1
        assert taken.max(initial=0) <= 1                    # no cell holds two examples
        assert taken.sum() == need[var].sum()               # every example's cells, once


def test_warmup_compiles_each_grid_and_packing_of_names_each_examples_row():
    def cross(src, tgt, src_lengths, tgt_lengths):           # (B, T, F): per target cell
        scores = 0.1 * tgt[:, :, None] * src[:, None, :, 0]     # (B, T, S)
        return jax.nn.softmax(scores, axis=-1) @ src
    f = px.bucketed(cross, SPECS[1:5], buckets={S: [12], T: [6, 12], B: [6]}, layout="pack",
                    strict=True)
    f.warmup()
    assert f.stats.compiles == 2                      # one per (rows, S row, T row) grid
    src, tgt, src_lengths, tgt_lengths = batch([3, 8, 1, 12], [6, 2, 5, 3], seed=7)
    with px.forbid_compiles():
        packed = f(src, tgt, src_lengths, tgt_lengths)
    np.testing.assert_allclose(packed, f.with_layout("pad")(src, tgt, src_lengths, tgt_lengths),
                               rtol=1e-5, atol=1e-6)
    row, rows = f.packing_of({"S": src_lengths, "T": tgt_lengths})
    assert rows == 6 and len(row) == 4 and row.max() < rows


def test_attention_weights_of_one_length_come_back_per_sequence():
    def weights(x, lengths):                # (B, 1, T, T): each sequence's own causal block
        scores = jnp.einsum("btd,bsd->bts", x, x)
        w = jax.nn.softmax(jnp.where(jnp.tri(x.shape[1], dtype=bool), scores, -1e9), axis=-1)
        return jnp.swapaxes(w, 1, 2)[:, None]

    T1 = px.LengthVar("T", min=1, max=12)
    specs = (px.Spec("B T 3", jnp.float32, pad=np.nan), px.Spec("B", jnp.int32, lengths_of="T"))
    f = px.bucketed(weights, specs, buckets={T1: [12], B: [6]}, layout="pack", strict=True)
    lengths = np.array([5, 1, 7, 3])
    x = np.random.default_rng(8).normal(size=(4, 7, 3)).astype(np.float32)
    got = f(x, lengths)
    for b, n in enumerate(lengths):
        alone = jax.jit(weights)(x[b:b + 1, :n], lengths[b:b + 1])[0]
        np.testing.assert_allclose(got[b, :, :n, :n], alone, rtol=1e-5, atol=1e-6)
        assert not np.any(got[b, :, n:]) and not np.any(got[b, :, :, n:])



def test_auto_layout_prices_every_grid_and_packs_when_fewer_cells():
    """layout="auto" per call: packed when the packed grids (rows x each row length, summed
    over the lengths) hold fewer cells than the padded (B, S) and (B, T) buckets."""
    def cross(src, tgt, src_lengths, tgt_lengths):
        scores = 0.1 * tgt[:, :, None] * src[:, None, :, 0]
        return jax.nn.softmax(scores, axis=-1) @ src

    f = px.bucketed(cross, SPECS[1:5], buckets={S: [12], T: [12], B: [2, 6]}, layout="auto")
    short = batch([2, 3, 1, 2], [3, 2, 4, 2], seed=9)      # one row holds them: 2 x 12 < 6 x 12
    long = batch([12, 11], [12, 10], seed=9)                # two full rows: no fewer cells
    for args in (short, long):
        np.testing.assert_allclose(f(*args), f.with_layout("pad")(*args), rtol=1e-5, atol=1e-6)
    ran = sorted(" ".join(f"{n}={s}" for n, s in key) for key in f.stats.buckets)
    assert ran == ["B=2 S=12 T=12", "B=6 S=12 T=12",
                   "rows(B)=2 row_length(S)=12 row_length(T)=12"], ran
