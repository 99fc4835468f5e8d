"""JAX functions that refuse a symbolic length run in equal forms while polyexec traces
(`polyexec._forms`): ``lax.associative_scan`` (and so the gradients of ``cumprod`` and
``cumlogsumexp``), ``fori_loop`` over a length, differentiated, and
``jnp.prod``'s gradient. Exact, values and gradients, in every layout, against each example
alone under ``jax.jit``; and nothing changes for code that is not polyexec's."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import export, lax

import polyexec as px
from polyexec._recover import CONCRETE_TRACES

T = px.LengthVar("T", min=1, max=16)
B = px.LengthVar("B", max=8)
F = 3
W = np.random.default_rng(1).normal(size=(F, F)).astype(np.float32) * 0.5


def linear_recurrence(a, b):           # h_t = a_t * h_{t-1} + b_t, as S5/LRU/Mamba-style SSMs
    return a[0] * b[0], b[0] * a[1] + b[1]


IDIOMS = {  # each maps one example (T, F) to an array
    "associative_scan add": lambda x: lax.associative_scan(jnp.add, x),
    "ssm": lambda x: lax.associative_scan(linear_recurrence, (jax.nn.sigmoid(x), x))[1],
    "ssm reversed": lambda x: lax.associative_scan(linear_recurrence, (jax.nn.sigmoid(x), x),
                                                   reverse=True)[1],
    "matrix products": lambda x: lax.associative_scan(
        jnp.matmul, jnp.tanh(x)[:, :, None] * jnp.eye(F) + 0.1)[:, 0],
    "cumprod": lambda x: jnp.cumprod(1 + 0.1 * x, 0),
    "cumlogsumexp": lambda x: lax.cumlogsumexp(x, 0),
    "prod": lambda x: jnp.prod(1 + 0.1 * x, 0),
    "prod over both axes": lambda x: jnp.prod(1 + 0.1 * x),
}
# Packed rows hold sequences of different trip counts: a loop over the length runs padded.
LOOPS = {"fori_loop": lambda x: lax.fori_loop(0, x.shape[0], lambda t, h: jnp.tanh(h @ W + x[t]),
                                              jnp.zeros(F))}


def losses(idioms):
    def per_idiom(x):
        """Each idiom's loss and its gradient, for one example."""
        return {name: jax.value_and_grad(lambda x: jnp.sum(jnp.sin(idiom(x))))(x)
                for name, idiom in idioms.items()}
    return per_idiom


per_idiom = losses({**IDIOMS, **LOOPS})
reference = jax.jit(per_idiom)   # compiled once per exact length


def batch_of(lengths, seed):
    rng = np.random.default_rng(seed)
    rows = [rng.normal(size=(n, F)).astype(np.float32) for n in lengths]
    x = np.full((len(rows), max(max(lengths), 1), F), np.nan, np.float32)
    for b, r in enumerate(rows):
        x[b, :len(r)] = r
    return x, rows


RAGGED = (px.Spec("B T 3", jnp.float32), px.Spec("B", jnp.int32, lengths_of="T"))
def ragged_rows(idioms, layout):
    return px.bucketed(lambda x, lengths: jax.vmap(losses(idioms))(x), in_specs=RAGGED,
                       buckets={T: [16]}, layout=layout, strict=True)


ragged = {"pad": ragged_rows({**IDIOMS, **LOOPS}, "pad"), "pack": ragged_rows(IDIOMS, "pack")}
unragged = px.bucketed(per_idiom, in_specs=(px.Spec("T 3", jnp.float32),), buckets={T: [16]},
                       strict=True)


def check(got, rows, where, names=(*IDIOMS, *LOOPS)):
    for b, r in enumerate(rows):
        want = reference(jnp.asarray(r))
        for name in names:
            value, grad = got(name, b)
            np.testing.assert_allclose(value, want[name][0], rtol=2e-5, atol=2e-5,
                                       err_msg=f"{where}: {name}, example {b}: value")
            np.testing.assert_allclose(grad[:len(r)], want[name][1], rtol=2e-5, atol=2e-5,
                                       err_msg=f"{where}: {name}, example {b}: gradient")


@settings(max_examples=4, deadline=None)
@given(lengths=st.lists(st.sampled_from([1, 2, 5, 16]), min_size=4, max_size=4),
       seed=st.integers(0, 2**16))
@pytest.mark.parametrize("layout", ["pad", "pack"])
def test_each_idiom_is_exact_in_ragged_rows_values_and_gradients(layout, lengths, seed):
    x, rows = batch_of(lengths, seed)
    out = ragged[layout](x, np.asarray(lengths, np.int32))
    check(lambda name, b: (out[name][0][b], out[name][1][b]), rows, layout,
          IDIOMS if layout == "pack" else (*IDIOMS, *LOOPS))


def test_each_idiom_is_exact_unragged_in_one_trace():
    for n in (1, 5, 16):
        (row,) = batch_of([n], n)[1]
        out = unragged(row)
        check(lambda name, b: out[name], [row], f"T={n}")
    assert not unragged.plan.reshaping_is_impossible and unragged.plan.padding_safe
    assert unragged.traces == 1 and unragged.stats.compiles == 1


def test_packed_rows_restart_the_scans_at_every_sequence():
    """The packed plan packs (no idiom runs padded) and each sequence's scans start afresh:
    several sequences share a row here."""
    f = ragged["pack"]
    x, rows = batch_of([5, 2, 1, 2], 7)
    out = f(x, np.asarray([5, 2, 1, 2], np.int32))
    assert f.plan.can_pack, f.plan.packing_reason
    check(lambda name, b: (out[name][0][b], out[name][1][b]), rows, "pack", IDIOMS)


def test_a_loop_over_the_length_runs_padded_when_asked_to_pack_naming_the_line():
    f = px.bucketed(lambda x, lengths: jax.vmap(losses(LOOPS))(x), in_specs=RAGGED,
                    buckets={T: [16]}, layout="pack")
    x, rows = batch_of([5, 2, 1, 2], 3)
    with pytest.warns(UserWarning, match="cannot run packed rows"):
        out = f(x, np.asarray([5, 2, 1, 2], np.int32))
    assert not f.plan.can_pack and "test_forms.py" in f.plan.packing_reason
    check(lambda name, b: (out[name][0][b], out[name][1][b]), rows, "pack", LOOPS)


def test_code_that_is_not_polyexecs_runs_jaxs_own_functions():
    """A concrete length, or a symbolic trace outside polyexec (here jax.export), gets JAX's
    own program and JAX's own refusal."""
    x = np.arange(5.0, dtype=np.float32)
    own = lax.associative_scan.__wrapped__
    assert str(jax.make_jaxpr(lambda x: lax.associative_scan(jnp.add, x))(x)) == \
        str(jax.make_jaxpr(lambda x: own(jnp.add, x))(x))
    (n,) = export.symbolic_shape("n", constraints=["n <= 64"])
    symbolic = jax.ShapeDtypeStruct((n,), np.float32)
    with pytest.raises(NotImplementedError, match="non-constant size"):
        export.export(jax.jit(lambda x: lax.associative_scan(jnp.add, x)))(symbolic)
    assert "while[" in str(jax.make_jaxpr(
        lambda x: lax.fori_loop(0, x.shape[0], lambda i, c: c + x[i], 0.0))(symbolic))


def test_another_thread_tracing_meanwhile_gets_jaxs_own_refusal():
    """The forms are per thread: while polyexec traces in one thread, JAX's function runs in
    the others."""
    inside, done = threading.Event(), threading.Event()

    def blocking_scan(x):
        inside.set()
        assert done.wait(60)
        return lax.associative_scan(jnp.add, x)

    (n,) = export.symbolic_shape("n", constraints=["n <= 64"])
    planner = threading.Thread(target=lambda: px.trace(blocking_scan, px.Spec("T", jnp.float32)))
    planner.start()
    try:
        assert inside.wait(60)
        with pytest.raises(NotImplementedError, match="non-constant size"):
            jax.jit(lambda x: lax.associative_scan(jnp.add, x)).trace(
                jax.ShapeDtypeStruct((n,), np.float32))
    finally:
        done.set()
        planner.join(60)


def test_a_prefix_scan_beside_a_table_only_concrete_traces_explain_is_recovered():
    """equinox's RoPE needs the concrete traces of `_recover`; the prefix scan beside it then
    runs its form at every traced size (levels from the longest max, not from each size), so
    the programs have one structure and are recovered: exact packed, values and gradients."""
    import equinox as eqx
    rope = eqx.nn.RotaryPositionalEmbedding(4)
    idioms = {"rope then ssm": lambda x: IDIOMS["ssm"](rope(jnp.concatenate([x, x[:, :1]], 1))),
              "rope then cumprod": lambda x: jnp.cumprod(
                  1 + 0.1 * rope(jnp.concatenate([x, x[:, :1]], 1)), 0)}
    f = ragged_rows(idioms, "pack")
    lengths = [5, 3, 16, 4]
    x, rows = batch_of(lengths, 11)
    out = f(x, np.asarray(lengths, np.int32))
    # The symbolic trace, three concrete ones, and one at each of 2 and 1 (`_verified_below`).
    assert f.plan.can_pack and f.traces == 6, (f.plan.reason, f.plan.packing_reason)
    for b, r in enumerate(rows):
        want = jax.jit(losses(idioms))(jnp.asarray(r))
        for name in idioms:
            np.testing.assert_allclose(out[name][0][b], want[name][0], rtol=2e-5, atol=2e-5)
            np.testing.assert_allclose(out[name][1][b, :len(r)], want[name][1], rtol=2e-5,
                                       atol=2e-5, err_msg=f"{name}, example {b}")


def test_a_jitted_helper_traced_for_recovery_keeps_jaxs_own_program_for_plain_calls():
    """The concrete traces of `_recover` run the forms at concrete sizes; a ``jax.jit`` helper
    traced there is cached apart (the forms are part of JAX's trace context), so the user's
    plain call of it afterwards, at a size just traced, runs JAX's own associative scan."""
    helper = jax.jit(lambda x: lax.associative_scan(jnp.add, x))
    T = px.LengthVar("T", min=1, max=16)
    f = px.bucketed(lambda x: helper(x) / jnp.arange(1, x.shape[0] + 1.0),   # needs recovery
                    in_specs=(px.Spec((T,), jnp.float32),), buckets={T: [16]})
    f(np.ones(5, np.float32))
    assert f.traces == 1 + CONCRETE_TRACES + 2 and not f.plan.reshaping_is_impossible  # T=2, 1
    x = np.arange(16.0, dtype=np.float32)        # the max: traced concretely above
    own = str(jax.make_jaxpr(lambda x: lax.associative_scan.__wrapped__(jnp.add, x))(x))
    assert str(helper.trace(x).jaxpr) == own


def test_a_combine_that_splits_ties_stays_jaxs_own_and_is_flagged():
    """cummax's gradient splits a tie between equal cells by the order of the combines, which
    only JAX's recursion at the exact length gives: refused over a symbolic length, named."""
    f = px.bucketed(jax.grad(lambda x: jnp.sum(jnp.arange(x.shape[0]) * lax.cummax(x))),
                    in_specs=(px.Spec("T", jnp.float32),))
    assert f.plan.reshaping_is_impossible and "test_forms.py" in f.plan.reason


def test_a_combine_with_an_infinite_derivative_where_a_cell_meets_itself_has_no_nan():
    """Cells with no partner at a level combine with themselves, thrown away: the running
    L2 norm's derivative is infinite at (0, 0), and must not reach the gradient."""
    norm = lambda a, b: jnp.sqrt(a * a + b * b)                          # noqa: E731
    loss = lambda x: jnp.sum(lax.associative_scan(norm, x))              # noqa: E731
    f = px.bucketed(jax.grad(loss), in_specs=(px.Spec("T", jnp.float32),), strict=True)
    x = np.arange(5.0, dtype=np.float32)
    np.testing.assert_allclose(f(x), jax.grad(loss)(x), rtol=1e-5)
