"""Concrete traces with the length axes recovered (`polyexec._recover`, issue 51).

Idioms JAX cannot trace at a symbolic length although jax.jit runs them at any concrete one
(equinox's RoPE, a float arange from a length, jnp.convolve) are traced at a few concrete sizes
and rebuilt as one symbolic program: exact, values and gradients, in every layout, against
jax.jit on each example alone at its exact length, with NaN padding. What the traces cannot
explain (a structure that depends on the size, a constant that is not a prefix, a number no
affine form fits) stays reshaping-impossible, naming the user's line.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import polyexec as px
from polyexec._recover import CONCRETE_TRACES, LOWEST, Affine, fit, sample_sizes

F = 4
ROPE = eqx.nn.RotaryPositionalEmbedding(F)
KERNEL = jnp.array([1.0, -2.0, 0.5])

# Each idiom: (T, F) -> array, T's declared min, and the least T it is recovered from: below
# 3 samples jnp.convolve swaps its operands (the shorter one is the kernel), another program.
# The sizes below LOWEST are traced down to the declared min, each kept while its program is
# the one recovered.
IDIOMS = {
    "rope": (lambda x: ROPE(x), 1, 1),
    "arange(1, T+1.0)": (lambda x: x / jnp.arange(1, x.shape[0] + 1.0)[:, None], 1, 1),
    "convolve": (lambda x: jnp.convolve(x[:, 0], KERNEL), 3, 3),
    # A next-token loss after RoPE: take_along_axis (a gather filling NaN) over T - 1, whose
    # gradient is a scatter-add with its combiner. From T = 2: JAX's take_along_axis needs
    # T - 1 >= 1 over symbolic sizes, and the rebuild does not raise a min as the planner does;
    # at T = 2 JAX writes the unit axis T - 1 differently, so it is recovered from 3.
    "rope, next token": (lambda x: optax.softmax_cross_entropy_with_integer_labels(
        ROPE(x)[:-1], jnp.argmax(x[1:], 1)), 2, 3),
}
LAYOUTS = ["pad", "ragged", "pack"]


def loss_of(g):
    return lambda x: jnp.sum(jnp.sin(g(x)))


def lengths_from(least):
    """Rows from the least size recovered up: shorter ones are refused (tested below)."""
    return [least + 2, least, 9, 16]


def concrete_traces(declared, least):
    """The concrete traces of an idiom: `CONCRETE_TRACES` from `LOWEST` up, one a size below
    it down to ``least``, and the one below that which ended the descent (if declared)."""
    return CONCRETE_TRACES + max(LOWEST - least, 0) + (least > declared)


def assert_recovered(plan, layout):
    assert not plan.reshaping_is_impossible, plan.reason
    assert plan.padding_safe, plan.padding_reason
    if layout == "pack":
        assert plan.can_pack, plan.packing_reason


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(IDIOMS))
def test_recovered_idiom_is_exact_values_and_gradients(name, layout):
    g, declared, least = IDIOMS[name]
    T = px.LengthVar("T", min=declared, max=16)
    B = px.LengthVar("B", max=8)
    rng = np.random.default_rng(0)
    lengths = lengths_from(least)
    rows = [rng.normal(size=(n, F)).astype(np.float32) for n in lengths]
    exact = jax.jit(jax.value_and_grad(loss_of(g)))
    want = [exact(jnp.asarray(r)) for r in rows]
    if layout == "pad":
        f = px.bucketed(jax.value_and_grad(loss_of(g)),
                        in_specs=(px.Spec("T 4", jnp.float32, pad=np.nan),),
                        out_specs=(px.Spec(""), px.Spec("T 4")), buckets={T: [8, 16]},
                        strict=True)
        for r, (v, gr) in zip(rows, want):
            got_v, got_g = f(r)
            np.testing.assert_allclose(got_v, v, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(got_g, gr, rtol=1e-5, atol=1e-5)
    else:
        def batch_loss(x, n):
            return jnp.sum(jax.vmap(loss_of(g))(x))

        f = px.bucketed(jax.value_and_grad(batch_loss),
                        in_specs=(px.Spec("B T 4", jnp.float32, pad=np.nan),
                                  px.Spec("B", jnp.int32, lengths_of="T")),
                        buckets={T: [8, 16]}, layout="pack" if layout == "pack" else "pad",
                        strict=True)
        x = np.full((len(rows), max(lengths), F), np.nan, np.float32)
        for b, r in enumerate(rows):
            x[b, :len(r)] = r
        got_v, got_g = f(x, np.asarray(lengths, np.int32))
        np.testing.assert_allclose(got_v, sum(float(v) for v, _ in want), rtol=1e-5, atol=1e-5)
        for b, (r, (_, gr)) in enumerate(zip(rows, want)):
            np.testing.assert_allclose(np.asarray(got_g)[b, :len(r)], gr, rtol=1e-5, atol=1e-5)
    assert_recovered(f.plan, layout)
    # One symbolic trace that failed, then the concrete ones; none per bucket.
    assert f.traces == 1 + concrete_traces(declared, least)


def test_a_recovered_program_is_symbolic_and_slices_the_max_size_table():
    T = px.LengthVar("T", min=1, max=64)
    plan = px.trace(lambda x: ROPE(x), px.Spec("T 4", jnp.float32))
    assert not plan.reshaping_is_impossible
    assert [str(d) for d in plan.jaxpr.out_avals[0].shape] == ["T", "4"]
    # equinox's cos/sin table, at the max, sliced to T: no constant of another length.
    assert {tuple(c.shape) for c in plan.jaxpr.consts} == {(64, 2)}


def test_a_branch_of_the_users_code_on_a_length_is_never_recovered():
    T = px.LengthVar("T", min=1, max=32)

    def branchy(x):
        if x.shape[0] > 8:                     # the branch line
            return jnp.sum(x, 0)
        return jnp.max(x, 0)

    f = px.bucketed(branchy, in_specs=(px.Spec("T 4", jnp.float32),), buckets={T: [16, 32]})
    with pytest.warns(UserWarning):
        f(np.ones((3, 4), np.float32))
    assert f.plan.reshaping_is_impossible
    assert "test_recovered.py" in f.plan.reason and "if x.shape[0] > 8:" in f.plan.reason
    assert "not recovered" not in f.plan.reason
    assert f.traces == 1 + 1        # the symbolic trace, then the bucket's own: no concrete ones


def test_a_structure_that_depends_on_the_size_stays_reshaping_impossible():
    """A loop of log2(T) steps after a line that needs concrete traces: each trace has
    another number of equations, which no affine form of T explains."""
    T = px.LengthVar("T", min=1, max=32)

    def halvings(x):
        scale = float(x.shape[0])              # here
        for _ in range(int(math.log2(x.shape[0]))):
            x = x + 1.0
        return jnp.sum(x, 0) / scale

    plan = px.trace(halvings, px.Spec("T 4", jnp.float32), variables=[T])
    assert plan.reshaping_is_impossible
    assert "test_recovered.py" in plan.reason and "scale = float(x.shape[0])" in plan.reason
    assert "not recovered" in plan.reason and "structure depends on the size" in plan.reason


def test_searchsorted_along_a_length_counts_instead_of_bisecting_in_one_trace():
    """jnp.searchsorted's default bisection takes ceil(log2(T + 1)) steps, an int JAX needs;
    over a symbolic length it runs as JAX's own compare_all (the same integers), so it and
    jnp.digitize, which calls it, trace once: exact in ragged padded rows."""
    T, B = px.LengthVar("T", min=1, max=32), px.LengthVar("B", max=4)

    def find(x):
        c = jnp.cumsum(jnp.abs(x[:, 0]))
        return jnp.searchsorted(c, jnp.array([0.5, 2.0])), jnp.digitize(c[-1] / 2, c)

    f = px.bucketed(lambda x, n: jax.vmap(find)(x), (px.Spec("B T 4", jnp.float32, pad=np.nan),
                    px.Spec("B", jnp.int32, lengths_of="T")), buckets={T: [8, 32], B: [4]},
                    strict=True)
    lengths = [5, 1, 13, 8]
    x = np.full((4, 13, F), np.nan, np.float32)
    rng = np.random.default_rng(3)
    for b, n in enumerate(lengths):
        x[b, :n] = rng.normal(size=(n, F))
    got = f(x, np.asarray(lengths, np.int32))
    assert f.traces == 1 and f.plan.padding_safe
    for b, n in enumerate(lengths):
        for have, want in zip(got, jax.jit(find)(jnp.asarray(x[b, :n]))):
            np.testing.assert_array_equal(np.asarray(have)[b], want)


@pytest.mark.parametrize("period", [2, 3, 5, 4])
def test_a_branch_on_a_lengths_divisibility_after_a_recovered_line_is_refused(period):
    """Code after the line the symbolic trace stops at runs only at the concrete sizes, so a
    branch there that no threshold decides is seen only where a traced size takes the other
    side: the size between the min and the max is chosen divisible by small numbers (60 from
    3 to 64), and the programs then differ."""
    T = px.LengthVar("T", min=1, max=64)

    def periodic(x):
        scale = float(x.shape[0])              # needs concrete traces
        if x.shape[0] % period == 0:
            return jnp.sum(x, 0) / scale * 2.0
        return jnp.sum(x, 0) / scale

    plan = px.trace(periodic, px.Spec("T 4", jnp.float32), variables=[T])
    assert plan.reshaping_is_impossible
    assert "not recovered from the traces at T=64; T=60; T=3" in plan.reason
    assert "structure depends on the size" in plan.reason


def test_a_constant_that_is_not_a_prefix_is_refused():
    T = px.LengthVar("T", min=1, max=32)

    def weighted(x):
        with jax.ensure_compile_time_eval():
            w = jnp.linspace(0.0, 1.0, x.shape[0])
        return x * w[:, None]                  # the linspace line

    plan = px.trace(weighted, px.Spec("T 4", jnp.float32))
    assert plan.reshaping_is_impossible
    assert "not recovered" in plan.reason and "not prefixes" in plan.reason


def test_a_literal_no_affine_form_explains_is_refused():
    T = px.LengthVar("T", min=1, max=32)

    def scaled(x):
        return x * (1.0 / float(x.shape[0]))   # 1/T: no a*T + b

    plan = px.trace(scaled, px.Spec("T 4", jnp.float32))
    assert plan.reshaping_is_impossible
    assert "test_recovered.py" in plan.reason
    assert "not recovered" in plan.reason and "no a * length + b explains" in plan.reason


def test_a_float_of_the_length_becomes_a_value_computed_from_it():
    T = px.LengthVar("T", min=1, max=32)

    def mean(x):
        return jnp.sum(x, 0) / float(x.shape[0])

    f = px.bucketed(mean, in_specs=(px.Spec("T 4", jnp.float32, pad=np.nan),),
                    buckets={T: [16, 32]}, strict=True)
    x = np.arange(20, dtype=np.float32).reshape(5, 4)
    np.testing.assert_allclose(f(x), x.mean(0), rtol=1e-6)
    assert not f.plan.reshaping_is_impossible and f.traces == 1 + concrete_traces(1, 1)


def test_code_jax_traces_symbolically_pays_no_concrete_trace():
    T = px.LengthVar("T", min=1, max=32)
    f = px.bucketed(lambda x: jnp.cumsum(x, 0), in_specs=(px.Spec("T 4", jnp.float32),),
                    buckets={T: [16, 32]})
    f(np.ones((3, 4), np.float32))
    assert f.traces == 1 and "recover" not in f.plan.seconds


# -- the fits ------------------------------------------------------------------------------------


class _Var:
    def __init__(self, name, lo, hi):
        self.name, self.min, self.max = name, lo, hi


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 20), st.integers(60, 4096), st.integers(1, 8), st.integers(1, 512),
       st.integers(-5, 5).filter(bool), st.integers(-100, 100), st.sampled_from(
           [("T",), ("B",), ("B", "T")]))
def test_a_fit_is_verified_and_unique(lo_t, hi_t, lo_b, hi_b, a, b, term):
    samples = sample_sizes([_Var("B", lo_b, lo_b + hi_b + 2), _Var("T", lo_t, hi_t)])
    if samples is None:
        return
    values = [a * math.prod(s[n] for n in term) + b for s in samples]
    assert fit(values, samples) == Affine(a, tuple(sorted(term)), b)
    # Not affine: refused, never guessed.
    for wrong in (lambda s: math.ceil(math.log2(s["T"] + 1)), lambda s: s["T"] // 2,
                  lambda s: s["T"] // 3 + s["B"], lambda s: s["B"] // 2, lambda s: s["T"] ** 2,
                  lambda s: (s["B"] * s["T"]) // 4):
        assert fit([wrong(s) for s in samples], samples) is None


@pytest.mark.parametrize("ragged", [False, True])
def test_a_length_below_the_least_size_traced_is_refused_by_name(ragged):
    """A recovered program is traced below its least size (3) only to verify it: where a
    library branches there (jnp.convolve swaps its operands below the kernel's size), such a
    length is refused at the call, naming the line and the sizes traced, before anything
    runs."""
    T = px.LengthVar("T", min=1, max=16)
    B = px.LengthVar("B", max=8)
    g = lambda x: jnp.convolve(x[:, 0], KERNEL)     # noqa: E731
    if ragged:
        f = px.bucketed(lambda x, n: jnp.sum(jax.vmap(g)(x)),
                        in_specs=(px.Spec("B T 4", jnp.float32),
                                  px.Spec("B", jnp.int32, lengths_of="T")))
        call = lambda: f(np.ones((2, 5, F), np.float32), np.array([5, 2], np.int32))  # noqa
    else:
        f = px.bucketed(g, in_specs=(px.Spec("T 4", jnp.float32),))
        call = lambda: f(np.ones((2, F), np.float32))                          # noqa: E731
    with pytest.raises(px.SpecError, match=r"T = 16, (3, 12|12, 3), and below 3 its program differs"):
        call()
    assert not f.plan.reshaping_is_impossible and f.stats.compiles == 0
