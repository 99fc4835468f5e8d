"""Typed PRNG keys (``jax.random.key(0)``, dtype ``key<fry>``) in arguments without a Spec --
alone, split into a batch, or a field of a model, as Flax NNX layers keep them -- are carried
through to the function unpadded, giving what plain ``jax.jit`` gives; a plan holding one saves
and loads. (A key given for a Spec is refused: tests/test_bad_input.py.)"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polyexec as px

X = np.arange(5, dtype=np.float32)


def _noisy(key, x):
    return x * jax.random.uniform(key, ()), jax.random.split(key)[0]


class _Noisy(eqx.Module):
    scale: jax.Array
    key: jax.Array      # a typed key, as a Flax NNX layer keeps its Rngs

    def __call__(self, x):
        keys = jax.random.split(self.key, 3)
        return self.scale * x * jnp.sum(jax.vmap(lambda k: jax.random.normal(k, ()))(keys))


def _bucketed(fn):
    T = px.LengthVar("T", max=16)
    return px.bucketed(fn, in_specs=(None, px.Spec("T", jnp.float32)), buckets={T: [16]})


def test_typed_keys_without_a_spec_are_carried_through_as_jax_jit_gives_them():
    f = _bucketed(_noisy)
    for key in (jax.random.key(0), jax.random.key(3)):
        got, new_key = f(key, X)
        want, want_key = jax.jit(_noisy)(key, X)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert new_key.dtype == key.dtype
        np.testing.assert_array_equal(jax.random.key_data(new_key), jax.random.key_data(want_key))
    assert f.traces == 1 and f.stats.compiles == 1
    # Another impl is another signature: traced for its own key type, never read as threefry's.
    rbg = jax.random.key(0, impl="rbg")
    np.testing.assert_allclose(f(rbg, X)[0], jax.jit(_noisy)(rbg, X)[0], rtol=1e-6)
    assert f.traces == 2

    model = _Noisy(jnp.float32(2.0), jax.random.key(1))
    g = _bucketed(lambda m, x: m(x))
    np.testing.assert_allclose(g(model, X), jax.jit(lambda m, x: m(x))(model, X), rtol=1e-6)
    g.warmup(model)
    assert g.traces == 1 and g.stats.compiles == 1


def test_a_plan_with_a_typed_key_saves_and_loads(tmp_path):
    key = jax.random.key(7)
    want = jax.jit(_noisy)(key, X)[0]
    # px.trace stores the key with the plan (as its uint32 data): the loaded plan needs no key.
    T = px.LengthVar("T", max=16)
    px.trace(_noisy, key, px.Spec((T,), jnp.float32)).save(tmp_path / "stored.plan")
    stored = px.bucketed(px.Plan.load(tmp_path / "stored.plan"))
    np.testing.assert_allclose(stored(X)[0], want, rtol=1e-6)
    # Saved without it, the plan takes the key (or its data) first.
    f = _bucketed(_noisy)
    f(key, X)
    f.plan.save(tmp_path / "taking.plan")
    taking = px.bucketed(px.Plan.load(tmp_path / "taking.plan"))
    np.testing.assert_allclose(taking(key, X)[0], want, rtol=1e-6)
    np.testing.assert_allclose(taking(jax.random.key_data(key), X)[0], want, rtol=1e-6)
    with pytest.raises(px.SpecError) as info:
        taking(jax.random.key(7, impl="rbg"), X)
    assert str(info.value) == ("args[0]: expected uint32[2], received uint32[4] (the data of a "
                               "typed PRNG key, impl rbg)")
