"""The bucketed executor: one Python trace, one compile per bucket used, warmup, stats, caching.

Length variables are defined inside each test: Specs name variables by string and resolve them
when a bucketed function is created, so a module-level ``T`` could be shadowed by a ``T`` that
another test module (or a doctest) defines later.
"""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polyexec as px


def _cumsum_fn(counter):
    def running_total(x):  # x: (T,)
        counter.append(x.shape)
        return jnp.cumsum(x * 2.0)
    return running_total


# Sizes 3, 8 -> bucket 8; 9, 16 -> 16; 17, 30 -> 32; 33, 64 -> 64: four buckets in all.
SIZES = [3, 8, 9, 16, 17, 30, 33, 64]


def _poly_bucketed(counter, **options):
    T = px.LengthVar("T", max=64)
    return px.bucketed(_cumsum_fn(counter), in_specs=(px.Spec("T", jnp.float32),),
                       out_specs=px.Spec("T"), buckets={T: [8, 16, 32, 64]}, **options)


def test_one_python_trace_and_one_compile_per_bucket():
    traced = []
    f = _poly_bucketed(traced)
    for t in SIZES:
        x = np.arange(t, dtype=np.float32)
        np.testing.assert_allclose(f(x), np.cumsum(2 * x), rtol=1e-6)
    assert len(traced) == 1, f"the user function ran {len(traced)} times in Python: {traced}"
    assert f.traces == 1 and f.stats.traces == 1
    assert f.stats.compiles == 4
    stats = f.stats.buckets
    assert sorted(stats) == [(("T", 8),), (("T", 16),), (("T", 32),), (("T", 64),)]
    assert [stats[k].compiles for k in sorted(stats)] == [1, 1, 1, 1]
    assert [stats[k].calls for k in sorted(stats)] == [2, 2, 2, 2]
    assert all(stats[k].compile_seconds > 0 for k in stats)
    # The trace was symbolic: the one shape the function saw is (T,), not a bucket size.
    assert str(traced[0]) == "(T,)"


def test_second_call_in_a_bucket_compiles_nothing():
    traced = []
    f = _poly_bucketed(traced)
    for t in (5, 12, 20, 40):
        f(np.ones(t, np.float32))
    assert f.stats.compiles == 4
    with px.forbid_compiles():
        for t in (1, 7, 13, 16, 31, 50, 64):
            x = np.full(t, 3.0, np.float32)
            np.testing.assert_allclose(f(x), np.cumsum(2 * x), rtol=1e-6)
    assert f.stats.compiles == 4 and len(traced) == 1
    assert f.stats.calls == 11


def test_new_bucket_inside_forbid_compiles_raises_before_compiling():
    f = _poly_bucketed([])
    f(np.ones(5, np.float32))
    with pytest.raises(px.CompileError, match=r"bucket \{'T': 16\} is not compiled and compiles "
                                              r"are forbidden here"):
        with px.forbid_compiles():
            f(np.ones(12, np.float32))
    assert f.stats.compiles == 1
    # Outside the block the bucket compiles normally: the failed attempt left no broken entry.
    np.testing.assert_allclose(f(np.ones(12, np.float32)), 2.0 * np.arange(1, 13))
    assert f.stats.compiles == 2


def test_forbid_compiles_reports_other_compiles():
    def eager_work():
        # A jitted function at a shape never seen before: one XLA compile, not from polyexec.
        return jax.jit(lambda x: x * 3 + 1)(np.ones(37, np.float32))

    with pytest.raises(px.CompileError, match=r"^[1-9][0-9]* compile\(s\) inside "
                                              r"forbid_compiles: an XLA compile of [0-9.]+ s"):
        with px.forbid_compiles():
            eager_work()


def test_warmup_compiles_every_bucket_then_calls_compile_nothing():
    traced = []
    f = _poly_bucketed(traced)
    compiled = f.warmup(max_workers=4)
    assert sorted(c["T"] for c in compiled) == [8, 16, 32, 64]
    assert f.stats.compiles == 4 and len(traced) == 1
    with px.forbid_compiles():
        for t in SIZES:
            x = np.linspace(0, 1, t, dtype=np.float32)
            np.testing.assert_allclose(f(x), np.cumsum(2 * x), rtol=1e-5)
    assert f.stats.compiles == 4 and f.stats.calls == len(SIZES)


def test_warmup_of_chosen_sizes_compiles_only_their_buckets():
    f = _poly_bucketed([])
    assert f.warmup(sizes=[{"T": 10}, {"T": 12}, {"T": 40}]) == [{"T": 16}, {"T": 16}, {"T": 64}]
    assert sorted(f.stats.buckets) == [(("T", 16),), (("T", 64),)]
    assert f.stats.compiles == 2


def test_warmup_with_a_model_argument_then_calls_compile_nothing():
    T = px.LengthVar("T", max=32)
    B = px.LengthVar("B", max=4)
    weight = np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32)
    traced = []

    def project(w, x):  # x: (B, T, 3)
        traced.append(1)
        return x @ w

    f = px.bucketed(project, in_specs=(None, px.Spec("B T 3", jnp.float32)),
                    out_specs=px.Spec("B T 5"), buckets={T: [8, 32], B: [4]})
    f.warmup(weight, progress=False)
    assert f.stats.compiles == 2 and len(traced) == 1
    with px.forbid_compiles():
        x = np.ones((3, 20, 3), np.float32)
        out = f(weight, x)
    np.testing.assert_allclose(out, x @ weight, rtol=1e-5)
    with pytest.raises(px.SpecError, match=r"project.warmup: expected the 1 argument\(s\) without a "
                                           r"Spec \(in_specs positions \[0\]\) or a full example "
                                           r"call of 2 arguments, received 3"):
        f.warmup(weight, weight, weight)


def test_stats_count_real_and_padded_elements():
    T = px.LengthVar("T", max=64)
    B = px.LengthVar("B", max=8)
    f = px.bucketed(lambda x: x + 1, in_specs=(px.Spec("B T", jnp.float32),),
                    out_specs=px.Spec("B T"), buckets={T: [16, 64], B: [4, 8]})
    f(np.ones((3, 10), np.float32))   # bucket B=4 T=16: 30 real of 64
    f(np.ones((4, 16), np.float32))   # same bucket, no padding: 64 of 64
    f(np.ones((5, 40), np.float32))   # bucket B=8 T=64: 200 of 512
    stats = f.stats
    small, large = stats.buckets[(("B", 4), ("T", 16))], stats.buckets[(("B", 8), ("T", 64))]
    assert (small.calls, small.real_elements, small.padded_elements) == (2, 94, 128)
    assert (large.calls, large.real_elements, large.padded_elements) == (1, 200, 512)
    assert stats.padding_efficiency == pytest.approx(294 / 640)
    table = str(stats)
    assert "B=4 T=16" in table and "B=8 T=64" in table and "traces: 1" in table
    assert table.splitlines()[-1].split()[:3] == ["total", "3", "2"]


def test_pad_value_is_visible_only_when_masking_is_off():
    T = px.LengthVar("T", max=16)
    spec = px.Spec("T", jnp.float32, pad=1.5)
    logical = px.bucketed(lambda x: jnp.sum(x), in_specs=(spec,), buckets={T: [16]})
    physical = px.bucketed(lambda x: jnp.sum(x), in_specs=(spec,), buckets={T: [16]},
                           masking=False)
    # 5 real ones + 11 positions of padding at 1.5: only the unmasked program sees the padding.
    assert float(logical(np.ones(5, np.float32))) == 5.0
    assert float(physical(np.ones(5, np.float32))) == pytest.approx(5 + 11 * 1.5)


@pytest.mark.parametrize("masking, shape_seen", [(True, 21), (False, 32)])
def test_valid_length_is_the_real_size_and_shape_follows_masking(masking, shape_seen):
    T = px.LengthVar("T", max=64)

    def lengths_seen(x):
        return px.valid_length(T) + 0 * x.shape[0], jnp.asarray(x.shape[0])

    f = px.bucketed(lengths_seen, in_specs=(px.Spec("T", jnp.float32),), buckets={T: [32, 64]},
                    masking=masking)
    real, shape = f(np.zeros(21, np.float32))
    assert (int(real), int(shape)) == (21, shape_seen)


def test_max_cached_evicts_least_recently_used_bucket():
    traced = []
    f = _poly_bucketed(traced, max_cached=2)
    for t in (5, 12, 20):       # buckets 8, 16, 32: 8 is evicted when 32 arrives
        f(np.ones(t, np.float32))
    assert f.stats.compiles == 3
    f(np.ones(14, np.float32))  # 16 still cached
    assert f.stats.compiles == 3
    f(np.ones(6, np.float32))   # 8 was evicted: compiled again from the same plan
    assert f.stats.compiles == 4 and f.stats.buckets[(("T", 8),)].compiles == 2
    assert len(traced) == 1, "an evicted bucket is recompiled from the plan, not retraced"


def test_pytree_arguments_and_outputs_with_prefix_specs():
    T = px.LengthVar("T", max=32)
    B = px.LengthVar("B", max=4)

    def summarise(batch, scale):
        x, mask = batch["x"], batch["mask"]
        kept = jnp.where(mask, x, 0.0) * scale["factor"]
        return {"kept": kept, "total": jnp.sum(kept, axis=1), "scale": scale["factor"] * 1.0}

    f = px.bucketed(summarise,
                    in_specs=({"x": px.Spec("B T", jnp.float32), "mask": px.Spec("B T", bool)},
                              None),
                    out_specs={"kept": px.Spec("B T"), "total": px.Spec("B"), "scale": None},
                    buckets={T: [8, 32], B: [4]})
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 11)).astype(np.float32)
    mask = rng.random((3, 11)) < 0.5
    factor = np.array(2.0, np.float32)
    out = f({"x": x, "mask": mask}, {"factor": factor})
    assert sorted(out) == ["kept", "scale", "total"]
    assert out["kept"].shape == (3, 11) and out["total"].shape == (3,)
    np.testing.assert_allclose(out["kept"], np.where(mask, x, 0) * 2, rtol=1e-6)
    np.testing.assert_allclose(out["total"], (np.where(mask, x, 0) * 2).sum(1), rtol=1e-5)
    assert float(out["scale"]) == 2.0


class _Scaler(eqx.Module):
    weight: jax.Array
    activation: callable = eqx.field(static=True)

    def __call__(self, x):
        return self.activation(x * self.weight)


def test_equinox_module_arrays_are_traced_and_static_fields_key_the_plan():
    T = px.LengthVar("T", max=16)
    traced = []

    def apply(model, x):
        traced.append(1)
        return model(x)

    f = px.bucketed(apply, in_specs=(None, px.Spec("T", jnp.float32)), out_specs=px.Spec("T"),
                    buckets={T: [16]})
    x = np.linspace(-1, 1, 9, dtype=np.float32)
    a = _Scaler(jnp.float32(2.0), jnp.tanh)
    b = _Scaler(jnp.float32(-3.0), jnp.tanh)
    np.testing.assert_allclose(f(a, x), np.tanh(2 * x), rtol=1e-6)
    # New weights of the same shape: same plan, same executable.
    with px.forbid_compiles():
        np.testing.assert_allclose(f(b, x), np.tanh(-3 * x), rtol=1e-6)
    assert len(traced) == 1 and f.stats.compiles == 1
    # A different static field is a different program: traced (once) and compiled again.
    c = _Scaler(jnp.float32(2.0), jax.nn.relu)
    np.testing.assert_allclose(f(c, x), np.maximum(2 * x, 0), rtol=1e-6)
    assert len(traced) == 2 and f.traces == 2 and f.stats.compiles == 2


def test_static_output_leaves_come_back_as_traced_and_other_objects_are_named():
    """An output leaf that is a function (``eqx.nn.MLP`` holds its activation as a leaf, and a
    train step returns the model) is static, as an argument's is: returned as the trace made
    it, beside the exact arrays. An object that could hide a traced value is refused by path."""
    T = px.LengthVar("T", max=16)
    mlp = eqx.nn.MLP(1, 1, 4, 1, key=jax.random.PRNGKey(0))

    def scale(model, x):
        params, static = eqx.partition(model, eqx.is_array)
        return eqx.combine(jax.tree_util.tree_map(lambda w: w * jnp.sum(x), params), static), x

    f = px.bucketed(scale, in_specs=(None, px.Spec("T", jnp.float32)),
                    out_specs=(None, px.Spec("T")), buckets={T: [16]})
    x = np.linspace(-1, 1, 9, dtype=np.float32) + 0.5
    model, same = f(mlp, x)
    assert model.activation is mlp.activation and same.shape == (9,)
    np.testing.assert_allclose(model.layers[0].weight, mlp.layers[0].weight * x.sum(), rtol=1e-6)
    g = px.bucketed(lambda x: (x, object()), in_specs=(px.Spec("T", jnp.float32),),
                    buckets={T: [16]})
    with pytest.raises(px.PolyexecError, match=r"output out\[1\]: expected an array, a number, "
                                               r"or a static function or string, received object"):
        g(x)


def test_plan_of_a_bucketed_function():
    T = px.LengthVar("T", min=2, max=64)

    def diffs(x):
        return x[1:] - x[:-1]

    f = px.bucketed(diffs, in_specs=(px.Spec("T", jnp.float32),), buckets={T: [8, 64]})
    plan = f.plan  # all arguments have a Spec: traced on demand, nothing compiled
    assert not plan.reshaping_is_impossible and plan.reason is None
    assert f.stats.compiles == 0 and f.traces == 1
    assert [i.shapes for i in plan.shapes(T=5) if i.primitive == "sub"] == [((4,),)]


# -- persistent compile cache -----------------------------------------------------------------

@pytest.fixture
def isolated_compile_cache():
    """Put JAX's persistent-cache settings back afterwards; JAX opens the cache folder once per
    process, so its state is reset too (otherwise later tests would keep writing here)."""
    from jax._src import compilation_cache

    names = ["jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes"]
    saved = {n: getattr(jax.config, n) for n in names}
    compilation_cache.reset_cache()
    yield
    for n, v in saved.items():
        jax.config.update(n, v)
    compilation_cache.reset_cache()


def test_persistent_cache_writes_compiled_buckets_and_reads_them_back(tmp_path,
                                                                      isolated_compile_cache):
    events = []
    listener = lambda event, **kw: events.append(event)  # noqa: E731
    jax.monitoring.register_event_listener(listener)
    try:
        folder = px.enable_persistent_cache(str(tmp_path / "xla"))
        assert folder == str(tmp_path / "xla")
        T = px.LengthVar("T", max=64)

        def make():
            return px.bucketed(lambda x: jnp.sin(x) * 3.0, in_specs=(px.Spec("T", jnp.float32),),
                               out_specs=px.Spec("T"), buckets={T: [16, 64]})

        f = make()
        f(np.ones(10, np.float32))
        written = os.listdir(folder)
        assert len(written) >= 1, "compiling a bucket wrote nothing into the cache folder"
        f(np.ones(40, np.float32))
        assert len(os.listdir(folder)) > len(written), "a second bucket added no cache entry"
        hits_before = events.count("/jax/compilation_cache/cache_hits")
        # A fresh bucketed function (as a new process would have) compiles T=16 from disk.
        g = make()
        np.testing.assert_allclose(g(np.ones(7, np.float32)), np.full(7, 3 * np.sin(1.0)),
                                   rtol=1e-6)
        assert g.stats.compiles == 1
        assert events.count("/jax/compilation_cache/cache_hits") == hits_before + 1
    finally:
        jax.monitoring.unregister_event_listener(listener)
        px.disable_persistent_cache()
    # Disabled: compiling another bucket writes nothing more.
    count = len(os.listdir(folder))
    f(np.ones(3, np.float32) * 2)   # same bucket as before: nothing compiled
    make_new = px.bucketed(lambda x: x * 5.0, in_specs=(px.Spec("T", jnp.float32),),
                           buckets={T: [16, 64]})
    make_new(np.ones(3, np.float32))
    assert len(os.listdir(folder)) == count


def test_a_global_array_not_at_its_bucket_shape_is_refused_before_compiling(monkeypatch):
    """A multi-process array cannot be padded on any one host: the error names the argument.
    (Its real form needs several processes; here every array claims to span them.)"""
    from jax._src.array import ArrayImpl

    T = px.LengthVar("T", max=64)
    f = px.bucketed(lambda x: x * 2, in_specs=(px.Spec("T", jnp.float32),), buckets={T: [8, 64]})
    monkeypatch.setattr(ArrayImpl, "is_fully_addressable", property(lambda self: False))
    with pytest.raises(px.SpecError, match=r"args\[0\]: a global array spanning several "
                                           r"processes, of shape \(5,\), must already have its "
                                           r"bucket's shape \(8,\)"):
        f(jnp.ones(5, jnp.float32))
    assert f.stats.compiles == 0
    assert f(jnp.ones(8, jnp.float32)).shape == (8,)       # at the bucket's shape it runs


def test_with_buckets_shares_the_trace_and_the_compiled_buckets():
    """Re-bucketing retraces nothing and recompiles no bucket both versions have."""
    T = px.LengthVar("T", max=64)
    f = px.bucketed(lambda x: jnp.cumsum(x), in_specs=(px.Spec("T", jnp.float32),),
                    buckets={T: [64]})
    x = np.arange(5, dtype=np.float32)
    np.testing.assert_array_equal(f(x), np.cumsum(x))
    g = f.with_buckets({"T": [8, 64]})
    assert g.bucket_sizes("T") == (8, 64) and f.bucket_sizes("T") == (64,)
    np.testing.assert_array_equal(g(np.arange(40, dtype=np.float32)), np.cumsum(np.arange(40)))
    assert g.traces == f.traces == 1
    assert g.stats.compiles == 1                      # T=64 came from f
    np.testing.assert_array_equal(g(x), np.cumsum(x))
    assert g.stats.compiles == f.stats.compiles == 2  # T=8 is new; the stats are shared
    with pytest.raises(px.SpecError, match=r"with_buckets: buckets: expected keys among the variables the Specs use \(T\), received 'B'"):
        f.with_buckets({"B": [4]})
