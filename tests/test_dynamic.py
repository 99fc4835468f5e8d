"""Bounded data-dependent ops (compact, nonzero, loop_until) and the shape helper ops.

Each op is checked against NumPy or a plain Python loop, eagerly under jit and as one symbolic
`jax.export` program run at several sizes.
"""

import doctest

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import export

import polyexec as px
from polyexec import _context, _dynamic, _ops, _planner

# -- compact ------------------------------------------------------------------------------------


@st.composite
def array_and_mask(draw, max_rank=3):
    """A small float array, an axis (or None) and a boolean mask for it; masks are drawn
    all-false, all-true or random so the edge cases are always in the mix."""
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=max_rank, min_side=0, max_side=6))
    x = draw(hnp.arrays(np.float32, shape, elements=st.floats(-100, 100, width=32)))
    axis = draw(st.sampled_from([None] + list(range(len(shape))) + [-1]))
    mask_shape = shape if axis is None else (shape[axis],)
    kind = draw(st.sampled_from(["random", "none", "all"]))
    if kind == "random":
        mask = draw(hnp.arrays(np.bool_, mask_shape))
    else:
        mask = np.full(mask_shape, kind == "all")
    return x, mask, axis


def numpy_compact(x, mask, axis, fill):
    if axis is None:
        kept, n, axis, x = x[mask], x.size, 0, x.reshape(-1)
    else:
        kept = np.compress(mask, x, axis=axis)
        n = x.shape[axis]
    pad = [(0, 0)] * x.ndim
    pad[axis % x.ndim] = (0, n - kept.shape[axis % x.ndim])
    return kept, np.pad(kept, pad, constant_values=fill)


@given(array_and_mask(), st.sampled_from([0.0, -1.5]))
def test_compact_agrees_with_numpy_boolean_indexing(case, fill):
    x, mask, axis = case
    values, count = jax.jit(px.compact, static_argnames=("axis", "fill"))(x, mask, axis=axis,
                                                                          fill=fill)
    kept, padded = numpy_compact(x, mask, axis, fill)
    assert values.shape == padded.shape
    assert count.dtype == jnp.int32 and int(count) == int(mask.sum())
    np.testing.assert_array_equal(np.asarray(values), padded)
    a = 0 if axis is None else axis % x.ndim
    np.testing.assert_array_equal(np.take(np.asarray(values), np.arange(int(count)), axis=a), kept)


def test_compact_under_symbolic_shapes_is_one_program_for_all_sizes():
    T, = export.symbolic_shape("T", constraints=["T <= 64"])
    program = export.export(jax.jit(lambda x, m: px.compact(x, m, axis=1)))(
        jax.ShapeDtypeStruct((3, T), jnp.float32), jax.ShapeDtypeStruct((T,), jnp.bool_))
    assert str(program.out_avals[0].shape) == "(3, T)"
    rng = np.random.default_rng(0)
    for n in (1, 5, 64):
        x = rng.normal(size=(3, n)).astype(np.float32)
        mask = rng.random(n) < 0.4
        values, count = program.call(x, mask)
        assert int(count) == mask.sum()
        np.testing.assert_array_equal(np.asarray(values), numpy_compact(x, mask, 1, 0)[1])


@settings(max_examples=10)
@given(array_and_mask(max_rank=2), st.integers(0, 2**31 - 1))
def test_compact_gradient_matches_numpy(case, seed):
    x, mask, axis = case
    weights = np.random.default_rng(seed).normal(size=x.shape).astype(np.float32)

    def loss(x):
        values, _ = px.compact(x, mask, axis=axis, fill=3.0)
        return jnp.sum(jnp.asarray(weights).reshape(values.shape) * values)

    grad = np.asarray(jax.jit(jax.grad(loss))(x))
    # d loss / d x[i] = the weight at the position x[i] was packed to; 0 for dropped entries
    # (the fill is a constant: no gradient flows anywhere from it).
    expected = np.zeros_like(x)
    if axis is None:
        expected.reshape(-1)[np.flatnonzero(mask)] = weights.reshape(-1)[:mask.sum()]
    else:
        a = axis % x.ndim
        kept = np.flatnonzero(mask)
        dst = [slice(None)] * x.ndim
        src = [slice(None)] * x.ndim
        dst[a], src[a] = kept, np.arange(len(kept))
        expected[tuple(dst)] = weights[tuple(src)]
    np.testing.assert_allclose(grad, expected, rtol=1e-6)


def test_compact_rejects_bad_input_with_a_clear_message():
    x = np.zeros((4, 3), np.float32)
    with pytest.raises(px.SpecError, match="boolean"):
        px.compact(x, np.ones(4, np.int32))
    with pytest.raises(px.SpecError, match=r"x.shape\[1\] = 3"):
        px.compact(x, np.ones(4, bool), axis=1)
    with pytest.raises(px.SpecError, match="out of range"):
        px.compact(x, np.ones(4, bool), axis=2)
    with pytest.raises(px.SpecError, match="x's shape"):
        px.compact(x, np.ones(4, bool), axis=None)


# -- nonzero ------------------------------------------------------------------------------------


@given(hnp.arrays(np.bool_, hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=6)),
       st.sampled_from(["random", "none", "all"]))
def test_nonzero_agrees_with_numpy(mask, kind):
    if kind != "random":
        mask = np.full(mask.shape, kind == "all")
    indices, count = jax.jit(px.nonzero)(mask)
    indices = np.asarray(indices)
    expected = np.flatnonzero(mask) if mask.ndim == 1 else np.argwhere(mask)
    assert int(count) == len(expected)
    np.testing.assert_array_equal(indices[:len(expected)], expected)
    assert (indices[len(expected):] == -1).all()
    assert indices.shape[0] == mask.size


def test_nonzero_under_symbolic_shapes():
    T, = export.symbolic_shape("T", constraints=["T <= 32"])
    program = export.export(jax.jit(px.nonzero))(jax.ShapeDtypeStruct((T, 2), jnp.bool_))
    assert str(program.out_avals[0].shape) == "(2*T, 2)"
    mask = np.array([[True, False], [False, False], [True, True]])
    indices, count = program.call(mask)
    np.testing.assert_array_equal(np.asarray(indices)[:int(count)], np.argwhere(mask))


# -- loop_until ---------------------------------------------------------------------------------


def python_greedy(table, start, end, max_steps):
    items, token = [], start
    while len(items) < max_steps:
        token = int(table[token])
        items.append(token)
        if token == end:
            break
    return items, token


def greedy_step(table, end):
    def step(i, token):
        new = table[token]
        return new, new, new == end
    return step


@given(st.integers(1, 8).flatmap(lambda v: st.tuples(
    st.lists(st.integers(0, v - 1), min_size=v, max_size=v), st.integers(0, v - 1),
    st.integers(0, v - 1), st.integers(0, 10))))
def test_loop_until_greedy_decoding_matches_a_python_loop(case):
    table, start, end, max_steps = case
    table = np.array(table, np.int32)

    @jax.jit
    def decode(table, start):
        return px.loop_until(greedy_step(table, end), start, max_steps=max_steps, fill=-7)

    items, count, last = decode(table, np.int32(start))
    expected, expected_last = python_greedy(table, start, end, max_steps)
    assert int(count) == len(expected)
    np.testing.assert_array_equal(np.asarray(items), expected + [-7] * (max_steps - len(expected)))
    assert int(last) == expected_last


def test_loop_until_solver_stops_at_convergence_like_python():
    """Newton's iteration for sqrt(a), until the residual is below tol: items are pytrees."""

    def step(i, x):
        new = 0.5 * (x + a / x)
        residual = jnp.abs(new * new - a)
        return new, {"x": new, "residual": residual}, residual < 1e-3

    a = jnp.float32(10.0)
    items, count, x = jax.jit(lambda: px.loop_until(step, jnp.float32(1.0), max_steps=50))()
    xs, r, x_ref = [], [], 1.0
    while len(xs) < 50:
        x_ref = 0.5 * (x_ref + 10.0 / x_ref)
        xs.append(x_ref)
        r.append(abs(x_ref * x_ref - 10.0))
        if r[-1] < 1e-3:
            break
    assert int(count) == len(xs) < 50
    np.testing.assert_allclose(np.asarray(items["x"])[:len(xs)], xs, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(items["residual"])[:len(xs)], r, rtol=1e-3, atol=1e-4)
    assert (np.asarray(items["x"])[len(xs):] == 0).all()
    np.testing.assert_allclose(float(x), xs[-1], rtol=1e-6)


def test_loop_until_with_a_symbolic_number_of_steps():
    """Running sums of x until one exceeds a limit, at most len(x) steps: one program."""
    T, = export.symbolic_shape("T", constraints=["T <= 64"])

    def prefix_until(x, limit):
        def step(i, total):
            total = total + x[i]
            return total, total, total > limit
        return px.loop_until(step, jnp.float32(0), max_steps=x.shape[0])

    program = export.export(jax.jit(prefix_until))(jax.ShapeDtypeStruct((T,), jnp.float32),
                                                   jax.ShapeDtypeStruct((), jnp.float32))
    rng = np.random.default_rng(3)
    for n in (1, 7, 64):
        x = rng.random(n).astype(np.float32)
        items, count, _ = program.call(x, np.float32(2.0))
        sums = np.cumsum(x)
        over = np.flatnonzero(sums > 2.0)
        stop = over[0] + 1 if len(over) else n
        assert int(count) == stop
        np.testing.assert_allclose(np.asarray(items)[:stop], sums[:stop], rtol=1e-5)


def test_loop_until_rejects_bad_steps():
    with pytest.raises(px.SpecError, match=r"must return \(carry, item, stop\)"):
        px.loop_until(lambda i, c: (c, c), jnp.int32(0), max_steps=3)
    with pytest.raises(px.SpecError, match="boolean scalar"):
        px.loop_until(lambda i, c: (c, c, c), jnp.int32(0), max_steps=3)
    with pytest.raises(px.SpecError, match="shape"):
        px.loop_until(lambda i, c: (jnp.zeros(2), c, True), jnp.zeros(3), max_steps=3)
    with pytest.raises(px.SpecError, match="max_steps"):
        px.loop_until(lambda i, c: (c, c, True), jnp.int32(0), max_steps=-1)


def test_length_outside_a_bucketed_function_changes_nothing():
    K = px.LengthVar("K_outside", max=8)
    x = np.arange(5.0, dtype=np.float32)
    a, n = px.compact(x, x > 1.5, length=K)
    b, m = px.compact(x, x > 1.5)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(n) == int(m) == 3
    with pytest.raises(px.SpecError, match="LengthVar"):
        px.compact(x, x > 1.5, length=3)


# -- shape helper ops ---------------------------------------------------------------------------


def test_shape_helpers_stay_symbolic():
    """Each helper inside one exported program with symbolic T, then run at several sizes."""
    T, = export.symbolic_shape("T", constraints=["T <= 64"])

    def helpers(x, lengths):                     # x: (2, T), lengths: (2,)
        flat = jnp.ravel(x)                      # (2*T,)
        return (px.arange_like(x, axis=1),
                px.sequence_mask(lengths, x, axis=1),
                px.reshape_like(flat * 2, x),
                px.broadcast_like(jnp.float32(7), x))

    program = export.export(jax.jit(helpers))(jax.ShapeDtypeStruct((2, T), jnp.float32),
                                              jax.ShapeDtypeStruct((2,), jnp.int32))
    assert [str(a.shape) for a in program.out_avals] == ["(T,)", "(2, T)", "(2, T)", "(2, T)"]
    for n in (1, 5, 64):
        x = np.arange(2 * n, dtype=np.float32).reshape(2, n)
        lengths = np.array([0, min(3, n)], np.int32)
        arange, mask, reshaped, broadcast = (np.asarray(o) for o in program.call(x, lengths))
        np.testing.assert_array_equal(arange, np.arange(n))
        np.testing.assert_array_equal(mask, np.arange(n)[None, :] < lengths[:, None])
        np.testing.assert_array_equal(reshaped, x * 2)
        np.testing.assert_array_equal(broadcast, np.full((2, n), 7.0))


def test_valid_length_is_the_real_size_in_a_bucketed_function():
    T = px.LengthVar("T", max=32)
    f = px.bucketed(lambda x: (px.valid_length(T), jnp.sum(x)), in_specs=(px.Spec("T"),),
                    buckets={T: [8, 32]})
    for n in (1, 5, 8, 9, 32):
        length, total = f(np.ones(n, np.float32))
        assert int(length) == n and float(total) == n
    assert f.traces == 1 and f.stats.compiles == 2


@pytest.mark.parametrize("module", [_dynamic, _planner, _ops, _context],
                         ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
