"""`polyexec.testing`: the strategies draw what they promise, and `assert_bucket_transparent`
fails on functions that padding does change (values, output shapes, gradients)."""

import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import polyexec as px
import polyexec.testing as pxt


def _vars():
    return px.LengthVar("T", min=2, max=40), px.LengthVar("B", max=4)


def test_importing_polyexec_does_not_import_hypothesis():
    code = ("import sys, polyexec; "
            "print('hypothesis' in sys.modules, 'polyexec.testing' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]


def test_sizes_stay_within_bounds_and_reach_both_ends():
    T, _ = _vars()
    drawn = []

    # Boundary values are likely but not guaranteed in a handful of examples: draw plenty
    # (pure Python, cheap) so the profile's small CI count does not make this flaky.
    @settings(max_examples=200)
    @given(pxt.sizes(T))
    def check(t):
        assert T.min <= t <= T.max
        drawn.append(t)

    check()
    assert min(drawn) == 2 and max(drawn) == 40


def test_sizes_narrowed_and_rejected():
    T, _ = _vars()

    @given(pxt.sizes("T", min=5, max=9))
    def check(t):
        assert 5 <= t <= 9

    check()
    with pytest.raises(px.OptionError, match=r"sizes\(LengthVar\('T', min=2, max=40\)\): expected "
                                             r"2 <= min <= max <= 40, received min=1, max=40"):
        pxt.sizes(T, min=1)
    with pytest.raises(px.SpecError, match="Spec name 'Nope': expected a LengthVar named 'Nope'"):
        pxt.sizes("Nope")


def test_size_dicts_and_arrays_match_the_spec():
    T, B = _vars()
    specs = [px.Spec("B T 3", jnp.float32), px.Spec("T", jnp.int32), px.Spec("B T", bool),
             px.Spec("B T"), px.Spec("B", jnp.int32, lengths_of="T")]

    @given(st.data())
    def check(data):
        size = data.draw(pxt.size_dicts(B, T))
        assert sorted(size) == ["B", "T"]
        x, ids, mask, plain, lengths = (data.draw(pxt.arrays(s, size)) for s in specs)
        assert x.shape == (size["B"], size["T"], 3) and x.dtype == np.float32
        assert np.all(np.abs(x) <= 1)
        assert ids.shape == (size["T"],) and ids.dtype == np.int32 and ids.min() >= 0
        assert mask.dtype == np.bool_ and mask.shape == (size["B"], size["T"])
        assert plain.dtype == np.float32
        assert lengths.shape == (size["B"],)
        assert lengths.min() >= 0 and lengths.max() <= size["T"]

    check()


def test_arrays_with_custom_elements_and_missing_sizes():
    T, _ = _vars()

    @given(pxt.arrays(px.Spec("T", jnp.int32), {"T": 6}, elements=st.integers(250, 255)))
    def check(tokens):
        assert tokens.shape == (6,) and 250 <= tokens.min() and tokens.max() <= 255

    check()
    with pytest.raises(px.OptionError, match=r"sizes: expected an entry for B, received \{'T': 6\}"):
        pxt.arrays(px.Spec("B T"), {"T": 6})


def test_lengths():
    @given(pxt.lengths(3, 7, min_len=2))
    def check(n):
        assert n.shape == (3,) and n.dtype == np.int32 and n.min() >= 2 and n.max() <= 7

    check()
    with pytest.raises(px.OptionError, match="expected 0 <= min_len <= max_len, received min_len=5, max_len=4"):
        pxt.lengths(2, 4, min_len=5)


# -- assert_bucket_transparent must be able to fail ---------------------------------------------

def unmasked_mean(x):  # averages the padding in, unless polyexec masks: masking=False
    return jnp.mean(x, axis=1)


def test_detects_a_function_that_padding_changes():
    T, B = _vars()
    with pytest.raises(AssertionError, match=r"bucketed values at sizes \{.*\} \(bucket \{.*\}\) "
                                             r"differ at out"):
        pxt.assert_bucket_transparent(unmasked_mean, (px.Spec("B T", jnp.float32),),
                                      out_specs=px.Spec("B"), buckets={"T": [16, 40]},
                                      max_examples=10, shrink=False, masking=False)


def test_detects_an_output_left_padded():
    T, B = _vars()
    # An out_specs that names only the batch axis leaves T at the bucket's size.
    with pytest.raises(AssertionError, match=r"out has shape \(\d+, 16\), the exact-size run "
                                             r"gives \(\d+, \d+\) \(its out_specs"):
        pxt.assert_bucket_transparent(lambda x: x * 2, (px.Spec("B T", jnp.float32),),
                                      out_specs=px.Spec("B"), buckets={"T": [16, 40], "B": [4]},
                                      max_examples=10, shrink=False)


def sqrt_loss(x, w):
    # Values are transparent (masked), gradients are not: d sqrt(x * w)/dw at a padded x = 0 is
    # 0 * inf = nan, and `where` does not stop a nan in the unselected branch's gradient.
    mask = px.arange_like(x) < px.valid_length("T")
    return jnp.sum(jnp.where(mask, jnp.sqrt(x * w), 0.0))


def test_detects_gradients_that_padding_changes_when_values_do_not():
    T, B = _vars()
    specs = (px.Spec("T", jnp.float32), None)
    positive = {0: st.floats(0.125, 1.0, width=32)}
    w = np.float32(2.0)
    # Values alone pass...
    pxt.assert_bucket_transparent(sqrt_loss, specs, fixed_args=(w,), elements=positive,
                                  buckets={"T": [16, 40]}, max_examples=8, masking=False)
    # ...the gradient with respect to w does not.
    with pytest.raises(AssertionError, match=r"bucketed gradients at sizes .* differ at out"):
        pxt.assert_bucket_transparent(sqrt_loss, specs, fixed_args=(w,), elements=positive,
                                      grad_argnums=1, buckets={"T": [16, 40]}, max_examples=8,
                                      shrink=False, masking=False)


def test_the_same_functions_pass_when_polyexec_masks():
    T, B = _vars()
    pxt.assert_bucket_transparent(unmasked_mean, (px.Spec("B T", jnp.float32),),
                                  out_specs=px.Spec("B"), buckets={"T": [16, 40]},
                                  max_examples=6)
    pxt.assert_bucket_transparent(sqrt_loss, (px.Spec("T", jnp.float32), None),
                                  fixed_args=(np.float32(2.0),),
                                  elements={0: st.floats(0.125, 1.0, width=32)},
                                  grad_argnums=1, buckets={"T": [16, 40]}, max_examples=6)


def test_reference_answers_valid_length_and_max_length_with_the_exact_size():
    T, _ = _vars()

    def normalised_position(x):  # x: (T,)
        return px.arange_like(x).astype(jnp.float32) / px.valid_length(T)

    report = pxt.assert_bucket_transparent(normalised_position, (px.Spec("T", jnp.float32),),
                                           out_specs=px.Spec("T"), buckets={T: [16, 40]},
                                           max_examples=6)
    assert report.values.stats.compiles <= 2 and report.values.traces == 1
    assert all(2 <= s["T"] <= 40 for s in report.sizes)

    def prefix_sums(x):  # not polymorphic, but transparent: the extra rows are sliced off
        return jnp.stack([jnp.sum(x[: i + 1]) for i in range(px.max_length(T))])

    with pytest.warns(UserWarning, match="prefix_sums is not shape-polymorphic"):
        report = pxt.assert_bucket_transparent(prefix_sums, (px.Spec("T", jnp.float32),),
                                               out_specs=px.Spec("T"), buckets={T: [16, 40]},
                                               max_examples=4)
    assert report.values.plan.reshaping_is_impossible


def test_argument_checks():
    T, B = _vars()
    with pytest.raises(px.OptionError, match=r"fixed_args: expected 1 values \(in_specs is None at "
                                             r"positions \[1\]\), received 0"):
        pxt.assert_bucket_transparent(lambda x, w: x * w, (px.Spec("T"), None))
    with pytest.raises(px.OptionError, match=r"elements: expected positions of arguments with a Spec, "
                                             r"received \[1\]"):
        pxt.assert_bucket_transparent(lambda x, w: x * w, (px.Spec("T"), None), fixed_args=(1.0,),
                                      elements={1: st.floats()})
