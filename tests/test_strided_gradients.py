"""Strided convolutions and poolings with their gradients, w.r.t. the input and the kernel.

JAX's transpose of a strided convolution (and ``jax.vmap`` of one whose padding is SAME)
hands ``lax.conv_general_dilated`` a padding that depends on the length (``T - 2 *
floordiv(T - 1, 2)``); while polyexec traces, the primitive takes it as given
(`polyexec._forms.conv_padding`), and the convolution's logical rule (an input-dilated
operand placed at its logical low padding) makes it exact. Each idiom runs through
``px.bucketed`` unragged padded, ragged padded and packed, its padding NaN, against
``jax.jit`` on each example alone at its exact length. Packed rows run these padded, the
user's line named: a strided result is shorter than its sequence by more than a constant, so a
sequence starting mid-row has no room for its outputs at its own column.
(`tests/test_strided.py` covers strided slices and the stride-1 forms.)
"""

import threading
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from jax import export, lax

import polyexec as px

F = 4
MAX = 16
_rng = np.random.default_rng(51)


def _normal(*shape):
    return jnp.asarray(_rng.normal(size=shape).astype(np.float32) * 0.5)


def conv1(r, k, stride, padding, dilation=1):
    """A 1-D convolution of one example ``r`` (T, F) with ``k`` (taps, F, out)."""
    return lax.conv_general_dilated(r[None], k, (stride,), padding, rhs_dilation=(dilation,),
                                    dimension_numbers=("NWC", "WIO", "NWC"))[0]


def conv2(r, k, strides, padding):
    """A 2-D convolution over a (T, F) spectrogram, one channel in: ``k`` (kt, kf, 1, out)."""
    return lax.conv_general_dilated(r[None, :, :, None], k, strides, padding,
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))[0]


_classifier = (eqx.nn.Conv1d(F, 3, 3, stride=2, padding="SAME", key=jax.random.key(1)),
               eqx.nn.Linear(3, 2, key=jax.random.key(2)))


def classify(params, r):
    """A strided CNN classifier: equinox's Conv1d (SAME, stride 2), ReLU, mean over time."""
    conv, head = params
    return head(jnp.mean(jax.nn.relu(conv(r.T)), axis=1))


# name: (params, g(params, r)), each g on one example (T, F)
IDIOMS = {
    "1-D, stride 2, SAME": (_normal(3, F, 3), lambda k, r: conv1(r, k, 2, "SAME")),
    "1-D, stride 3, SAME": (_normal(3, F, 3), lambda k, r: conv1(r, k, 3, "SAME")),
    "1-D, stride 2, VALID": (_normal(3, F, 3), lambda k, r: conv1(r, k, 2, "VALID")),
    "1-D, stride 3, VALID": (_normal(2, F, 3), lambda k, r: conv1(r, k, 3, "VALID")),
    "1-D, stride 2, (2, 0), dilated": (_normal(2, F, 3),
                                       lambda k, r: conv1(r, k, 2, [(2, 0)], dilation=2)),
    "2-D, strides (2, 2), SAME": (_normal(3, 2, 1, 2), lambda k, r: conv2(r, k, (2, 2), "SAME")),
    "2-D, strides (3, 1), VALID": (_normal(2, 2, 1, 2),
                                   lambda k, r: conv2(r, k, (3, 1), "VALID")),
    "eqx Conv1d(stride=2) classifier": (_classifier, classify),
    "eqx MaxPool1d(3, 2, padding=1)": (
        _normal(F), lambda k, r: eqx.nn.MaxPool1d(3, 2, padding=1)((r * k).T).T),
    "eqx AvgPool1d(2, 2)": (_normal(F), lambda k, r: eqx.nn.AvgPool1d(2, 2)((r * k).T).T),
}


def loss_of(g):
    return lambda params, r: jnp.sum(jnp.sin(g(params, r)))


T = px.LengthVar("T", min=1, max=MAX)
B = px.LengthVar("B", max=4)
_made = {}


def bucketed(name, layout):
    """One bucketed function per idiom and layout (hypothesis calls each test many times)."""
    key = (name, layout)
    if key not in _made:
        loss = loss_of(IDIOMS[name][1])
        if layout == "unragged":
            f = px.bucketed(jax.value_and_grad(loss, argnums=(0, 1)),
                            in_specs=(None, px.Spec("T 4", jnp.float32)),
                            buckets={T: [MAX]}, strict=True)
        else:
            def total(params, x):
                return jnp.sum(jax.vmap(lambda r: loss(params, r))(x))

            f = px.bucketed(lambda params, x, lengths: jax.value_and_grad(total, (0, 1))(params, x),
                            in_specs=(None, px.Spec("B T 4", jnp.float32),
                                      px.Spec("B", jnp.int32, lengths_of="T")),
                            buckets={T: [MAX], B: [4]}, layout=layout,
                            strict=layout == "pad")
        _made[key] = f
    return _made[key]


_alone = {}


def alone(name, r):
    """``jax.jit`` of the value and both gradients on one example at its exact length."""
    if name not in _alone:
        _alone[name] = jax.jit(jax.value_and_grad(loss_of(IDIOMS[name][1]), argnums=(0, 1)))
    return _alone[name](IDIOMS[name][0], jnp.asarray(r))


def examples(lengths):
    return [_rng.normal(size=(n, F)).astype(np.float32) for n in lengths]


def close(have, want, what):
    for h, w in zip(jax.tree.leaves(have), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(h), np.asarray(w), rtol=2e-4, atol=2e-4,
                                   err_msg=what)


def call(f, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = f(*args)
    return got, [str(w.message) for w in caught]


# Lengths of multiples of neither stride, of one, of both, a single cell, the bucket's size
# (few of them: each is one compile of every idiom alone).
length = st.sampled_from([1, 2, 3, 4, 5, 6, 7, 9, MAX])
lengths_1 = length
ragged = st.lists(length, min_size=1, max_size=4)
_settings = settings(max_examples=3, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", list(IDIOMS))
@_settings
@given(n=lengths_1)
@example(n=1)
@example(n=7)
def test_one_example_padded_with_nan(name, n):
    """Unragged (``Spec("T 4")``), strict: one trace, NaN padding, value and both gradients
    as ``jax.jit`` on the example alone."""
    f = bucketed(name, "unragged")
    (r,) = examples([n])
    padded = np.concatenate([r, np.full((0, F), np.nan, np.float32)])
    (value, grads), warned = call(f, IDIOMS[name][0], padded)
    want_value, want_grads = alone(name, r)
    close(value, want_value, f"{name}: value at T={n}")
    assert np.shape(grads[1]) == (n, F)
    close(grads, want_grads, f"{name}: gradients at T={n}")
    assert warned == [] and f.traces == 1
    assert not f.plan.reshaping_is_impossible and f.plan.padding_safe


def _ragged_batch(xs):
    x = np.full((len(xs), max(len(r) for r in xs), F), np.nan, np.float32)
    for b, r in enumerate(xs):
        x[b, :len(r)] = r
    return x


def _check_ragged(name, layout, lengths):
    f = bucketed(name, layout)
    xs = examples(lengths)
    params = IDIOMS[name][0]
    (value, (grad_params, grad_x)), warned = call(
        f, params, _ragged_batch(xs), np.asarray(lengths, np.int32))
    wants = [alone(name, r) for r in xs]
    close(value, sum(float(v) for v, _ in wants), f"{name}: value, lengths {lengths}")
    close(grad_params, jax.tree.map(lambda *g: sum(g), *(g[0] for _, g in wants)),
          f"{name}: kernel gradient, lengths {lengths}")
    for b, (r, (_, (_, want))) in enumerate(zip(xs, wants)):
        close(np.asarray(grad_x)[b, :len(r)], want, f"{name}: input gradient, row {b}")
        assert np.all(np.asarray(grad_x)[b, len(r):] == 0)
    assert f.traces == 1 and not f.plan.reshaping_is_impossible and f.plan.padding_safe
    return f, warned


@pytest.mark.parametrize("name", list(IDIOMS))
@settings(_settings, max_examples=2)
@given(lengths=ragged)
@example(lengths=[1, 16, 5, 6])
def test_ragged_rows_padded_with_nan(name, lengths):
    """T ragged along B (``lengths_of="T"``), strict: each row as alone."""
    _, warned = _check_ragged(name, "pad", lengths)
    assert warned == []


# Packed rows run these padded (one compile more each): the 1-D and 2-D forms, the classifier
# and a pooling.
PACKED = ["1-D, stride 2, SAME", "1-D, stride 3, VALID", "2-D, strides (2, 2), SAME",
          "eqx Conv1d(stride=2) classifier", "eqx MaxPool1d(3, 2, padding=1)"]


@pytest.mark.parametrize("name", PACKED)
@settings(phases=[Phase.explicit], deadline=None)
@given(lengths=ragged)
@example(lengths=[1, 16, 5, 6])
def test_packed_rows_run_padded_naming_the_line(name, lengths):
    """``layout="pack"``: exact, never silent -- a strided result has no room at each
    sequence's own column, so the plan says it cannot pack, naming the user's line in this
    file, warns once, and runs padded."""
    f, warned = _check_ragged(name, "pack", lengths)
    assert not f.plan.can_pack
    assert "test_strided_gradients.py" in f.plan.packing_reason
    assert "shorter than its sequence by more than a constant" in f.plan.packing_reason
    assert len(warned) <= 1 and all("cannot run packed rows" in w for w in warned)


def test_a_ceil_mode_pooling_branches_on_the_length_and_says_so():
    """equinox's ``use_ceil=True`` asks in Python whether ``(T - k) % stride == 0`` (a branch
    on the length, not an operation JAX refuses): reshaping-impossible, naming the line, with
    one warning; each bucket is traced at its size. Not silent; `fit` refuses it."""
    pool = eqx.nn.MaxPool1d(2, 2, use_ceil=True)
    f = px.bucketed(jax.grad(lambda r: jnp.sum(jnp.sin(pool(r.T)))),
                    in_specs=(px.Spec("T 4", jnp.float32),), buckets={T: [MAX]})
    _, warned = call(f, np.ones((5, F), np.float32))
    assert f.plan.reshaping_is_impossible and len(warned) == 1
    assert "test_strided_gradients.py" in f.plan.reason and "mod(T - 2, 2)" in f.plan.reason
    with pytest.raises(px.PolymorphismError):
        px.bucketed(lambda r: pool(r.T), in_specs=(px.Spec("T 4", jnp.float32),),
                    buckets={T: [MAX]}, strict=True)(np.ones((5, F), np.float32))


def _jax_alone_refuses():
    """JAX's own behaviour: the gradient of a strided convolution over a symbolic length."""
    (t,) = export.symbolic_shape("T")
    k = IDIOMS["1-D, stride 2, SAME"][0]
    with pytest.raises(ValueError, match="padding argument to conv_general_dilated"):
        jax.make_jaxpr(jax.grad(lambda r: jnp.sum(conv1(r, k, 2, "SAME"))))(
            jax.ShapeDtypeStruct((t, F), jnp.float32))


def test_jax_is_unchanged_outside_polyexecs_trace_and_in_other_threads():
    """The replacement acts only while polyexec traces, in that thread: a trace of JAX's own
    (another thread, meanwhile) still refuses, and concrete sizes run JAX's function."""
    assert getattr(lax.conv_general_dilated, "__wrapped__", None) is not None
    _jax_alone_refuses()
    r, k = jnp.asarray(examples([7])[0]), IDIOMS["1-D, stride 3, SAME"][0]
    np.testing.assert_array_equal(conv1(r, k, 3, "SAME"),
                                  lax.conv_general_dilated.__wrapped__(
                                      r[None], k, (3,), "SAME",
                                      dimension_numbers=("NWC", "WIO", "NWC"))[0])
    inside, outside = threading.Event(), threading.Event()
    seen = []

    def other():
        inside.wait(30)
        try:
            _jax_alone_refuses()
            seen.append("refused")
        except BaseException as e:   # noqa: BLE001 - reported below
            seen.append(repr(e))
        outside.set()

    def g(r):
        inside.set()            # polyexec is tracing this thread now
        outside.wait(30)
        return jnp.sum(jnp.sin(conv1(r, IDIOMS["1-D, stride 2, SAME"][0], 2, "SAME")))

    thread = threading.Thread(target=other)
    thread.start()
    plan = px.trace(jax.grad(g), px.Spec("T 4", jnp.float32), variables=(T,), check_sizes=False)
    thread.join()
    assert seen == ["refused"]
    assert not plan.reshaping_is_impossible
