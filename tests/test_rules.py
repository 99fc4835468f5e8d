"""`px.register_rule`: rules for primitives polyexec does not know, through the same registry
as its own.

Each test defines a fresh custom primitive (so no registration leaks into another test), uses
it in a function run by `px.bucketed` over a length axis with NaN padding, and checks that it
is flagged at this file's line before registration and exact after.
"""

from __future__ import annotations

import inspect
import itertools
import os
import re

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax.interpreters import mlir

import polyexec as px

_FRESH = itertools.count()


def _primitive(kind: str, impl, out_shape=lambda shape: shape):
    """A new primitive named after ``kind`` (unique per call), with an implementation, an
    abstract evaluation and a lowering, as a user defines a custom kernel."""
    p = jax.extend.core.Primitive(f"test_rules_{kind}_{next(_FRESH)}")
    p.def_impl(impl)
    p.def_abstract_eval(lambda x: jax.core.ShapedArray(out_shape(x.shape), x.dtype))
    mlir.register_lowering(p, mlir.lower_fun(impl, multiple_results=False))
    return p


def _bucketed(fn, dims="T 3"):
    T = px.LengthVar("T", max=32)
    return px.bucketed(fn, in_specs=(px.Spec(dims, jnp.float32, pad=np.nan),),
                       buckets={T: [8, 32]})


def _line_of(fn, marker: str) -> int:
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, text in enumerate(lines) if marker in text)


def _assert_flagged_at(f, fn, marker: str, primitive) -> None:
    """The plan (made here, on first access) warns once and names this file's line."""
    with pytest.warns(UserWarning, match="not padding-safe"):
        plan = f.plan
    assert plan.reason is None and plan.padding_safe is False
    where = f"{os.path.abspath(__file__)}:{_line_of(fn, marker)}"
    assert where in plan.padding_reason and primitive.name in plan.padding_reason, \
        plan.padding_reason


def _assert_exact(f, fn, sizes, dims=(3,)):
    for t in sizes:
        x = np.random.default_rng(t).standard_normal((t, *dims)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(f(x)), np.asarray(jax.jit(fn)(x)), rtol=1e-5,
                                   atol=1e-5, err_msg=f"at T={t}")


def test_an_elementwise_primitive_is_flagged_then_exact_once_registered():
    softplus_p = _primitive("softplus", lambda x: jnp.logaddexp(x, 0.0))

    def total(x):                                   # x: (T, 3)
        y = softplus_p.bind(x)                      # the custom line
        return jnp.sum(y, 0), jnp.max(y, 0), y[-1]

    before = _bucketed(total)
    _assert_flagged_at(before, total, "# the custom line", softplus_p)

    px.register_rule(softplus_p, "elementwise")
    after = _bucketed(total)
    assert after.plan.padding_safe, after.plan.padding_reason
    _assert_exact(after, total, (1, 5, 8, 9, 31))


def test_a_reduction_primitive_is_exact_with_a_rule_that_fills_the_tail():
    # A sum over the length axis: the NaN padding would be summed in unless the rule fills it.
    time_sum_p = _primitive("time_sum", lambda x: jnp.sum(x, 0), lambda shape: shape[1:])

    def pooled(x):                                  # x: (T, 3)
        return time_sum_p.bind(x) / x.shape[0]      # the pooling line

    before = _bucketed(pooled)
    _assert_flagged_at(before, pooled, "# the pooling line", time_sum_p)
    assert np.isnan(before(np.ones((5, 3), np.float32))).all()   # what the verdict warned of

    def fill_then_sum(ctx, eqn, invals):
        (x,) = invals
        assert ctx.length(3) == 3                   # a constant dimension is itself
        return time_sum_p.bind(ctx.fill_tail(x, [0], 0.0))

    px.register_rule(time_sum_p, fill_then_sum)
    after = _bucketed(pooled)
    assert after.plan.padding_safe, after.plan.padding_reason
    _assert_exact(after, pooled, (1, 5, 8, 9, 31))


def test_a_rule_may_use_the_logical_length_as_a_value():
    # A "last position" primitive: at the exact size it reads x[t - 1], padded x[T - 1].
    last_p = _primitive("last", lambda x: x[-1], lambda shape: shape[1:])

    def last_row(ctx, eqn, invals):
        (x,) = invals
        return [jax.lax.dynamic_index_in_dim(x, ctx.length(x.shape[0]) - 1, 0, keepdims=False)]

    px.register_rule(last_p, last_row)

    def final(x):
        return last_p.bind(x) * 2

    f = _bucketed(final)
    assert f.plan.padding_safe, f.plan.padding_reason
    _assert_exact(f, final, (1, 6, 8, 20))


def test_a_registration_by_name_covers_every_primitive_of_that_name():
    p = _primitive("by_name", lambda x: x * 3.0)
    px.register_rule(p.name, "elementwise")
    twin = _primitive("unused", lambda x: x * 3.0)
    twin.name = p.name                               # a second primitive of the same name

    def f(x):
        return jnp.sum(p.bind(x) + twin.bind(x), 0)

    bucketed = _bucketed(f)
    assert bucketed.plan.padding_safe, bucketed.plan.padding_reason
    _assert_exact(bucketed, f, (3, 9))


def test_registering_over_a_rule_needs_override():
    p = _primitive("twice", lambda x: jnp.sum(x, 0), lambda shape: shape[1:])
    px.register_rule(p, "elementwise")              # wrong for a sum: replaced below
    with pytest.raises(px.OptionError, match=rf"register_rule: primitive '{p.name}' already has "
                                             r"a rule \(registered by register_rule\); pass "
                                             r"override=True to replace it"):
        px.register_rule(p, lambda ctx, eqn, invals: None)
    with pytest.raises(px.OptionError, match=r"primitive 'rev' already has a rule \(polyexec's "
                                             r"own\)"):
        px.register_rule("rev", "elementwise")
    with pytest.raises(px.OptionError, match="primitive 'reduce_sum' already has a rule"):
        px.register_rule(jax.lax.reduce_sum_p, "elementwise")

    def f(x):
        return p.bind(x)

    wrong = _bucketed(f)
    assert wrong.plan.padding_safe        # as declared: a wrong declaration is the user's own
    assert np.isnan(wrong(np.ones((5, 3), np.float32))).all()   # the padding was summed
    px.register_rule(p, lambda ctx, eqn, invals: [p.bind(ctx.fill_tail(invals[0], [0], 0.0))],
                     override=True)
    _assert_exact(_bucketed(f), f, (5,))


@pytest.mark.parametrize("rule", ["pass-through", "Elementwise", None, 3, ("elementwise",)])
def test_a_bad_rule_lists_the_valid_options(rule):
    p = _primitive("bad_rule", lambda x: x)
    with pytest.raises(px.OptionError, match=re.escape(
            f"register_rule: rule: expected one of 'elementwise' or a callable "
            f"rule(ctx, eqn, invals), received {rule!r}")):
        px.register_rule(p, rule)


@pytest.mark.parametrize("primitive", [None, "", 3, jax.numpy.sum])
def test_a_bad_primitive_is_refused(primitive):
    with pytest.raises(px.OptionError, match=r"register_rule: primitive: expected a "
                                             r"jax.extend.core.Primitive or a primitive's name"):
        px.register_rule(primitive, "elementwise")


def test_override_must_be_a_bool():
    p = _primitive("override_flag", lambda x: x)
    with pytest.raises(px.OptionError, match="override: expected True or False, received 1"):
        px.register_rule(p, "elementwise", override=1)


@pytest.mark.parametrize("returns, detail", [
    (lambda x: [x, x], "returned 2 outputs, expected 1"),
    (lambda x: [x[:1]], "returned output 0 of shape"),
    (lambda x: 1 / 0, "ZeroDivisionError"),
])
def test_a_wrong_rule_is_a_verdict_not_a_crash(returns, detail):
    p = _primitive("wrong", lambda x: x * 2.0)
    px.register_rule(p, lambda ctx, eqn, invals: returns(invals[0]))

    def f(x):
        return p.bind(x)                            # the wrong rule's line

    bucketed = _bucketed(f)
    _assert_flagged_at(bucketed, f, "# the wrong rule's line", p)
    assert detail in bucketed.plan.padding_reason
    # It runs as written (here an elementwise op, so still right).
    np.testing.assert_allclose(bucketed(np.ones((5, 3), np.float32)), np.full((5, 3), 2.0))
