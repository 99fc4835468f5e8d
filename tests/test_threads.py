"""Concurrent calls: every bucket compiles exactly once (single-flight), results stay correct."""

import threading
import warnings

import jax.numpy as jnp
import numpy as np

import polyexec as px
from polyexec._recover import CONCRETE_TRACES

THREADS, CALLS = 8, 50
# Sizes spread over the four buckets 8, 16, 32, 64.
SIZES = [1, 5, 8, 9, 12, 16, 17, 25, 32, 33, 50, 64]


def _hammer(f, expected_fn, make_input):
    """Run THREADS threads x CALLS calls, all released at once; return the errors raised."""
    barrier = threading.Barrier(THREADS)
    errors, checked = [], []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            barrier.wait()
            for i in range(CALLS):
                t = SIZES[(seed + i) % len(SIZES)]
                x = make_input(rng, t)
                np.testing.assert_allclose(f(x), expected_fn(x), rtol=1e-5, atol=1e-5)
                checked.append(t)
        except BaseException as e:  # noqa: BLE001 - collected and re-raised by the test
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return errors, checked


def test_eight_threads_compile_each_bucket_exactly_once():
    T = px.LengthVar("T", max=64)
    B = px.LengthVar("B", max=4)
    traced = []

    def scaled_cumsum(x):  # x: (B, T)
        traced.append(1)
        return jnp.cumsum(x, axis=1) * 0.5

    f = px.bucketed(scaled_cumsum, in_specs=(px.Spec("B T", jnp.float32),),
                    out_specs=px.Spec("B T"), buckets={T: [8, 16, 32, 64], B: [4]})
    errors, checked = _hammer(
        f, lambda x: np.cumsum(x, axis=1) * 0.5,
        lambda rng, t: rng.normal(size=(int(rng.integers(1, 5)), t)).astype(np.float32))
    assert not errors, errors[:3]
    assert len(checked) == THREADS * CALLS
    assert f.stats.compiles == 4
    assert sorted(k for k in f.stats.buckets) == [(("B", 4), ("T", s)) for s in (8, 16, 32, 64)]
    assert all(b.compiles == 1 for b in f.stats.buckets.values())
    assert f.stats.calls == THREADS * CALLS
    assert len(traced) == 1 and f.traces == 1


def test_threads_on_the_slow_path_compile_each_bucket_once():
    T = px.LengthVar("T", max=64)

    def prefix_sums(x):  # not polymorphic: unrolled over a Python range
        return jnp.stack([jnp.sum(x[: t + 1]) for t in range(x.shape[0])])

    f = px.bucketed(prefix_sums, in_specs=(px.Spec("T", jnp.float32),), out_specs=px.Spec("T"),
                    buckets={T: [8, 16, 32, 64]})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        errors, checked = _hammer(f, np.cumsum,
                                  lambda rng, t: rng.normal(size=t).astype(np.float32))
    assert not errors, errors[:3]
    assert len(checked) == THREADS * CALLS
    assert f.stats.compiles == 4
    # The symbolic attempt, the concrete traces that find its structure differs with the
    # size (`_recover`), then one trace per bucket.
    assert f.traces == 1 + CONCRETE_TRACES + 4
    assert len([w for w in caught if "not shape-polymorphic" in str(w.message)]) == 1


def test_warmup_racing_with_calls_compiles_each_bucket_once():
    T = px.LengthVar("T", max=64)
    f = px.bucketed(lambda x: jnp.tanh(x), in_specs=(px.Spec("T", jnp.float32),),
                    out_specs=px.Spec("T"), buckets={T: [8, 16, 32, 64]})
    warm = threading.Thread(target=f.warmup, kwargs={"max_workers": 4})
    warm.start()
    errors, checked = _hammer(f, np.tanh, lambda rng, t: rng.normal(size=t).astype(np.float32))
    warm.join()
    assert not errors, errors[:3]
    assert f.stats.compiles == 4 and f.traces == 1
