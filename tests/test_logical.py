"""The logical-execution rewrite: padding never changes a result of plain, unmasked JAX code.

Every test runs a function the way polyexec does -- traced once over symbolic lengths, its
program rewritten by `polyexec._logical.rewrite`, exported, and called at a bucket with the
inputs padded by NaN/inf -- and compares it with ``jax.jit(f)`` at the exact size: values and,
where the function is differentiable, gradients (computed inside the traced function, so the
backward pass is part of the rewritten program). Outputs are compared on their logical prefix.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from collections.abc import Callable

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import export, lax
from jax.interpreters import mlir

import polyexec as px
from polyexec import OptionError
from polyexec._logical import Logical, Unsupported, rewrite

# --------------------------------------------------------------------------------------------
# Harness


@dataclasses.dataclass(frozen=True, eq=False)
class Case:
    """A plain function of arrays whose dims are names of length variables or ints."""

    fn: Callable
    dims: tuple                                  # per input, e.g. (("T", 4),)
    bounds: tuple = (("T", 1, 16),)              # (name, min, max) per length variable
    ints: tuple = ()                             # indices of int32 inputs (values 0..9)

    @property
    def names(self):
        return [b[0] for b in self.bounds]


def _buckets(lo: int, hi: int) -> list[int]:
    """The bucket sizes of a variable: powers of two from 8 up, and the maximum."""
    sizes, b = [], 8
    while b < hi:
        if b >= lo:
            sizes.append(b)
        b *= 2
    return sizes + [hi]


class Program:
    """A case traced once, rewritten and exported; `run` calls it at one bucket."""

    def __init__(self, case: Case):
        self.case = case
        constraints = [c for n, lo, hi in case.bounds for c in (f"{n} >= {lo}", f"{n} <= {hi}")]
        syms = export.symbolic_shape(", ".join(case.names), constraints=constraints)
        env = dict(zip(case.names, syms))
        avals = [jax.ShapeDtypeStruct(tuple(env.get(d, d) for d in dims),
                                      np.int32 if i in case.ints else np.float32)
                 for i, dims in enumerate(case.dims)]
        avals += [jax.ShapeDtypeStruct((), np.int32) for _ in case.names]
        k = len(case.dims)

        def flat(*args):        # the trailing real sizes are ignored by the user's function
            return tuple(jax.tree_util.tree_leaves(case.fn(*args[:k])))

        self.program = jax.jit(flat).trace(*avals).jaxpr
        self.logical: Logical = rewrite(self.program, {n: k + i for i, n in enumerate(case.names)})
        self.exported = export.export(jax.jit(self.logical.fn))(*avals)
        self.exact = jax.jit(case.fn)

    def inputs(self, sizes, bucket, fill, seed):
        rng = np.random.default_rng(seed)
        exact, padded = [], []
        for i, dims in enumerate(self.case.dims):
            real = tuple(sizes.get(d, d) for d in dims)
            phys = tuple(bucket.get(d, d) for d in dims)
            if i in self.case.ints:
                x = rng.integers(0, 10, real).astype(np.int32)
                p = np.full(phys, np.iinfo(np.int32).max, np.int32)
            else:
                x = rng.standard_normal(real).astype(np.float32)
                p = np.full(phys, fill, np.float32)
            p[tuple(slice(0, n) for n in real)] = x
            exact.append(x)
            padded.append(p)
        return exact, padded

    def run(self, sizes, bucket, fill=np.nan, seed=0, exported=None):
        """(got, want): the bucketed outputs cut to the exact outputs' shapes, and those."""
        exact, padded = self.inputs(sizes, bucket, fill, seed)
        want = [np.asarray(w) for w in jax.tree_util.tree_leaves(self.exact(*exact))]
        real = [np.int32(sizes[n]) for n in self.case.names]
        got = (exported or self.exported).call(*padded, *real)
        got = [np.asarray(g)[tuple(slice(0, n) for n in w.shape)] for g, w in zip(got, want)]
        return got, want


@functools.cache
def program(case: Case) -> Program:
    return Program(case)


def assert_exact(case: Case, sizes, bucket, fill=np.nan, seed=0):
    got, want = program(case).run(sizes, bucket, fill, seed)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(
            g, w, rtol=2e-4, atol=2e-4,
            err_msg=f"output {i} at sizes {sizes}, bucket {bucket}, padding {fill}")


@st.composite
def sizes_and_bucket(draw, case: Case):
    """Real sizes from 1, the minimum, bucket boundaries +-1 and the maximum; a bucket that
    holds them (not always the smallest); a padding value that must never leak."""
    sizes, bucket = {}, {}
    for name, lo, hi in case.bounds:
        edges = {1, lo, hi} | {b + e for b in _buckets(lo, hi) for e in (-1, 0, 1)}
        size = draw(st.sampled_from(sorted(s for s in edges if lo <= s <= hi)))
        sizes[name] = size
        bucket[name] = draw(st.sampled_from([b for b in _buckets(lo, hi) if b >= size]))
    fill = draw(st.sampled_from([np.nan, np.inf, -np.inf, 3e38]))
    return sizes, bucket, fill


def vg(f, argnums=0):
    """value_and_grad of a scalar loss of ``f``'s output, inside the traced function."""
    return lambda *a: jax.value_and_grad(lambda *b: jnp.sum(jnp.sin(f(*b))), argnums)(*a)


T4 = (("T", 4),)
T1 = (("T",),)
BT = (("B", 1, 8), ("T", 1, 16))


def _ramp(y):
    """A cheap position-sensitive reader: row i weighted by i + 1 (a misplaced row shows)."""
    return y * (1.0 + lax.broadcasted_iota(y.dtype, y.shape, 0))


def _w(*shape):
    return jnp.linspace(-1.0, 1.0, int(np.prod(shape)), dtype=jnp.float32).reshape(shape)


def _gru_loss(w, x):
    def step(h, xi):
        z = jax.nn.sigmoid(jnp.concatenate([h, xi]) @ w)
        return (1 - z) * h + z * jnp.tanh(xi + h), h
    h, hs = lax.scan(step, jnp.zeros(4), x)
    return jnp.mean(hs ** 2) + jnp.sum(h)


@jax.custom_vjp
def _sin_vjp(x):
    return jnp.sin(x)


_sin_vjp.defvjp(lambda x: (jnp.sin(x), x), lambda x, ct: (ct * jnp.cos(x),))


def _argmax_reduce(x):
    # A variadic lax.reduce (the generic `reduce` primitive): value and index of the maximum.
    idx = lax.broadcasted_iota(np.int32, x.shape, 0)

    def pick(a, b):
        take_b = b[0] > a[0]
        return lax.select(take_b, b[0], a[0]), lax.select(take_b, b[1], a[1])
    return lax.reduce((x, idx), (np.float32(-np.inf), np.int32(0)), pick, (0,))


# --------------------------------------------------------------------------------------------
# One hypothesis property per rule: values and, where differentiable, gradients.

RULES: dict[str, list[Case]] = {
    "elementwise, dim_as_value": [
        Case(lambda x: (jnp.tanh(x) * 2 + jnp.exp(-x ** 2), x * x.shape[0]), T4),
        Case(vg(lambda x: jnp.maximum(x, 0.5) / (1 + x ** 2) / (x.shape[0] + 1)), T4)],
    "reduce_*, argmax/argmin, reduce": [
        Case(lambda x: (x.sum(0), x.max(0), x.min(1), jnp.prod(x, 0), jnp.all(x > -1, 0),
                        jnp.any(x > 1, 0), jnp.argmax(-abs(x), 0), jnp.argmin(abs(x), 0),
                        _argmax_reduce(x)), T4),
        Case(vg(lambda x: x.max(0) + x.min(1).sum() + jnp.var(x, 0)), T4)],
    "cumulative": [
        Case(lambda x: (jnp.cumsum(x, 0), lax.cumsum(x, 0, reverse=True),
                        lax.cumprod(x, 0, reverse=True), lax.cummax(x, 0, reverse=True),
                        lax.cummin(x, 0, reverse=True), lax.cumlogsumexp(x, 0, reverse=True)), T4),
        Case(vg(lambda x: lax.cumsum(x, 0, reverse=True)), T4)],
    "rev": [Case(vg(lambda x: _ramp(jnp.flip(x))), T4)],
    "sort/argsort/top_k": [
        Case(lambda x: (jnp.sort(x, 0), jnp.argsort(x, 0), jnp.median(x, 0), lax.top_k(x.T, 3)),
             T4, (("T", 3, 16),)),
        Case(vg(lambda x: jnp.sort(x, 0)[:2] * lax.top_k(x.T, 2)[0].T), T4, (("T", 2, 16),))],
    "dot_general": [
        Case(vg(lambda x: jax.nn.softmax(x @ x.T, -1) @ x), T4),
        Case(vg(lambda x: jnp.einsum("btd,bsd->bts", x, x) @ x[0]), (("B", "T", 2),), BT),
        Case(lambda x: jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(_w(4, 3)),
             (("B", 4),), (("B", 1, 16),))],
    "conv_general_dilated": [
        Case(lambda x: tuple(lax.conv_general_dilated(x[None, None], _w(1, 1, 3), (s,), pad,
                                                      rhs_dilation=(d,))[0, 0]
                             for s, pad, d in [(1, "SAME", 1), (2, "SAME", 1), (2, "VALID", 1),
                                               (1, "VALID", 2), (3, "SAME", 2)]),
             T1, (("T", 5, 16),)),
        Case(lambda x: jax.value_and_grad(lambda x, w: jnp.sum(jnp.sin(lax.conv_general_dilated(
            x[None, None], w, (1,), "SAME"))), (0, 1))(x, _w(1, 1, 3)), T1)],
    "reduce_window, select_and_{scatter,gather}_add": [
        Case(lambda x: (lax.reduce_window(x, -jnp.inf, lax.max, (3,), (2,), "SAME"),
                        lax.reduce_window(x, jnp.inf, lax.min, (2,), (1,), "VALID"),
                        lax.reduce_window(x, 0.0, lax.add, (3,), (2,), "SAME"),
                        lax.reduce_window(x, 0.0, lax.add, (2,), (1,), "SAME", None, (2,)),
                        jax.jvp(lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (3,), (2,),
                                                            "SAME"), (x,), (jnp.cos(x),))),
             T1, (("T", 2, 16),)),
        Case(vg(lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (3,), (2,), "SAME")
                * lax.reduce_window(x, 0.0, lax.add, (3,), (2,), "SAME")), T1)],
    "slice, split, concatenate": [
        Case(lambda x: (x[-3:], x[1:], x[::2], x[-5::2], x[:-1], jnp.concatenate([x, 2 * x, x[:2]]),
                        jnp.split(x, [2, x.shape[0] - 1])), T4, (("T", 5, 16),)),
        Case(vg(lambda x: x[-3:] * x[:3] + _ramp(jnp.concatenate([x, x[::-1]]))[-3:]), T4,
             (("T", 3, 16),))],
    "dynamic_slice, dynamic_update_slice": [
        Case(lambda x: (x[-1], lax.dynamic_slice_in_dim(x, x.shape[0] - 2, 4),
                        x[jnp.argmax(x[:, 0])],
                        lax.dynamic_update_slice(jnp.concatenate([x, x]), -x[:1],
                                                 (x.shape[0] + 1, 0)),
                        lax.dynamic_update_slice(x, jnp.zeros((2, 4)), (x.shape[0] - 1, 0)),
                        lax.dynamic_update_slice(jnp.full((20, 4), 3.0), x, (0, 0)),
                        lax.dynamic_update_slice(jnp.full((20, 4), 3.0), x, (x.shape[0] // 3, 0))),
             T4, (("T", 4, 16),)),
        Case(vg(lambda x: x[-1] * lax.dynamic_index_in_dim(x, x.shape[0] // 2, 0, False)
                + lax.dynamic_update_slice(jnp.ones((2 * x.shape[0], 4)), x, (1, 0))[1:3]), T4,
             (("T", 2, 16),))],
    "gather, scatter": [
        Case(lambda x: (x.at[jnp.array([0, 3, 30, 70])].get(mode="fill", fill_value=-5.0),
                        x.at[jnp.array([0, 3, 30, 70])].get(mode="clip"), x[jnp.array([-1, 0])],
                        x.at[-1].set(0.0), x.at[jnp.array([1, 40, 2])].add(1.0, mode="drop"),
                        jnp.zeros((6, 4)).at[jnp.arange(x.shape[0]) % 6].add(x),
                        jnp.zeros((6, 4)).at[jnp.arange(x.shape[0]) % 6].max(x)),
             T4, (("T", 4, 16),)),
        Case(lambda tok: jax.value_and_grad(lambda tab: jnp.sum(jnp.sin(tab[tok])))(_w(10, 3)),
             (("B", "T"),), BT, ints=(0,)),
        Case(vg(lambda x: jnp.zeros((6, 4)).at[jnp.arange(x.shape[0]) % 6].set(x)
                + jnp.full((20, 4), 3.0).at[:x.shape[0]].set(x)[:6]), T4)],
    "pad": [Case(lambda x: (jnp.pad(x, ((0, 2), (0, 0)), constant_values=7),
                            lax.pad(x, 7.0, ((1, 2, 1), (0, 0, 0))),
                            lax.pad(x, 7.0, ((-1, 2, 0), (0, 0, 0))),
                            jnp.pad(x, ((0, 16 - x.shape[0]), (0, 0)))), T4, (("T", 2, 16),)),
            Case(vg(lambda x: _ramp(lax.pad(x, 7.0, ((1, 2, 1), (1, 0, 0))))), T4)],
    "reshape": [
        Case(lambda x: (x.reshape(-1), x.reshape(-1).reshape(-1, 2), x.reshape(1, -1, 2, 2)), T4),
        Case(vg(lambda x: x.reshape(-1, 3) * jnp.arange(x.shape[0] * x.shape[1])[:, None]),
             (("B", "T", 3),), BT)],
    "scan": [
        Case(lambda x: (lax.scan(lambda c, xi: (jnp.tanh(c + xi), c), jnp.zeros(4), x),
                        lax.scan(lambda c, xi: (jnp.tanh(c + xi), c), jnp.zeros(4), x,
                                 reverse=True),
                        lax.scan(lambda c, xi: (c + jnp.mean(xi), xi.max()), 0.0, x.T)), T4),
        Case(lambda x: jax.value_and_grad(_gru_loss, argnums=(0, 1))(_w(8, 4), x), T4)],
    "while, cond": [
        Case(lambda x: (lax.fori_loop(0, x.shape[0], lambda i, c: c + x[i], jnp.zeros(4)),
                        lax.while_loop(lambda c: c[0] < x.shape[0],
                                       lambda c: (c[0] + 1, c[1] * 0.5 + x[c[0]]),
                                       (0, jnp.zeros(4)))[1],
                        lax.cond(x.sum() > 0, lambda: jnp.mean(x, 0), lambda: x.max(0))), T4),
        Case(vg(lambda x: lax.switch(jnp.int32(x.shape[0] % 3),
                                     [lambda: x[-1], lambda: x.mean(0), lambda: x[0]])), T4)],
    "jit, custom_jvp/vjp, checkpoint": [
        Case(lambda x: (jax.jit(lambda y: jnp.mean(y, 0))(x),
                        jnp.sum(x[0]) * jax.jit(lambda y: jnp.float32(y.shape[0]))(x)), T4),
        Case(vg(lambda x: jax.nn.relu(x).max(0) + _sin_vjp(x).sum(0)
                + jax.checkpoint(lambda x: jax.nn.softmax(x, 0).mean(0))(x)), T4)],
}

RULE_CASES = [(rule, i) for rule, cases in RULES.items() for i in range(len(cases))]


@pytest.mark.parametrize("rule,i", RULE_CASES, ids=[f"{r}-{i}" for r, i in RULE_CASES])
@settings(max_examples=5)
@given(data=st.data())
def test_rule_is_transparent(rule, i, data):
    case = RULES[rule][i]
    assert not program(case).logical.unsupported
    sizes, bucket, fill = data.draw(sizes_and_bucket(case))
    assert_exact(case, sizes, bucket, fill, seed=data.draw(st.integers(0, 3)))


# --------------------------------------------------------------------------------------------
# The table: ordinary unmasked functions, each exact or flagged at the right line.

EXACT, FLAGGED = "exact", "flagged"

TABLE: dict[str, tuple[Case, str]] = {
    "mean": (Case(lambda x: jnp.mean(x, 0), T4), EXACT),
    "var": (Case(lambda x: jnp.var(x, 0), T4), EXACT),
    "std of all": (Case(lambda x: jnp.std(x), T4), EXACT),
    "softmax over T": (Case(lambda x: jax.nn.softmax(x, 0), T4), EXACT),
    "logsumexp": (Case(lambda x: jax.nn.logsumexp(x, 0), T4), EXACT),
    "max(-abs)": (Case(lambda x: jnp.max(-abs(x)), T4), EXACT),
    "argmax": (Case(lambda x: jnp.argmax(x, 0), T4), EXACT),
    "sort": (Case(lambda x: jnp.sort(x, 0), T4), EXACT),
    "sort descending": (Case(lambda x: -jnp.sort(-x, 0), T4), EXACT),
    "median": (Case(lambda x: jnp.median(x, 0), T4), EXACT),
    "prod": (Case(lambda x: jnp.prod(x, 0), T4), EXACT),
    "roll": (Case(lambda x: jnp.roll(x, 1, 0), T4), EXACT),
    "flip": (Case(lambda x: jnp.flip(x, 0), T4), EXACT),
    "x[-1]": (Case(lambda x: x[-1], T4), EXACT),
    "x * x.shape[0]": (Case(lambda x: x * x.shape[0], T4), EXACT),
    "rnn final carry": (Case(lambda x: lax.scan(lambda h, xi: (jnp.tanh(h @ _w(4, 4) + xi), None),
                                                jnp.zeros(4), x)[0], T4), EXACT),
    "self-attention": (Case(lambda x: jax.nn.softmax(x @ x.T) @ x, T4), EXACT),
    "pad with 7": (Case(lambda x: jnp.pad(x, ((0, 2), (0, 0)), constant_values=7), T4), EXACT),
    "concatenate": (Case(lambda x: jnp.concatenate([x, x]), T4), EXACT),
    "cumsum reverse": (Case(lambda x: jnp.flip(jnp.cumsum(jnp.flip(x, 0), 0), 0), T4), EXACT),
    "conv1d SAME": (Case(lambda x: lax.conv_general_dilated(
        x[None, None], _w(1, 1, 3), (1,), "SAME")[0, 0], T1), EXACT),
    "conv1d VALID stride 2": (Case(lambda x: lax.conv_general_dilated(
        x[None, None], _w(1, 1, 3), (2,), "VALID")[0, 0], T1, (("T", 3, 32),)), EXACT),
    "conv1d SAME stride 2 dilation 2": (Case(lambda x: lax.conv_general_dilated(
        x[None, None], _w(1, 1, 3), (2,), "SAME", rhs_dilation=(2,))[0, 0], T1), EXACT),
    "max pool": (Case(lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (2,), (2,), "SAME"), T1),
                 EXACT),
    "top_k": (Case(lambda x: lax.top_k(x, 2), T1, (("T", 2, 32),)), EXACT),
    "grad of mean": (Case(lambda x: jax.grad(lambda x: jnp.mean(x ** 2))(x), T4), EXACT),
    "GRU value_and_grad": (Case(lambda x: jax.value_and_grad(_gru_loss, argnums=(0, 1))(
        _w(8, 4), x), T4), EXACT),
    "batch loss mean over B": (Case(lambda x: jax.value_and_grad(
        lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(_w(4, 2)), (("B", 4),), (("B", 1, 32),)), EXACT),
    "last 3 rows": (Case(lambda x: x[-3:], T4, (("T", 3, 32),)), EXACT),
    "normalise by max": (Case(lambda x: x / jnp.max(jnp.abs(x)), T4), EXACT),
    "mean over B and T": (Case(lambda x: x.mean((0, 1)), (("B", "T", 3),), BT), EXACT),
    "token loss over B*T": (Case(lambda x: jax.nn.logsumexp(x.reshape(-1, 3), -1).mean(),
                                 (("B", "T", 3),), BT), EXACT),
    "first differences": (Case(lambda x: jnp.diff(x, axis=0), T4, (("T", 2, 32),)), EXACT),
    "linspace over T": (Case(lambda x: x * jnp.linspace(0, 1, x.shape[0])[:, None], T4,
                             (("T", 2, 32),)), EXACT),
    "argsort rank": (Case(lambda x: jnp.argsort(jnp.argsort(x, 0), 0), T4), EXACT),
    "gram inverse": (Case(lambda x: jnp.linalg.inv(x @ x.T + 4 * jnp.eye(x.shape[0])),  # flagged
                          T4), FLAGGED),
    "slice to 16 - T": (Case(lambda x: x[: 16 - x.shape[0]], T4, (("T", 1, 16),)),  # flagged
                        FLAGGED),
}


def _table_size(case: Case):
    """One size per entry, well inside a bucket (the rule properties cover the edges): about
    two thirds of the maximum, padded to the next bucket with NaN."""
    sizes, bucket = {}, {}
    for name, lo, hi in case.bounds:
        sizes[name] = max(lo, (hi * 2) // 3 - 1)
        bucket[name] = next(b for b in _buckets(lo, hi) if b >= sizes[name])
    return sizes, bucket


def test_table_of_unmasked_functions():
    tally = {EXACT: 0, FLAGGED: 0, "silent": 0}
    problems = []
    for name, (case, expected) in TABLE.items():
        prog = program(case)
        flagged = bool(prog.logical.unsupported)
        if flagged:
            for u in prog.logical.unsupported:
                # The verdict names the user's line: the table line marked "# flagged".
                assert u.where.startswith(os.path.abspath(__file__)) and "# flagged" in u.where, \
                    (name, u)
            tally[FLAGGED] += 1
        else:
            got, want = prog.run(*_table_size(case), fill=np.nan)
            exact = all(np.allclose(g, w, rtol=2e-4, atol=2e-4, equal_nan=True)
                        for g, w in zip(got, want))
            tally[EXACT if exact else "silent"] += 1
            if not exact:
                problems.append(name)
        if (FLAGGED if flagged else EXACT) != expected:
            problems.append(f"{name}: expected {expected}")
    assert len(TABLE) >= 30
    assert tally["silent"] == 0 and not problems, (tally, problems)
    assert tally[FLAGGED] == 2


# --------------------------------------------------------------------------------------------
# Verdicts and bookkeeping


def _flat_program(fn, shapes, names=("T",), constraints=("T <= 64",)):
    syms = export.symbolic_shape(", ".join(names), constraints=list(constraints))
    env = dict(zip(names, syms))
    avals = [jax.ShapeDtypeStruct(tuple(env.get(d, d) for d in s), np.float32) for s in shapes]
    avals += [jax.ShapeDtypeStruct((), np.int32) for _ in names]
    return jax.jit(lambda *a: fn(*a[:len(shapes)])).trace(*avals).jaxpr, avals


_mystery_p = jax.extend.core.Primitive("mystery_window")
_mystery_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
_mystery_p.def_impl(lambda x: jnp.cumsum(x[::-1], 0))
mlir.register_lowering(_mystery_p, mlir.lower_fun(lambda x: jnp.cumsum(x[::-1], 0),
                                                  multiple_results=False))


def test_unknown_primitive_on_a_length_axis_is_reported_with_its_line():
    def f(x):
        y = jnp.sin(x)
        return (_mystery_p.bind(y),)        # the mystery line
    jaxpr, avals = _flat_program(f, [("T", 4)])
    logical = rewrite(jaxpr, {"T": 1})
    assert [u.primitive for u in logical.unsupported] == ["mystery_window"]
    (u,) = logical.unsupported
    assert u.where.startswith(f"{os.path.abspath(__file__)}:") and "# the mystery line" in u.where
    assert "no rule" in u.detail
    # It still runs, unchanged.
    exported = export.export(jax.jit(logical.fn))(*avals)
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    np.testing.assert_allclose(exported.call(x, np.int32(8))[0], jnp.cumsum(jnp.sin(x)[::-1], 0),
                               rtol=1e-6)


def test_unknown_primitive_off_length_axes_passes_silently():
    def f(x):
        return (jnp.mean(x, 0), _mystery_p.bind(jnp.ones((3, 4))))
    jaxpr, _ = _flat_program(f, [("T", 4)])
    logical = rewrite(jaxpr, {"T": 1})
    assert logical.unsupported == ()
    assert logical.rewritten == 2       # dim_as_value and reduce_sum


def test_a_program_without_length_sensitive_operations_is_left_alone():
    jaxpr, _ = _flat_program(lambda x: (jnp.tanh(x) * 2 + x.sum(1)[:, None],), [("T", 4)])
    logical = rewrite(jaxpr, {"T": 1})
    assert (logical.rewritten, logical.unsupported) == (0, ())
    jaxpr, _ = _flat_program(lambda x: (x * 2,), [(3, 4)])
    logical = rewrite(jaxpr, {"T": 1})
    assert (logical.rewritten, logical.unsupported) == (0, ())


def test_a_zeroed_tail_is_masked_once_through_a_transpose():
    """``x`` is summed over T, so its tail is zeroed where it is made; ``-x.T @ y`` (what a
    backward pass writes) contracts the transposed, negated ``x`` over T and reads that same
    zeroed tail: one select for ``x``, one for ``y``, none again, and still exact."""
    case = Case(lambda x, y: (jnp.sum(x, axis=0), -x.T @ y), (("T", 4), ("T", 3)))
    replayed = jax.make_jaxpr(program(case).logical.fn)(*program(case).exported.in_avals)
    assert [e.primitive.name for e in replayed.jaxpr.eqns].count("select_n") == 2
    assert_exact(case, {"T": 5}, {"T": 8})


def test_non_monotone_length_is_reported():
    case, _ = TABLE["slice to 16 - T"]
    (u,) = program(case).logical.unsupported
    assert "16" in u.detail and "exceed its bucket size" in u.detail


def test_the_harness_catches_padding_leaks():
    """Without the rewrite the same harness sees the padding: these tests can fail."""
    case = Case(lambda x: (jnp.mean(x, 0), x[-1], jnp.flip(x, 0)), T4)
    prog = program(case)
    unrewritten = jax.extend.core.jaxpr_as_fun(prog.program)
    plain = export.export(jax.jit(lambda *a: tuple(unrewritten(*a))))(*prog.exported.in_avals)
    got, want = prog.run({"T": 9}, {"T": 16}, fill=1.0, exported=plain)
    assert not any(np.allclose(g, w) for g, w in zip(got, want))
    got, want = prog.run({"T": 9}, {"T": 16}, fill=1.0)
    assert all(np.allclose(g, w) for g, w in zip(got, want))


def test_unsupported_is_a_value():
    u = Unsupported("fft", "f.py:3: `jnp.fft.rfft(x)`", "no rule for fft on a length axis")
    with pytest.raises(dataclasses.FrozenInstanceError):
        u.primitive = "x"


def test_sizes_are_read_from_the_inputs_named_by_position():
    """The real sizes need not be the last inputs: ``sizes_at`` names each one's position."""
    (T, B) = export.symbolic_shape("T, B", constraints=["T <= 16", "B <= 8"])
    avals = [jax.ShapeDtypeStruct((), np.int32), jax.ShapeDtypeStruct((B, T), np.float32),
             jax.ShapeDtypeStruct((), np.int32), jax.ShapeDtypeStruct((3,), np.float32)]

    def f(b, x, t, w):              # the sizes of B and T at inputs 0 and 2
        return (jnp.sum(x, 1), jnp.mean(x, 0), w * 2)

    jaxpr = jax.jit(f).trace(*avals).jaxpr
    logical = rewrite(jaxpr, {"B": 0, "T": 2})
    exported = export.export(jax.jit(logical.fn))(*avals)
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    padded = np.full((8, 16), np.nan, np.float32)
    padded[:3, :5] = x
    w = np.arange(3, dtype=np.float32)
    sums, means, doubled = exported.call(np.int32(3), padded, np.int32(5), w)
    np.testing.assert_allclose(np.asarray(sums)[:3], x.sum(1), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(means)[:5], x.mean(0), rtol=1e-5)
    np.testing.assert_array_equal(doubled, w * 2)
    # Swapped positions read T's size as B's: the same call is then wrong.
    swapped = export.export(jax.jit(rewrite(jaxpr, {"B": 2, "T": 0}).fn))(*avals)
    _, means, _ = swapped.call(np.int32(3), padded, np.int32(5), w)
    assert not np.allclose(np.asarray(means)[:5], x.mean(0), equal_nan=True)


@pytest.mark.parametrize("sizes_at, received", [({"T": 0}, "input 0: float32[T]"), ({"T": 5}, "5"),
                                                ({"T": "1"}, "'1'")])
def test_sizes_at_must_name_int32_scalar_inputs(sizes_at, received):
    jaxpr, _ = _flat_program(lambda x: (jnp.mean(x),), [("T",)])
    with pytest.raises(OptionError, match=r"rewrite: sizes_at\['T'\]: expected the position of "
                                          r"an int32 scalar input \(0\.\.1\), received "
                                          + re.escape(received)):
        rewrite(jaxpr, sizes_at)


# --------------------------------------------------------------------------------------------
# Verdicts name the user's line


def _line_of(fn, marker: str) -> str:
    """``file:line`` of the line of ``fn``'s source that carries ``marker``."""
    lines, first = inspect.getsourcelines(fn)
    return f"{os.path.abspath(__file__)}:{first + next(i for i, t in enumerate(lines) if marker in t)}"


def _cholesky(m):
    return jnp.linalg.cholesky(m @ m.T + m.shape[0] * jnp.eye(m.shape[0]))


def test_a_scan_unrolled_over_a_length_names_the_users_line():
    # JAX cannot unroll a scan over a symbolic length: it fails while lowering, after the
    # trace, where the error's own traceback holds only JAX's frames. As written (no rewrite)
    # the plan says so; the logical rewrite's scan lowers, so the rewritten plan runs, exactly.
    T = px.LengthVar("T", max=32)                   # noqa: F841 - the Spec's T

    def f(x):                                       # x: (T, 3, 3)
        return lax.scan(lambda c, m: (c + _cholesky(m), None), jnp.zeros((3, 3)), x,
                        unroll=3)[0]                # the unrolled scan

    plan = px.trace(f, px.Spec("T 3 3", jnp.float32), masking=False)
    assert plan.reshaping_is_impossible
    assert _line_of(f, "lambda c, m") in plan.reason, plan.reason
    assert not px.trace(f, px.Spec("T 3 3", jnp.float32)).reshaping_is_impossible
    g = px.bucketed(f, in_specs=(px.Spec("T 3 3", jnp.float32),), buckets={"T": [8, 32]})
    for n in (1, 7, 13):
        x = np.random.default_rng(n).normal(size=(n, 3, 3)).astype(np.float32)
        np.testing.assert_allclose(g(x), jax.jit(f)(x), rtol=1e-5, atol=1e-5)
    assert g.stats.compiles == 2


def test_a_batched_map_over_a_length_names_the_users_line():
    T = px.LengthVar("T", max=32)                   # noqa: F841 - the Spec's T

    def f(x):                                       # x: (T, 4, 4)
        return lax.map(_cholesky, x, batch_size=4)  # the batched map

    plan = px.trace(f, px.Spec("T 4 4", jnp.float32))
    # JAX's own `floordiv(T, 4) >= 1` raises T's min to 4 (one trace for T >= 4); the batches'
    # remainder `T - 4*floordiv(T, 4)` has no rule, flagged at the user's line.
    assert plan.raised_mins["T"].min == 4 and not plan.padding_safe
    assert _line_of(f, "# the batched map") in plan.padding_reason, plan.padding_reason


def test_an_op_without_a_rule_inside_an_unrolled_scan_names_the_users_line():
    # A scan over a fixed axis, unrolled, reading a length axis with no rule inside.
    T = px.LengthVar("T", max=32)                   # noqa: F841 - the Spec's T

    def f(x):                                       # x: (5, T, T)
        return lax.scan(lambda c, m: (c, _cholesky(m)), 0.0, x, unroll=3)[1]

    plan = px.trace(f, px.Spec("5 T T", jnp.float32))
    assert plan.reason is None and not plan.padding_safe
    assert _line_of(_cholesky, "jnp.linalg.cholesky") in plan.padding_reason, \
        plan.padding_reason
    assert "cholesky" in plan.padding_reason


_SCRIPT = """
import jax.numpy as jnp
import polyexec as px
import equinox as eqx                  # after polyexec: still a library, not the user's code
from polyexec import _context

assert _context.is_library(eqx.__file__) and _context.is_library(eqx.nn.__file__)
T = px.LengthVar("T", min=2, max=32)
rope = eqx.nn.RotaryPositionalEmbedding(8)
pool = eqx.nn.MaxPool1d(2, 2, use_ceil=True)


def rotated(x):
    return rope(x)                     # the rope line


def pooled(x):
    return pool(x)                     # the pool line


# S has too few sizes for concrete traces to recover the layer (polyexec._recover): its
# failure names the line.
print(px.trace(rotated, px.Spec("S 8", jnp.float32),
               variables=[px.LengthVar("S", min=2, max=3)]).reason)
print(px.trace(pooled, px.Spec("3 T", jnp.float32)).reason)
"""


def test_equinox_imported_after_polyexec_is_a_library(tmp_path):
    script = tmp_path / "model.py"
    script.write_text(_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": root}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rope_reason, pool_reason = done.stdout.strip().splitlines()[-2:]
    lines = _SCRIPT.splitlines()
    for reason, marker in ((rope_reason, "# the rope line"), (pool_reason, "# the pool line")):
        lineno = next(i for i, t in enumerate(lines) if marker in t) + 1
        assert f"{script}:{lineno}" in reason and f"{os.sep}equinox{os.sep}" not in reason, reason


# An installed library polyexec knows nothing of (as Flax is): each function does something a
# verdict names -- random bits shaped by a length, an FFT over one, a branch on a size.
_INSTALLED_LIBRARY = """
import jax, jax.numpy as jnp

def noisy(key, x):
    # (a draw shaped by x is layout-invariant, not flagged: a triangular solve along T is)
    solved = jax.scipy.linalg.solve_triangular(2 * jnp.eye(x.shape[0]), x, lower=True)
    return solved * jax.random.uniform(key, ())

def spectrum(x):
    return jnp.abs(jnp.fft.fft(x))

def halved(x):
    return x[::2] if x.shape[0] == 8 else x
"""


def test_verdicts_name_the_users_line_not_an_installed_librarys(tmp_path, monkeypatch):
    # Installed where pip installs: a site-packages folder on sys.path, found by its name.
    installed = tmp_path / "site-packages"
    installed.mkdir()
    (installed / "fakelib.py").write_text(_INSTALLED_LIBRARY)
    monkeypatch.syspath_prepend(str(installed))
    spec = importlib.util.spec_from_file_location("fakelib", installed / "fakelib.py")
    fakelib = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fakelib)
    T = px.LengthVar("T", max=16)

    def noisy(key, x):
        return fakelib.noisy(key, x)            # the noisy line

    def spectrum(x):
        return fakelib.spectrum(x)              # the spectrum line

    def halved(x):
        return fakelib.halved(x)                # the halved line

    plan = px.trace(noisy, jax.random.key(0), px.Spec((T,), jnp.float32), check_sizes=False)
    assert plan.padding_reason.startswith(_line_of(noisy, "# the noisy line") + ":"), \
        plan.padding_reason
    assert "triangular_solve" in plan.padding_reason and "fakelib.py" not in plan.padding_reason
    for fn, marker in ((spectrum, "# the spectrum line"), (halved, "# the halved line")):
        reason = px.trace(fn, px.Spec((T,), jnp.float32), check_sizes=False).reason
        assert reason.startswith(_line_of(fn, marker)), reason
        assert "fakelib.py" not in reason, reason


def test_a_vmapped_while_over_a_length_is_exact_not_flagged():
    # jax.vmap of a while whose condition reads the batched values gives a while whose
    # predicate is bool[T]. Padding lanes (NaN) would keep `~(c >= x)` true forever: their
    # predicate must be false (if it were not, this test would hang rather than fail).
    T = px.LengthVar("T", max=32)

    def steps_to_reach(x):                          # x: (T, 2)
        def per_row(row):
            def cond(state):
                i, c = state
                return ~(c >= row[0] * 4)
            return lax.while_loop(cond, lambda s: (s[0] + 1, s[1] + jnp.abs(row[1]) + 0.5),
                                  (0, 0.0))
        counts, reached = jax.vmap(per_row)(x)
        return counts, reached, jnp.sum(counts), jnp.max(reached)

    f = px.bucketed(steps_to_reach, in_specs=(px.Spec("T 2", jnp.float32, pad=np.nan),),
                    buckets={T: [8, 32]})
    assert f.plan.padding_safe, f.plan.padding_reason
    for t in (1, 5, 8, 13):
        x = np.random.default_rng(t).uniform(0, 3, (t, 2)).astype(np.float32)
        for got, want in zip(f(x), jax.jit(steps_to_reach)(x)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6,
                                       err_msg=f"at T={t}")
