"""Partitioned execution: functions cut at data-dependent ops, re-bucketed after each cut.

"Traced once" for a partitioned function means: Python runs the user function once per
segment (a function with n partition points has n + 1 segments, so n + 1 traces), however many
buckets each segment is compiled for. Counted here with a Python counter inside the function
and with `f.traces`; compiles with `f.stats`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import polyexec as px


# Names no other test module uses: Specs name variables by string, and a string refers to the
# most recently defined LengthVar of that name, process-wide.
T = px.LengthVar("Tp", min=1, max=64)
K = px.LengthVar("Kp", min=1, max=64)
J = px.LengthVar("Jp", min=1, max=64)
W_IN = np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32)


def filter_then_project(x, w, threshold):
    """x: (T, 3) -> the rows whose first column exceeds threshold, projected: (K, 5)."""
    real = px.arange_like(x) < px.valid_length(T)           # padding rows are never kept
    kept, count = px.compact(x, real & (x[:, 0] > threshold), length=K)
    h = jnp.tanh(kept @ w)
    rows = px.arange_like(h)[:, None] < px.valid_length(K)
    return {"h": h, "total": jnp.sum(jnp.where(rows, h, 0.0)), "count": count}


def numpy_filter_then_project(x, w, threshold):
    h = np.tanh(x[x[:, 0] > threshold] @ w)
    return {"h": h, "total": h.sum(), "count": len(h)}


OUT = {"h": px.Spec("Kp 5"), "total": None, "count": None}


@pytest.fixture(scope="module")
def partitioned():
    return px.bucketed(filter_then_project, in_specs=(px.Spec("Tp 3", jnp.float32), None, None),
                       out_specs=OUT, buckets={T: [16, 64], K: [4, 16, 64]})


@settings(max_examples=12)
@given(n=st.integers(1, 64), threshold=st.sampled_from([-np.inf, -0.5, 0.0, 0.8, np.inf]),
       seed=st.integers(0, 2**31 - 1))
def test_partitioned_function_agrees_with_numpy(partitioned, n, threshold, seed):
    x = np.random.default_rng(seed).normal(size=(n, 3)).astype(np.float32)
    out = partitioned(x, W_IN, np.array(threshold, np.float32))
    expected = numpy_filter_then_project(x, W_IN, threshold)
    assert out["h"].shape == expected["h"].shape            # exactly the kept rows: no padding
    np.testing.assert_allclose(out["h"], expected["h"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(out["total"]), expected["total"], rtol=1e-4, atol=1e-5)
    assert int(out["count"]) == expected["count"]
    assert partitioned.traces == 2                           # one per segment, ever


def test_downstream_compiles_once_per_bucket_and_python_traces_each_segment_once():
    traces = []

    def f(x):
        traces.append(x.shape)
        kept, _ = px.compact(x, x > 0, length=K)
        return jnp.cumsum(kept * 2)

    g = px.bucketed(f, in_specs=(px.Spec("Tp", jnp.float32),), out_specs=px.Spec("Kp"),
                    buckets={T: [32, 64], K: [4, 16, 64]})
    # kept counts 2, 3, 10, 12, 40 -> K buckets 4, 4, 16, 16, 64; inputs in both T buckets.
    for n, kept in [(20, 2), (50, 3), (30, 10), (60, 12), (64, 40)]:
        x = -np.ones(n, np.float32)
        x[:kept] = np.arange(1, kept + 1)
        np.testing.assert_allclose(g(x), np.cumsum(np.arange(1, kept + 1) * 2.0))
    assert len(traces) == 2 and g.traces == 2
    upstream = {k: b for k, b in g.stats.buckets.items() if dict(k).keys() == {"Tp"}}
    downstream = {k: b for k, b in g.stats.buckets.items() if "Kp" in dict(k)}
    assert {dict(k)["Tp"] for k in upstream} == {32, 64}
    assert sum(b.compiles for b in upstream.values()) == 2
    # The downstream segment reads only what the cut handed over, so its programs are keyed
    # by K alone: three K buckets -> exactly three compiles, whatever T bucket came first.
    assert sorted(dict(k)["Kp"] for k in downstream) == [4, 16, 64]
    assert all(set(dict(k)) == {"Kp"} for k in downstream)
    assert sum(b.compiles for b in downstream.values()) == 3
    assert sum(b.calls for b in downstream.values()) == 5
    with px.forbid_compiles():                               # every bucket is compiled now
        g(np.ones(33, np.float32))
    assert len(traces) == 2


def test_segment_that_recomputes_inputs_is_compiled_per_input_and_kept_bucket():
    def f(x):
        kept, _ = px.compact(x, x > 0, length=K)
        return jnp.sum(kept) + jnp.sum(x)        # sum(x) is recomputed after the cut

    g = px.bucketed(f, in_specs=(px.Spec("Tp", jnp.float32),), buckets={T: [32, 64], K: [4, 64]})
    for n in (10, 40):
        x = np.linspace(-1, 1, n).astype(np.float32)
        np.testing.assert_allclose(float(g(x)), x[x > 0].sum() + x.sum(), rtol=1e-5, atol=1e-5)
    final = g.plan.segments[1]
    assert [v.name for v in final.variables] == ["Tp", "Kp"]
    assert {tuple(dict(k)) for k in g.stats.buckets} == {("Tp",), ("Tp", "Kp")}


@settings(max_examples=8)
@given(n=st.integers(1, 64), seed=st.integers(0, 2**31 - 1))
def test_two_partition_points_agree_with_numpy(n, seed):
    x = np.random.default_rng(seed).normal(size=n).astype(np.float32) * 2
    out, j = two_cuts(x)
    kept = x[x > 0]
    expected = kept[kept > 1] * 2 + x.sum()
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert int(j) == len(expected)
    assert two_cuts.traces == 3 and len(two_cuts.plan.segments) == 3


def _two_cuts(x):
    a, n = px.compact(x, x > 0, length=K)                                    # (K,)
    b, _ = px.compact(a * 2, (a > 1) & (px.arange_like(a) < n), length=J)    # (J,)
    return b + jnp.sum(x), px.valid_length(J)


two_cuts = px.bucketed(_two_cuts, in_specs=(px.Spec("Tp", jnp.float32),),
                       out_specs=(px.Spec("Jp"), None), buckets={T: [16, 64], K: [8, 64],
                                                               J: [8, 64]})


def test_bounded_mode_gives_the_same_results_as_one_program():
    f = px.bucketed(filter_then_project, in_specs=(px.Spec("Tp 3", jnp.float32), None, None),
                    out_specs=OUT, buckets={T: [16, 64]}, partition=False)
    g = px.bucketed(filter_then_project, in_specs=(px.Spec("Tp 3", jnp.float32), None, None),
                    out_specs=OUT, buckets={T: [16, 64]})
    rng = np.random.default_rng(5)
    for n in (3, 40, 64):
        x = rng.normal(size=(n, 3)).astype(np.float32)
        a, b = f(x, W_IN, np.array(0.1, np.float32)), g(x, W_IN, np.array(0.1, np.float32))
        np.testing.assert_allclose(a["h"], b["h"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(a["h"], numpy_filter_then_project(x, W_IN, 0.1)["h"],
                                   rtol=1e-5, atol=1e-6)
    assert len(f.plan.segments) == 1 and f.traces == 1
    assert f.stats.compiles == 2 and all(set(dict(k)) == {"Tp"} for k in f.stats.buckets)
    assert "bounded" in f.plan.describe()


def test_greedy_decoding_then_downstream_work_at_the_decoded_length():
    """loop_until(length=L): decode until the end token, then embed the decoded tokens."""
    L = px.LengthVar("L", max=32)
    B = px.LengthVar("B", max=8)
    table = np.array([0, 3, 1, 2, 5, 0, 4, 6], np.int32)
    embed = np.random.default_rng(1).normal(size=(8, 4)).astype(np.float32)

    def generate(table, embed, prompt):                     # prompt: (B,) tokens
        def step(i, token):
            new = table[token]
            return new, new, new == 0
        last_real = prompt[px.valid_length(B) - 1]              # prompt[-1] may be padding
        tokens, count, last = px.loop_until(step, last_real, max_steps=32, length=L)
        return tokens, jnp.cumsum(embed[tokens], axis=0), last

    f = px.bucketed(generate, in_specs=(None, None, px.Spec("B", jnp.int32)),
                    out_specs=(px.Spec("L"), px.Spec("L 4"), None))
    for prompt in ([1, 4], [7], [3, 3, 2]):
        tokens, features, last = f(table, embed, np.array(prompt, np.int32))
        expected, token = [], prompt[-1]
        while len(expected) < 32:
            token = int(table[token])
            expected.append(token)
            if token == 0:
                break
        np.testing.assert_array_equal(tokens, expected)
        np.testing.assert_allclose(features, np.cumsum(embed[expected], axis=0), rtol=1e-5)
        assert int(last) == expected[-1]
    assert f.traces == 2


def test_nonzero_partition_point():
    def positions(x):                                       # x: (T,)
        idx, _ = px.nonzero(x > 0, length=K)
        return idx * 10
    f = px.bucketed(positions, in_specs=(px.Spec("Tp", jnp.float32),), out_specs=px.Spec("Kp"))
    x = np.array([0, 1, -1, 2, 0, 3], np.float32)
    np.testing.assert_array_equal(f(x), np.flatnonzero(x > 0) * 10)


def test_describe_and_shapes_cover_every_segment():
    plan = px.trace(filter_then_project, px.Spec("Tp 3", jnp.float32), W_IN, np.array(0, np.float32))
    assert isinstance(plan, px.Plan) and plan.mode == "partition" and len(plan.segments) == 2
    text = plan.describe()
    assert "CUT at" in text and "px.compact(x, real & (x[:, 0] > threshold), length=K)" in text
    assert "segment 0" in text and "segment 1" in text and "float32[Kp,5]" in text
    shapes = plan.shapes(Tp=50, Kp=7)
    first = [s for s in shapes if s.segment == 0]
    second = [s for s in shapes if s.segment == 1]
    assert first[0].primitive == "input" and (50, 3) in [s.shapes[0] for s in first]
    assert any(s.primitive == "dot_general" and s.shapes == ((7, 5),) for s in second)
    assert dict(zip(plan.out_paths, plan.output_shapes(Tp=50, Kp=7)))["['h']"] == (7, 5)
    with pytest.raises(px.SpecError, match="missing: \\['Kp'\\]"):
        plan.shapes(Tp=50)
    with pytest.raises(px.SpecError, match="outside"):
        plan.shapes(Tp=50, Kp=65)


def test_a_plain_function_is_still_one_program():
    f = px.bucketed(lambda x: x * 2, in_specs=(px.Spec("Tp", jnp.float32),), out_specs=px.Spec("Tp"))
    f(np.ones(3, np.float32))
    assert f.plan.mode == "single" and not f.plan.dynamic
    assert len(f.plan.segments) == 1 and f.plan.segments[0].exported is f.plan.exported


def test_warmup_compiles_every_segment_bucket_then_nothing_compiles():
    f = px.bucketed(filter_then_project, in_specs=(px.Spec("Tp 3", jnp.float32), None, None),
                    out_specs=OUT, buckets={T: [16, 64], K: [4, 64]})
    compiled = f.warmup(W_IN, np.array(0, np.float32))
    assert sorted(map(lambda d: tuple(sorted(d.items())), compiled)) == [
        (("Kp", 4),), (("Kp", 64),), (("Tp", 16),), (("Tp", 64),)]
    assert f.stats.compiles == 4
    with px.forbid_compiles():
        for n in (5, 64):
            f(np.ones((n, 3), np.float32), W_IN, np.array(0, np.float32))


# -- errors -------------------------------------------------------------------------------------


def test_count_above_the_variables_max_is_a_length_overflow():
    small = px.LengthVar("Small", max=4)

    def f(x):
        kept, _ = px.compact(x, x > 0, length=small)
        return kept
    g = px.bucketed(f, in_specs=(px.Spec("Tp", jnp.float32),), out_specs=px.Spec("Small"))
    np.testing.assert_array_equal(g(np.array([1, -1, 2], np.float32)), [1, 2])
    with pytest.raises(px.LengthOverflowError, match="Small = 5 is above Small's max=4"):
        g(np.ones(5, np.float32))


def test_length_inside_a_nested_transformation_is_rejected():
    def f(x):
        kept, _ = jax.vmap(lambda row: px.compact(row, row > 0, length=K))(x)
        return kept
    g = px.bucketed(f, in_specs=(px.Spec("Tp 4", jnp.float32),))
    with pytest.raises(px.PolyexecError, match="top level"):
        g(np.ones((3, 4), np.float32))


def test_defining_a_variable_twice_or_an_input_variable_is_rejected():
    def twice(x):
        a, _ = px.compact(x, x > 0, length=K)
        b, _ = px.compact(a, a > 1, length=K)
        return b
    with pytest.raises(px.PolyexecError, match="defined twice"):
        px.bucketed(twice, in_specs=(px.Spec("Tp", jnp.float32),))(np.ones(3, np.float32))

    def input_var(x):
        return px.compact(x, x > 0, length=T)[0]
    with pytest.raises(px.PolyexecError, match="already a length variable of the inputs"):
        px.bucketed(input_var, in_specs=(px.Spec("Tp", jnp.float32),))(np.ones(3, np.float32))


def test_out_specs_naming_an_undefined_size_is_a_spec_error():
    f = px.bucketed(lambda x: x, in_specs=(px.Spec("Tp", jnp.float32),), out_specs=px.Spec("Kp"))
    with pytest.raises(px.SpecError, match="no px.compact"):
        f(np.ones(3, np.float32))


def test_a_non_polymorphic_segment_after_the_cut_is_reported():
    def f(x):
        kept, _ = px.compact(x, x > 0, length=K)
        return kept + jnp.zeros(64)              # assumes the maximum size
    g = px.bucketed(f, in_specs=(px.Spec("Tp", jnp.float32),))
    with pytest.raises(px.PolymorphismError, match="segment 1"):
        g(np.ones(3, np.float32))


def test_partitioned_plans_cannot_be_saved(tmp_path):
    plan = px.trace(filter_then_project, px.Spec("Tp 3", jnp.float32), W_IN, np.array(0, np.float32))
    with pytest.raises(px.PolyexecError, match="not supported"):
        plan.save(tmp_path / "plan.bin")


def test_a_count_larger_than_its_buffer_is_reported():
    def f(x):
        values, n = px.partition(x, jnp.int32(100), length=K)
        return values
    g = px.bucketed(f, in_specs=(px.Spec("Tp", jnp.float32),), buckets={T: [8, 64]})
    with pytest.raises(px.PolyexecError, match=r"count 100 is outside \[0, 8\]"):
        g(np.ones(3, np.float32))


def test_slow_path_before_the_cut_runs_bounded_unless_outputs_need_the_count():
    def f(x):
        scale = px.max_length(T)                  # not polymorphic: per-bucket slow path
        kept, n = px.compact(x, x > 0, length=K)
        return jnp.sum(kept) * scale, px.valid_length(K), kept

    with pytest.warns(UserWarning, match="not shape-polymorphic"):
        g = px.bucketed(f, in_specs=(px.Spec("Tp", jnp.float32),), buckets={T: [8, 64]})
        total, count, _ = g(np.array([1, -1, 2], np.float32))
    assert float(total) == 3 * 8 and int(count) == 2   # bounded: valid_length(K) is the count
    # Slicing an output to K needs the count, which the per-bucket slow path does not return.
    h = px.bucketed(f, in_specs=(px.Spec("Tp", jnp.float32),), out_specs=(None, None, px.Spec("Kp")),
                    buckets={T: [8, 64]})
    with pytest.raises(px.PolymorphismError, match="data-dependent size"):
        h(np.ones(3, np.float32))


def test_filter_mlp_benchmark_runs_and_checks_its_results():
    """The benchmark's bookkeeping (not its timings): equal results, compile and trace counts."""
    from bench.filter_mlp import run

    result = run(rows=64, keep=0.1, width=8, depth=1, repeats=1)
    assert result["equal"] and result["max_abs_diff"] < 1e-4
    assert result["kept"] == 6 and result["K_bucket"] == 8
    assert (result["compiles_partitioned_upstream"], result["compiles_partitioned_downstream"],
            result["compiles_bounded"]) == (1, 1, 1)
    assert result["traces_partitioned"] == 2 and result["traces_bounded"] == 1
