"""jax.debug.print and jax.debug.callback inside bucketed functions and `fit` (issue 49).

`jax.export` refuses a program that calls back into Python, which made any function holding
one "retraced per bucket" (and run on its padding as written). The executor now takes the
calls out of the exported program -- their operands become extra outputs -- and makes them on
the host after each run, with the values the exact call computes; only `Plan.save` refuses."""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import polyexec as px

T, B = px.LengthVar("T", min=1, max=64), px.LengthVar("B", max=8)
SPECS = (px.Spec("B T", jnp.float32), px.Spec("B", jnp.int32, lengths_of="T"))
LENGTHS = np.array([10, 3, 7], np.int32)


def _ragged():
    x = np.full((3, 10), 100.0, np.float32)            # 100: padding the callbacks must not see
    for b, n in enumerate(LENGTHS):
        x[b, :n] = np.arange(n)
    return x


def _exact_sum():
    return float(sum(np.arange(n).sum() for n in LENGTHS))


def _printing(x, lengths):
    jax.debug.print("total {t}", t=jnp.sum(x))
    return jnp.mean(x, axis=1)


@pytest.mark.parametrize("layout", ["pad", "pack"])
def test_debug_print_in_a_bucketed_function_prints_the_exact_value_each_call(layout, capsys):
    f = px.bucketed(_printing, SPECS, buckets={T: [16, 64]}, layout=layout)
    x = _ragged()
    for _ in range(2):
        out = f(x, LENGTHS)
    # Before: "retraced per bucket" (NotImplementedError: serialization of host_callbacks ...).
    assert not f.plan.reshaping_is_impossible and f.plan.padding_safe, f.plan.reason
    assert f.traces == 1 and f.stats.compiles == 1
    assert capsys.readouterr().out.splitlines() == [f"total {_exact_sum()}"] * 2
    np.testing.assert_allclose(out, [x[b, :n].mean() for b, n in enumerate(LENGTHS)], rtol=1e-6)


def test_debug_callback_receives_each_value_in_program_order():
    seen = []

    def f(x, lengths):
        jax.debug.callback(lambda s, m: seen.append(("first", float(s), float(m))),
                           jnp.sum(x), jnp.max(x))
        y = x * 2
        jax.debug.callback(lambda s: seen.append(("second", float(s))), jnp.sum(y))
        return jnp.sum(y)

    g = px.bucketed(f, SPECS, buckets={T: [16]})
    assert float(g(_ragged(), LENGTHS)) == 2 * _exact_sum()
    assert seen == [("first", _exact_sum(), 9.0), ("second", 2 * _exact_sum())]


def test_a_plan_holding_a_callback_runs_but_save_refuses_it_by_name(tmp_path):
    f = px.bucketed(_printing, SPECS, buckets={T: [16]})
    f(_ragged(), LENGTHS)
    with pytest.raises(px.PolyexecError, match=r"cannot save plan _printing: .* calls back into "
                       r"Python \(jax.debug.print / jax.debug.callback at .*test_debug_callbacks"
                       r"\.py:\d+"):
        f.plan.save(tmp_path / "plan.px")
    assert not os.listdir(tmp_path)


def test_a_callback_of_a_value_with_a_length_axis_names_the_line():
    """Its extra output would carry the padding: retraced per bucket as before, the verdict
    saying why at the user's line."""
    def f(x, lengths):
        jax.debug.print("{}", x)
        return jnp.sum(x)

    g = px.bucketed(f, SPECS, buckets={T: [16]})
    with pytest.warns(UserWarning, match="length axis"):
        g(_ragged(), LENGTHS)
    plan = g.plan
    assert plan.reshaping_is_impossible
    assert "test_debug_callbacks.py" in plan.reason and "('B', 'T')" in plan.reason


def test_fit_runs_a_loss_that_prints_and_prints_each_steps_loss(capsys):
    from polyexec import training

    rng = np.random.default_rng(0)
    data = [{"x": rng.normal(size=n).astype(np.float32)} for n in rng.integers(2, 9, 12)]

    def loss(model, batch):
        value = jnp.mean((jax.vmap(jax.vmap(model))(batch["x"][..., None])[..., 0] - 1) ** 2)
        jax.debug.print("step loss {v}", v=value)
        return value

    result = training.fit(eqx.nn.Linear(1, 1, key=jax.random.PRNGKey(0)), loss, data,
                          optimizer=optax.sgd(0.1), batch_size=4, buckets=[8], verbose=False,
                          cache=False)
    printed = [float(line.split()[-1]) for line in capsys.readouterr().out.splitlines()
               if line.startswith("step loss")]
    steps = [r["loss"] for r in result.history if r["kind"] == "step"]
    assert result.train_step.traces == 1 and len(steps) == 3
    np.testing.assert_allclose(printed, steps, rtol=1e-6)


def test_a_callback_inside_a_loop_names_the_line_instead_of_jaxs_serialization_error():
    def f(x, lengths):
        def body(carry, row):
            jax.debug.print("row {}", jnp.sum(row))
            return carry + jnp.sum(row), None
        return jax.lax.scan(body, 0.0, x)[0]

    g = px.bucketed(f, SPECS, buckets={T: [16]})
    with pytest.warns(UserWarning, match="sub-program"):
        g(_ragged(), LENGTHS)
    # Before: "<unknown location>: NotImplementedError: serialization of host_callbacks ...".
    assert "test_debug_callbacks.py" in g.plan.reason and "top level" in g.plan.reason
