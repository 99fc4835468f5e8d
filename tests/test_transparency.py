"""Padding never changes a result: for random sizes within bounds, the bucketed function equals
the function run at the exact size — values and gradients — on a masked GRU language model and
on plain array functions."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import polyexec as px
import polyexec.testing as pxt
from conftest import assert_trees_close
from examples.rnn.model import CharLM, loss_fn, masked_loss_fn


def _vars(t_max=32):
    return px.LengthVar("T", min=2, max=t_max), px.LengthVar("B", max=4)


# -- the GRU language model: no mask in the loss, each row its own length ---------------------

def test_gru_loss_value_and_grad_are_bucket_transparent():
    T, B = _vars(32)
    model = CharLM(cell="gru", embed=4, hidden=8, key=jax.random.PRNGKey(0))
    step = jax.value_and_grad(loss_fn)
    f = px.bucketed(step, in_specs=(None, px.Spec("B T", jnp.int32),
                                    px.Spec("B", jnp.int32, lengths_of="T")),
                    buckets={T: [8, 16, 32], B: [4]})
    exact = jax.jit(jax.value_and_grad(masked_loss_fn))   # no mask bucketed; by hand exact
    seen_buckets = set()

    # Every example compiles the exact-size reference (1-3 s for a scan with its gradient on
    # 2 cores), so the examples are few; the bucketed side compiles at most three buckets.
    @settings(max_examples=6)
    @given(size=pxt.size_dicts(B, T), data=st.data())
    def check(size, data):
        b, t = size["B"], size["T"]
        tokens = data.draw(pxt.arrays(px.Spec("B T", jnp.int32), size,
                                      elements=st.integers(0, 255)), label="tokens")
        lengths = data.draw(pxt.lengths(b, t), label="lengths")
        loss, grads = f(model, tokens, lengths)
        ref_loss, ref_grads = exact(model, tokens, lengths)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert_trees_close(grads, ref_grads, rtol=1e-4, atol=1e-6)
        seen_buckets.add(f.bucket_for("T", t))

    check()
    assert f.traces == 1, "the GRU was traced more than once"
    assert len(seen_buckets) >= 2, f"only bucket(s) {seen_buckets} exercised"
    assert f.stats.compiles == len(f.stats.buckets) <= 3


def test_lstm_loss_gradients_through_assert_bucket_transparent():
    T, B = _vars(24)
    model = CharLM(cell="lstm", embed=4, hidden=8, key=jax.random.PRNGKey(1))
    report = pxt.assert_bucket_transparent(
        masked_loss_fn, (None, px.Spec("B T", jnp.int32), px.Spec("B", jnp.int32, lengths_of="T")),
        fixed_args=(model,), grad_argnums=0, elements={1: st.integers(0, 255)},
        buckets={T: [8, 24], B: [4]}, max_examples=3, rtol=1e-4, atol=1e-6)
    assert report.values.traces == 1 and report.grads.traces == 1
    assert len(report.sizes) == 3


# -- plain array functions --------------------------------------------------------------------

def _time_mask(x, axis=1):
    return px.arange_like(x, axis) < px.valid_length("T")


def mean_over_time(x):  # (B, T) -> (B,)
    return jnp.sum(jnp.where(_time_mask(x), x, 0.0), axis=1) / px.valid_length("T")


def mean_over_time_loss(x):
    return jnp.sum(mean_over_time(x) ** 2)


def running_sum(x):  # (B, T) -> (B, T)
    return jnp.cumsum(x, axis=1)


def running_sum_loss(x, lengths):
    mask = px.sequence_mask(lengths, x, axis=1)
    return jnp.sum(jnp.where(mask, jnp.cumsum(x, axis=1) ** 2, 0.0))


def differences(x):  # (B, T) -> (B, T): 0, then x[t] - x[t-1]
    d = x[:, 1:] - x[:, :-1]
    return jnp.concatenate([jnp.zeros_like(x[:, :1]), d], axis=1)


def differences_loss(x):
    d = x[:, 1:] - x[:, :-1]                     # (B, T - 1): T >= 2 makes this trace
    mask = px.arange_like(d, 1) < px.valid_length("T") - 1
    return jnp.sum(jnp.where(mask, d ** 2, 0.0))


def project(x, w):  # (B, T, 3) @ (3, 4)
    return jnp.einsum("btd,de->bte", x, w)


def project_loss(x, w, lengths):
    h = jnp.tanh(project(x, w))
    mask = px.sequence_mask(lengths, h[..., 0], axis=1)[..., None]
    return jnp.sum(jnp.where(mask, h ** 2, 0.0))


def summaries(x, lengths):  # a pytree of outputs, two of them sliced back by out_specs
    last = jnp.take_along_axis(x, jnp.maximum(lengths - 1, 0)[:, None], axis=1)[:, 0]
    return {"scaled": x * 2.0, "last": last, "count": jnp.sum(lengths)}


X = px.Spec("B T", jnp.float32)
LENGTHS = px.Spec("B", jnp.int32, lengths_of="T")
W = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(3, 4)
TOL = dict(rtol=1e-4, atol=1e-5)
# Each example compiles the exact-size reference: a dozen examples per function keeps this file
# to a minute on 2 cores while still drawing sizes across all three T buckets.
EXAMPLES = 12


def _check(fn, in_specs, **kw):
    T, B = _vars(32)
    report = pxt.assert_bucket_transparent(fn, in_specs, buckets={"T": [8, 16, 32], "B": [4]},
                                           max_examples=EXAMPLES, **TOL, **kw)
    assert report.values.traces == 1
    assert len({report.values.bucket_for("T", s["T"]) for s in report.sizes}) >= 2
    return report


def test_masked_mean_via_valid_length():
    _check(mean_over_time, (X,), out_specs=px.Spec("B"))
    _check(mean_over_time_loss, (X,), grad_argnums=0)


def test_cumsum():
    _check(running_sum, (X,), out_specs=px.Spec("B T"))
    _check(running_sum_loss, (X, LENGTHS), grad_argnums=0)


def test_differences_of_shifted_slices():
    _check(differences, (X,), out_specs=px.Spec("B T"))
    _check(differences_loss, (X,), grad_argnums=0)


def test_matmul_with_a_fixed_weight():
    x3 = px.Spec("B T 3", jnp.float32)
    _check(project, (x3, None), fixed_args=(W,), out_specs=px.Spec("B T 4"))
    # Gradients with respect to the Spec'd input (sliced back) and the fixed weight (whole).
    report = _check(project_loss, (x3, None, LENGTHS), fixed_args=(W,), grad_argnums=(0, 1))
    assert report.grads.traces == 1


def test_outputs_sliced_by_out_specs():
    report = _check(summaries, (X, LENGTHS),
                    out_specs={"scaled": px.Spec("B T"), "last": px.Spec("B"), "count": None})
    assert report.values.stats.compiles == len(report.values.stats.buckets)


def test_bucketed_output_really_is_padded_inside():
    """The transparency above is not vacuous: the program runs at the bucket's shape, and the
    logical rewrite is what makes ``x.shape`` answer the real sizes."""
    T, B = _vars(32)
    shape_of = lambda x: jnp.asarray(x.shape)  # noqa: E731
    physical = px.bucketed(shape_of, in_specs=(X,), buckets={T: [8, 16, 32], B: [4]},
                           masking=False)
    logical = px.bucketed(shape_of, in_specs=(X,), buckets={T: [8, 16, 32], B: [4]})
    assert physical(np.ones((3, 9), np.float32)).tolist() == [4, 16]
    assert logical(np.ones((3, 9), np.float32)).tolist() == [3, 9]
    assert set(logical.stats.buckets) == {(("B", 4), ("T", 16))}
