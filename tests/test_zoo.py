"""A zoo of polymorphic and non-polymorphic functions: `px.trace` must classify each one, and for
the non-polymorphic ones `plan.reason` must name this file and the offending line.

Each non-polymorphic function marks its offending line with ``# <- not polymorphic``; the
expected line number is computed from the source with `inspect`, so editing this file cannot
make the test pass by accident.
"""

import inspect
import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polyexec as px
from polyexec._recover import CONCRETE_TRACES
from examples.rnn.model import CharLM, loss_fn

MARK = "# <- not polymorphic"


def _vars():
    # Defined per test (see test_executor.py): Specs resolve names when traced.
    return px.LengthVar("T", min=2, max=1024), px.LengthVar("B", max=8)


def X():
    return px.Spec("B T", jnp.float32)


# -- polymorphic: traced once for every size ----------------------------------------------------

def masked_mean(x, lengths):
    mask = px.sequence_mask(lengths, x, axis=1)
    return jnp.sum(jnp.where(mask, x, 0.0), axis=1) / jnp.maximum(lengths, 1)


def masked_softmax(x):
    mask = px.arange_like(x, axis=1) < px.valid_length("T")
    return jax.nn.softmax(jnp.where(mask, x, -jnp.inf), axis=1)


def running_sum(x):
    return jnp.cumsum(x, axis=1)


def differences(x):
    return x[:, 1:] - x[:, :-1]            # needs T >= 2: the LengthVar's min says so


def project(w, x):
    return jnp.einsum("btd,de->bte", x, w)


def gru_loss(model, tokens, lengths):
    return loss_fn(model, tokens, lengths)


def fori_total(x):
    return jax.lax.fori_loop(0, x.shape[1], lambda i, acc: acc + x[:, i], jnp.zeros(x.shape[0]))


def position_weighted(x):
    return x * jnp.arange(x.shape[1]) / jnp.sqrt(x.shape[1])


def causal_mix(x):
    t = x.shape[1]
    return x @ jnp.tril(jnp.ones((t, t))) / t


def doubled_then_halves(x):
    both = jnp.concatenate([x, x[:, ::-1]], axis=1)              # (B, 2T)
    return both.reshape(x.shape[0], 2, x.shape[1]).sum(axis=1)   # symbolic reshape: (B, 2, T)


def padded_edges(x):
    return jnp.pad(x, ((0, 0), (1, 1)))[:, ::2]


def half_length_buffer(x):
    return jnp.zeros((x.shape[0], x.shape[1] // 2)) + jnp.sum(x)


def broadcast_bias(x):
    return x + px.broadcast_like(jnp.float32(0.5), x)


def one_hot_tokens(tokens):
    return jax.nn.one_hot(tokens, 16).sum(axis=1)


def _tiny_model():
    return CharLM(cell="gru", embed=4, hidden=8, key=jax.random.PRNGKey(0))


def _poly_args(name):
    ints = px.Spec("B T", jnp.int32)
    lengths = px.Spec("B", jnp.int32, lengths_of="T")
    return {
        "masked_mean": (X(), lengths),
        "project": (np.ones((3, 5), np.float32), px.Spec("B T 3", jnp.float32)),
        "gru_loss": (_tiny_model(), ints, lengths),
        "one_hot_tokens": (ints,),
    }.get(name, (X(),))


POLYMORPHIC = [masked_mean, masked_softmax, running_sum, differences, project, gru_loss,
               fori_total, position_weighted, causal_mix, doubled_then_halves, padded_edges,
               half_length_buffer, broadcast_bias, one_hot_tokens]


@pytest.mark.parametrize("fn", POLYMORPHIC, ids=lambda f: f.__name__)
def test_polymorphic_functions_trace_once_for_all_sizes(fn):
    T, B = _vars()
    plan = px.trace(fn, *_poly_args(fn.__name__))
    assert not plan.reshaping_is_impossible, plan.reason
    assert plan.reason is None
    assert plan.exported is not None and plan.jaxpr is not None
    # The program is symbolic: its inputs carry the length variables, not sizes.
    assert "T" in {str(d) for a in plan.exported.in_avals for d in a.shape}


# -- not polymorphic: each needs a concrete size somewhere ------------------------------------

def int_of_length(x):
    scale = 1.0 / int(x.shape[1])  # <- not polymorphic
    return x * scale


def python_range(x):
    total = jnp.zeros(x.shape[0])
    for t in range(x.shape[1]):  # <- not polymorphic
        total = total + x[:, t]
    return total


def branch_on_comparison(x):
    y = jnp.tanh(x)
    if x.shape[1] > 10:  # <- not polymorphic
        y = y * 2.0
    return y


def literal_maximum(x):
    y = jnp.tanh(x)
    return y + jnp.zeros(1024)  # <- not polymorphic


def asks_max_length(x):
    n = px.max_length("T")  # <- not polymorphic
    return x * n


def numpy_buffer(x):
    y = x * 2.0
    return y + np.zeros(x.shape, np.float32)  # <- not polymorphic


def branch_on_equality(x):
    # JAX answers the symbolic `T == 1024` with False; polyexec's probe records that the
    # comparison could not be decided and names this line.
    y = jnp.tanh(x)
    if x.shape[1] == 1024:  # <- not polymorphic
        y = y * 2.0
    return y


def python_list_of_length(x):
    ones = [1.0] * x.shape[1]  # <- not polymorphic
    return x * jnp.asarray(ones)


def reshape_to_literal(x):
    y = jnp.tanh(x)
    return y.reshape(x.shape[0], 32, -1)  # <- not polymorphic


def math_sqrt_of_length(x):
    y = x @ x.T
    return y / math.sqrt(x.shape[1])  # <- not polymorphic


def numpy_positions(x):
    y = jnp.tanh(x)
    return y * np.linspace(0.0, 1.0, x.shape[1])  # <- not polymorphic


def literal_window(x):
    y = jnp.tanh(x)
    return jax.lax.dynamic_slice_in_dim(y, 0, 16, axis=1)  # <- not polymorphic


def even_split(x):
    y = jnp.tanh(x)
    first, second = jnp.split(y, 2, axis=1)  # <- not polymorphic
    return first * second


# numpy_buffer and python_list_of_length are not recovered from concrete traces: two length
# variables (B, T), whose relations three traces cannot tell (`polyexec._recover`).
NOT_POLYMORPHIC = [int_of_length, python_range, branch_on_comparison, literal_maximum,
                   asks_max_length, numpy_buffer, branch_on_equality, python_list_of_length,
                   reshape_to_literal, math_sqrt_of_length, numpy_positions, literal_window,
                   even_split]


def offending_line(fn) -> int:
    lines, start = inspect.getsourcelines(fn)
    marked = [start + i for i, line in enumerate(lines) if MARK in line]
    assert len(marked) == 1, f"{fn.__name__} must mark exactly one line"
    return marked[0]


def where(reason: str) -> tuple[str, int]:
    found = re.match(r"^(.*?):(\d+)\b", reason)
    assert found, f"reason does not start with file:line: {reason!r}"
    return found.group(1), int(found.group(2))


@pytest.mark.parametrize("fn", NOT_POLYMORPHIC, ids=lambda f: f.__name__)
def test_non_polymorphic_functions_are_caught_at_the_right_line(fn):
    T, B = _vars()
    plan = px.trace(fn, X())
    assert plan.reshaping_is_impossible, f"{fn.__name__} was called polymorphic"
    assert plan.exported is None and plan.jaxpr is None
    assert where(plan.reason) == (inspect.getsourcefile(fn), offending_line(fn)), plan.reason
    # The reason quotes the offending source line itself.
    source = inspect.getsourcelines(fn)[0][offending_line(fn) - inspect.getsourcelines(fn)[1]]
    assert source.split(MARK)[0].strip() in plan.reason


def test_zoo_size():
    assert len(POLYMORPHIC) >= 8 and len(NOT_POLYMORPHIC) >= 8


def test_max_length_reason_names_the_call():
    T, B = _vars()
    plan = px.trace(asks_max_length, X())
    assert "px.max_length('T') needs the concrete bucket size" in plan.reason


def test_equality_branch_is_caught_without_the_two_size_check():
    T, B = _vars()
    reason = px.trace(branch_on_equality, X(), check_sizes=False).reason
    assert "`T == 1024` cannot be decided for every size" in reason


def test_equal_probe_answers_like_the_exact_size_at_and_around_the_compared_size():
    T = px.LengthVar("T", max=128)

    def double_at_20(x):
        return x * 2 if x.shape[0] == 20 else x  # <- compared

    f = px.bucketed(double_at_20, in_specs=(px.Spec("T", jnp.float32),), out_specs=px.Spec("T"),
                    buckets={T: [8, 32, 128]})
    with pytest.warns(UserWarning, match="double_at_20 is not shape-polymorphic"):
        for t in (5, 19, 20, 21, 100):
            x = np.arange(t, dtype=np.float32)
            np.testing.assert_array_equal(f(x), double_at_20(x))
    assert where(f.plan.reason) == (inspect.getsourcefile(double_at_20),
                                    inspect.getsourcelines(double_at_20)[1] + 1)
    strict = px.bucketed(double_at_20, in_specs=(px.Spec("T", jnp.float32),), strict=True)
    with pytest.raises(px.PolymorphismError, match="`T == 20` cannot be decided"):
        strict(np.ones(20, np.float32))


def test_genuine_bug_is_raised_not_called_non_polymorphic():
    T, B = _vars()

    def wrong_axis(x):
        return x @ jnp.ones((3, 3))   # (B, T) @ (3, 3): wrong at every size except T=3

    # Fails at the smallest and at the largest bucket alike: a bug, raised as itself.
    with pytest.raises(TypeError, match="dot_general requires contracting dimensions to have "
                                        "the same shape"):
        px.trace(wrong_axis, X())


# -- non-polymorphic functions under bucketed -------------------------------------------------

def prefix_sums(x):  # x: (T,); correct at every size, but unrolled over a Python range
    return jnp.stack([jnp.sum(x[: t + 1]) for t in range(x.shape[0])])  # <- not polymorphic


def test_non_polymorphic_function_runs_per_bucket_with_one_warning():
    T = px.LengthVar("T", min=2, max=64)
    f = px.bucketed(prefix_sums, in_specs=(px.Spec("T", jnp.float32),), out_specs=px.Spec("T"),
                    buckets={T: [8, 16, 64]})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in (3, 8, 11, 16, 40, 5):
            x = np.arange(1, t + 1, dtype=np.float32)
            np.testing.assert_allclose(f(x), np.cumsum(x), rtol=1e-6)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert messages[0].startswith(
        "prefix_sums is not shape-polymorphic, so it is retraced and compiled per bucket, and "
        "nothing checks that padding leaves its result unchanged (each bucket runs it on the "
        "padded arrays as written): ")
    assert f.plan.reason in messages[0]
    assert where(f.plan.reason) == (inspect.getsourcefile(prefix_sums), offending_line(prefix_sums))
    # The slow path: one symbolic attempt, the concrete traces that find its structure differs
    # with the size (`_recover`), then one Python trace and one compile per bucket.
    assert f.stats.compiles == 3 and f.traces == 1 + CONCRETE_TRACES + 3


def test_a_retraced_function_is_run_on_the_padded_arrays_and_the_warning_says_so():
    # A running max unrolled over a Python range of the length has no size-independent
    # program, so the function is retraced per bucket and sums its padding too: a result
    # polyexec cannot guarantee.
    T, B = px.LengthVar("T", min=1, max=16), px.LengthVar("B", max=4)

    def running_max_total_grad(w, x, lengths):      # d/dw sum(cummax(x * w)) = sum(cummax(x))
        def total(w):
            running, out = x[:, 0] * w, 0.0
            for t in range(x.shape[1]):
                running = jnp.maximum(running, x[:, t] * w)
                out = out + jnp.sum(running)
            return out
        return jax.grad(total)(w)

    specs = (None, px.Spec("B T", jnp.float32), px.Spec("B", jnp.int32, lengths_of="T"))
    x, lengths = np.array([[1.0, 2.0, 3.0, 0.0]], np.float32), np.array([3], np.int32)
    f = px.bucketed(running_max_total_grad, specs, buckets={T: [8], B: [4]})
    with pytest.warns(UserWarning, match=r"retraced and compiled per bucket, and nothing checks "
                                         r"that padding leaves its result unchanged"):
        got = f(1.0, x, lengths)
    assert f.plan.reshaping_is_impossible
    assert float(got) == 21.0 != 1.0 + 2.0 + 3.0    # the padding's running max, summed too
    # masking=False: the padded arrays as written are the contract, so nothing is left unsaid.
    unmasked = px.bucketed(running_max_total_grad, specs, buckets={T: [8], B: [4]},
                           masking=False)
    with pytest.warns(UserWarning) as caught:
        unmasked(1.0, x, lengths)
    assert "retraced and compiled per bucket; its outputs keep the bucket's shape" in str(
        caught[0].message)


def test_a_retraced_function_without_out_specs_says_its_outputs_keep_the_buckets_shape():
    T, B = px.LengthVar("T", min=2, max=32), px.LengthVar("B", max=8)

    def half_mass(x):                    # a Python branch on a length: not polymorphic
        c = jnp.cumsum(jnp.abs(x), axis=1)
        if x.shape[1] > 4:
            c = c[:, ::-1]
        return jnp.argmax(c >= 0.5 * c[:, -1:], axis=1).astype(jnp.int32)

    x = np.ones((5, 6), np.float32)
    for out_specs, rows in ((None, 8), (px.Spec("B", jnp.int32), 5)):
        f = px.bucketed(half_mass, (px.Spec("B T", jnp.float32),), out_specs=out_specs,
                        buckets={T: [8, 32], B: [8]})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = f(x)
        assert f.plan.reshaping_is_impossible and np.shape(got) == (rows,)
        said = "its outputs keep the bucket's shape (out_specs says how to cut them back)"
        assert [said in str(w.message) for w in caught] == [out_specs is None]


def test_strict_mode_raises_polymorphism_error_with_the_reason():
    T = px.LengthVar("T", min=2, max=64)
    f = px.bucketed(prefix_sums, in_specs=(px.Spec("T", jnp.float32),), strict=True,
                    buckets={T: [8, 64]})
    with pytest.raises(px.PolymorphismError) as info:
        f(np.ones(5, np.float32))
    assert where(info.value.reason) == (inspect.getsourcefile(prefix_sums),
                                        offending_line(prefix_sums))
    assert "TypeError: '_DimExpr' object cannot be interpreted as an integer" in info.value.reason
    assert str(info.value) == info.value.reason
    assert f.stats.compiles == 0


def test_bucketed_check_sizes_makes_a_size_branch_correct():
    T = px.LengthVar("T", min=2, max=64)

    def double_at_max(x):
        if x.shape[0] == 64:
            return x * 2.0
        return x

    spec = (px.Spec("T", jnp.float32),)
    x = np.ones(64, np.float32)
    # Even without the check, the == probe flags the branch: right at T=64.
    with pytest.warns(UserWarning, match="double_at_max is not shape-polymorphic"):
        unchecked = px.bucketed(double_at_max, in_specs=spec, out_specs=px.Spec("T"),
                                buckets={T: [16, 64]})
        np.testing.assert_array_equal(unchecked(x), 2 * x)
    assert unchecked.plan.reshaping_is_impossible
    with pytest.warns(UserWarning, match="double_at_max is not shape-polymorphic"):
        checked = px.bucketed(double_at_max, in_specs=spec, out_specs=px.Spec("T"),
                              buckets={T: [16, 64]}, check_sizes=True)
        np.testing.assert_array_equal(checked(x), 2 * x)
    np.testing.assert_array_equal(checked(np.ones(10, np.float32)), np.ones(10))
