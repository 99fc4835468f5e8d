"""Plain, unmasked JAX functions through `px.bucketed`, as a new user writes them.

Each runs padded (to buckets 8 and 32, padding NaN) at real sizes inside those buckets and is
compared with ``jax.jit(f)`` at the exact size, outputs as `bucketed` returns them (cut back to
their exact-size shapes, no ``out_specs``). Each must be exact, or flagged with a warning that
names its line here; none may be silently wrong. (`test_logical.py` checks each rewrite rule
at every bucket edge; this checks what a user sees.)
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import polyexec as px

W = np.random.default_rng(1).standard_normal((4, 4)).astype(np.float32)
EMBED = np.random.default_rng(2).standard_normal((10, 4)).astype(np.float32)


def _rnn(x, reverse=False):
    return lax.scan(lambda h, xi: (jnp.tanh(h @ W + xi), h), jnp.zeros(4), x, reverse=reverse)


def _layer_norm(x):
    return (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)


def _causal_attention(x):
    scores = jnp.where(jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool)), x @ x.T, -jnp.inf)
    return jax.nn.softmax(scores, -1) @ x


def _heads(x):                                   # (B, T, 4) -> two heads of 2
    q = x.reshape(*x.shape[:2], 2, 2)
    a = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, q), -1)
    return jnp.einsum("bhts,bshd->bthd", a, q).reshape(x.shape)


def _loop_sum(x):
    return lax.fori_loop(0, x.shape[0], lambda i, s: 0.9 * s + x[i], jnp.zeros(4))


EXACT, FLAGGED = "exact", "flagged"
T4, BT4, TOKENS = "T 4", "B T 4", "B T"

CASES = {
    "mean": (lambda x: x.mean(0), T4, EXACT),
    "var ddof=1": (lambda x: jnp.var(x, 0, ddof=1), T4, EXACT),
    "softmax over T": (lambda x: jax.nn.softmax(x, 0), T4, EXACT),
    "log_softmax over T": (lambda x: jax.nn.log_softmax(x, 0), T4, EXACT),
    "logsumexp of all": (lambda x: jax.nn.logsumexp(x), T4, EXACT),
    "min and argmin": (lambda x: (x.min(0), jnp.argmin(x, 0)), T4, EXACT),
    "any nan": (lambda x: jnp.any(jnp.isnan(x)), T4, EXACT),
    "norm": (lambda x: jnp.linalg.norm(x, axis=0), T4, EXACT),
    "median and percentile": (lambda x: (jnp.median(x, 0), jnp.percentile(x, 30, 0)), T4, EXACT),
    "covariance": (lambda x: jnp.cov(x.T), T4, EXACT),
    "gram matrix": (lambda x: x @ x.T, T4, EXACT),
    "causal attention": (_causal_attention, T4, EXACT),
    "multi-head attention": (_heads, BT4, EXACT),
    "positions scale": (lambda x: x * jnp.arange(x.shape[0])[:, None], T4, EXACT),
    "divide by length": (lambda x: x / x.shape[0], T4, EXACT),
    "length mod 3": (lambda x: x * (x.shape[0] % 3), T4, EXACT),
    "length returned in a dict": (lambda x: {"mean": x.mean(0), "n": x.shape[0]}, T4, EXACT),
    "eye matmul": (lambda x: jnp.eye(x.shape[0]) @ x, T4, EXACT),
    "row at argmax": (lambda x: x[jnp.argmax(x[:, 0])], T4, EXACT),
    "every other row": (lambda x: x[::2], T4, EXACT),
    "reversed every other row": (lambda x: x[::-2], T4, EXACT),
    "first differences": (lambda x: (x[1:] - x[:-1]).sum(0), T4, EXACT),
    "shift right": (lambda x: jnp.concatenate([jnp.zeros((1, 4)), x[:-1]]), T4, EXACT),
    "pad edge": (lambda x: jnp.pad(x, ((1, 2), (0, 0)), mode="edge"), T4, EXACT),
    "pad reflect": (lambda x: jnp.pad(x, ((2, 2), (0, 0)), mode="reflect"), T4, EXACT),
    "repeat": (lambda x: jnp.repeat(x, 2, axis=0), T4, EXACT),
    "tile and stack": (lambda x: jnp.stack([jnp.tile(x, (3, 2)), jnp.tile(x[::-1], (3, 2))]),
                       T4, EXACT),
    "outer product": (lambda x: jnp.outer(x[:, 0], x[:, 1]), T4, EXACT),
    "cumprod": (lambda x: jnp.cumprod(x, 0), T4, EXACT),
    "cummax reversed": (lambda x: lax.cummax(x, axis=0, reverse=True), T4, EXACT),
    "lexsort": (lambda x: jnp.lexsort((x[:, 0], x[:, 1])), T4, EXACT),
    "last row updated": (lambda x: x.at[-1].set(0.0), T4, EXACT),
    "segment sum": (lambda x: jax.ops.segment_sum(x, jnp.arange(x.shape[0]) % 3, 3), T4, EXACT),
    "rank scatter": (lambda x: jnp.zeros(x.shape[0]).at[jnp.argsort(x[:, 0])].set(
        jnp.arange(x.shape[0], dtype=jnp.float32)), T4, EXACT),
    "flatten": (lambda x: x.reshape(-1), T4, EXACT),
    "max pool VALID": (lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (3, 1), (1, 1),
                                                   "VALID"), T4, EXACT),
    "rnn states and final": (_rnn, T4, EXACT),
    "bidirectional rnn": (lambda x: _rnn(x)[0] + _rnn(x, reverse=True)[0], T4, EXACT),
    "fori_loop to length": (_loop_sum, T4, EXACT),
    "batch mean over T": (lambda x: x.mean(1), BT4, EXACT),
    "batch last step": (lambda x: x[:, -1], BT4, EXACT),
    "batch max over B": (lambda x: x.max(0), BT4, EXACT),
    "token embedding mean": (lambda t: jnp.asarray(EMBED)[t].mean(1), TOKENS, EXACT),
    "grad of softmax": (lambda x: jax.grad(lambda y: jax.nn.softmax(y, 0)[0, 0])(x), T4, EXACT),
    "grad of attention": (lambda x: jax.grad(lambda y: _causal_attention(y).sum())(x), T4, EXACT),
    "grad of rnn": (lambda x: jax.grad(lambda y: _rnn(y)[0].sum())(x), T4, EXACT),
    "grad of layer norm over T": (lambda x: jax.grad(lambda y: (_layer_norm(y.T) ** 2).sum())(x),
                                  T4, EXACT),
    "conv1d over features": (lambda x: lax.conv_general_dilated(
        x[None], jnp.ones((3, 4, 4)), (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))[0],
        T4, EXACT),
    "hessian-vector product": (lambda x: jax.jvp(jax.grad(lambda y: jnp.sum(jnp.sin(y) ** 2)
                                                          / y.shape[0]), (x,), (x,))[1], T4, EXACT),
    "batch loss and weight grad": (lambda x: jax.value_and_grad(
        lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(jnp.asarray(W)), BT4, EXACT),
    "grad of sort": (lambda x: jax.grad(lambda y: (jnp.sort(y, 0) * jnp.arange(
        y.shape[0])[:, None]).sum())(x), T4, EXACT),
    "remat mean": (lambda x: jax.checkpoint(lambda y: y.mean(0))(x), T4, EXACT),
    # No rule, or no symbolic program: each must say so at its line.
    "svd": (lambda x: jnp.linalg.svd(x, compute_uv=False), T4, FLAGGED),        # flagged
    "cholesky": (lambda x: jnp.linalg.cholesky(x @ x.T + 5 * jnp.eye(x.shape[0])),  # flagged
                 T4, FLAGGED),
    "length == 20": (lambda x: x * 2 if x.shape[0] == 20 else x, T4, FLAGGED),  # flagged
    # Recovered from concrete traces (`_recover`): the table at the max, sliced to T.
    "numpy table sliced": (lambda x: x + np.ones((64, 4))[: x.shape[0]], T4, EXACT),
    "fft": (lambda x: jnp.abs(jnp.fft.rfft(x, axis=0)), T4, FLAGGED),           # flagged
    # jnp's code calls a method a symbolic size lacks (``max(M, N).astype``): it was an
    # AttributeError out of the call, not a verdict.
    "matrix_rank": (lambda x: jnp.linalg.matrix_rank(x @ x.T), T4, FLAGGED),     # flagged
}

SIZES = {"T": (5, 20, 31), "B": (3,)}


def _input(dims: str, sizes: dict, rng) -> np.ndarray:
    shape = tuple(sizes[d] if d in sizes else int(d) for d in dims.split())
    if dims == TOKENS:
        return rng.integers(0, 10, shape).astype(np.int32)
    return rng.standard_normal(shape).astype(np.float32)


def _run(fn, dims):
    """(flagged warnings, sizes where bucketed differs from the exact-size result)."""
    T = px.LengthVar("T", min=3, max=32)
    B = px.LengthVar("B", max=4)
    dtype = jnp.int32 if dims == TOKENS else jnp.float32
    rng = np.random.default_rng(0)
    wrong = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = px.bucketed(fn, in_specs=(px.Spec(dims, dtype, pad=0 if dims == TOKENS else np.nan),),
                        buckets={T: [8, 32], B: [4]})
        for t in SIZES["T"]:
            x = _input(dims, {"T": t, "B": 3}, rng)
            got, want = jax.tree_util.tree_leaves(f(x)), jax.tree_util.tree_leaves(jax.jit(fn)(x))
            if not all(np.shape(g) == np.shape(w) and np.allclose(g, w, rtol=1e-4, atol=1e-4)
                       for g, w in zip(got, want)):
                wrong.append(t)
    return [str(w.message) for w in caught], wrong


@pytest.mark.parametrize("name", CASES)
def test_unmasked_function_is_exact_or_flagged_at_its_line(name):
    fn, dims, expected = CASES[name]
    messages, wrong = _run(fn, dims)
    flagged = [m for m in messages if __file__ in m and "# flagged" in m]
    if expected == EXACT:
        assert not messages and not wrong, (messages, wrong)
    else:
        assert flagged, f"expected a warning naming this file's line, got {messages}"
