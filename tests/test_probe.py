"""Undecidable size comparisons are found without touching JAX: only the user's count."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.export import shape_poly

import polyexec as px

T = px.LengthVar("T", max=128)


def vmapped_mean(x):
    return jax.vmap(lambda r: jnp.tanh(r * 2.0))(x).mean(0)


def histogram_of(x):
    return jnp.histogram(x[:, 0], bins=4, range=(-1.0, 1.0))[0]


@pytest.mark.parametrize("fn", [vmapped_mean, histogram_of], ids=lambda f: f.__name__)
def test_jax_cache_keys_holding_sizes_never_make_a_verdict(fn):
    # jit at concrete sizes first: JAX's caches then hold keys with those sizes, which the
    # symbolic trace compares with T (a dataclass __eq__, file "<string>", inside JAX).
    for t in (7, 31, 100):
        jax.jit(fn)(np.zeros((t, 4), np.float32))
    x = np.random.default_rng(0).uniform(-1, 1, (7, 4)).astype(np.float32)
    for _ in range(50):
        plan = px.trace(fn, px.Spec("T 4", jnp.float32), check_sizes=False)
        assert not plan.reshaping_is_impossible, plan.reason
    g = px.bucketed(fn, in_specs=(px.Spec("T 4", jnp.float32),), buckets={T: [8, 32, 128]},
                    strict=True)
    np.testing.assert_allclose(g(x), fn(x), rtol=1e-5, atol=1e-6)


def test_tracing_replaces_no_method_of_jax():
    seen = {}

    def f(x):
        seen.update({name: getattr(shape_poly._DimExpr, name) for name in ("__eq__", "__ne__")})
        return x * 2

    px.trace(f, px.Spec("T", jnp.float32), check_sizes=False)
    assert seen["__eq__"] is shape_poly._DimExpr.__dict__["__eq__"]
    assert seen["__ne__"] is shape_poly._DimExpr.__dict__["__ne__"]


def branches_on_64(x):
    if x.shape[0] == 64:
        return x * 0
    return x + 1


def plain(x):
    return jnp.cumsum(x) * 2


def test_two_threads_tracing_at_once_keep_their_own_verdicts():
    results, errors = {}, []
    barrier = threading.Barrier(2)

    def run(fn, key):
        try:
            barrier.wait()
            for i in range(10):
                results[key, i] = px.trace(fn, px.Spec("T", jnp.float32), check_sizes=False)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn, fn.__name__)) for fn in (branches_on_64, plain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(10):
        flagged = results["branches_on_64", i]
        assert flagged.reshaping_is_impossible and "`T == 64` cannot be decided" in flagged.reason
        assert "test_probe.py" in flagged.reason and "if x.shape[0] == 64" in flagged.reason
        assert not results["plain", i].reshaping_is_impossible


def test_an_undecidable_comparison_splits_buckets_at_its_constant():
    with pytest.warns(UserWarning, match="cannot be decided"):
        f = px.bucketed(branches_on_64, in_specs=(px.Spec("T", jnp.float32),),
                        out_specs=px.Spec("T"), buckets={T: [32, 128]})
        for t in (63, 64, 65):
            np.testing.assert_array_equal(f(np.ones(t, np.float32)),
                                          branches_on_64(np.ones(t, np.float32)))
    assert {63, 64} <= set(f.bucket_sizes("T", f.plan))
