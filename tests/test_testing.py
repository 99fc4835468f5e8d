"""`polyexec.testing`: the strategies draw what they promise, and `assert_bucket_transparent`
fails on functions that padding does change (values, output shapes, gradients)."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import find as hypothesis_find, given, settings
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


# -- ragged batches ---------------------------------------------------------------------------

def _ragged_vars():
    return px.LengthVar("B", max=3), px.LengthVar("T", min=1, max=20)


def test_edge_lengths():
    B, T = _ragged_vars()
    assert pxt.edge_lengths(T, [8]) == (0, 1, 2, 7, 8, 9, 19, 20)
    assert pxt.edge_lengths(px.LengthVar("T", min=4, max=9), [6], min_len=4) == (4, 5, 6, 7, 8, 9)
    with pytest.raises(px.OptionError, match=r"min_len: expected 0 <= min_len <= 20, received 21"):
        pxt.edge_lengths(T, min_len=21)


def test_ragged_batches_draw_the_edge_lengths_and_poison_the_padding():
    B, T = _ragged_vars()
    drawn, pads, extra = set(), set(), []

    @settings(max_examples=200)  # pure numpy, cheap: enough to reach every edge
    @given(pxt.ragged_batches(B, T, buckets=[8], feature_shape=(2,)))
    def check(batch):
        x, lengths = batch
        assert x.dtype == np.float32 and lengths.dtype == np.int32 and x.shape[2:] == (2,)
        assert 1 <= x.shape[0] <= 3 and x.shape == (len(lengths), max(1, *lengths), 2)
        for b, n in enumerate(lengths):
            assert (np.abs(x[b, :n]) <= 1).all()
            tail = x[b, n:]
            assert not (np.abs(tail) <= 1).any()
            pads.update(str(v) for v in tail.ravel())
        drawn.update(int(n) for n in lengths)

    check()
    assert {0, 1, 7, 8, 9, 20} <= drawn
    assert {"nan", "inf", "-inf", "3e+38", "-3e+38"} <= pads

    # A batch already padded past its longest row; integer rows padded with the extremes.
    @given(pxt.ragged_batches(2, T, dtype=np.int32, extra_padding=True, min_len=3))
    def padded(batch):
        x, lengths = batch
        assert x.shape[0] == 2 and lengths.min() >= 3 and max(lengths) <= x.shape[1] <= 20
        assert all(set(x[b, n:].ravel()) <= {2**31 - 1, -2**31} for b, n in enumerate(lengths))
        extra.append(x.shape[1] - max(lengths))

    padded()
    assert max(extra) > 0


def test_ragged_batches_find_a_bucket_edge():
    B, T = _ragged_vars()
    found = hypothesis_find(pxt.ragged_batches(B, T, buckets=[8]),
                            lambda batch: 9 in batch.lengths and 0 in batch.lengths)
    assert sorted(found.lengths) == [0, 9]


def _scan_carry(r):
    return jax.lax.scan(lambda h, xt: (jnp.tanh(h * 0.5 + xt), None), jnp.zeros(2), r)[0]


RAGGED_ROWS = {
    "mean": lambda r: jnp.mean(r, 0),
    "softmax": lambda r: jax.nn.softmax(r[:, 0]),
    "last": lambda r: r[-1],
    "flip": lambda r: jnp.flip(r, 0),
    "scan final carry": _scan_carry,
    "attention": lambda r: jax.nn.softmax(r @ r.T, -1) @ r,
}


@pytest.mark.parametrize("name", sorted(RAGGED_ROWS))
def test_assert_ragged_transparent_passes_on_per_row_code(name):
    B, T = _ragged_vars()
    report = pxt.assert_ragged_transparent(RAGGED_ROWS[name], B, T, feature_shape=(2,),
                                           buckets={T: [8]}, max_examples=5)
    assert report.values.traces == 1 and report.values.plan.padding_safe
    assert report.values.stats.compiles == len(report.buckets) <= 4
    if name == "last":  # g raises on an empty row: rows of length 0 are skipped, only those
        assert all(report.lengths[e][b] == 0 for e, b in report.skipped)
    else:
        assert report.skipped == ()


def test_assert_ragged_transparent_checks_gradients_and_pytree_outputs():
    B, T = _ragged_vars()

    def stats(r):  # a pytree output; the gradient is of the sum of every element
        return {"last": r[-1], "mean": jnp.mean(r, 0), "carry": _scan_carry(r)}

    report = pxt.assert_ragged_transparent(stats, B, T, feature_shape=(2,), grad=True,
                                           buckets={T: [8]}, max_examples=4, extra_padding=True)
    assert report.grads.traces == 1
    assert any(s[1] > max(n) for s, n in zip(report.shapes, report.lengths))


def test_assert_ragged_transparent_fails_when_the_padding_is_read():
    B, T = _ragged_vars()
    with pytest.raises(AssertionError, match=r"ragged values: row \d+ \(length \d+, bucket "
                                             r"\{'B': \d+, 'T': \d+\}\) at out: differs from "
                                             r"g\(x\[\d+, :\d+\]\) run alone"):
        pxt.assert_ragged_transparent(lambda r: jnp.mean(r, 0), B, T, feature_shape=(2,),
                                      buckets={T: [8]}, max_examples=5, shrink=False,
                                      masking=False)


def test_assert_ragged_transparent_fails_on_wrong_gradients_and_unsafe_plans():
    B, T = _ragged_vars()
    # Masked by hand (the padding is NaN), the values are right without the rewrite; the
    # gradient is not: d(r_i * r_j)/dr_i = r_j reaches real positions as 0 * nan = nan
    # (`where` zeroes the cotangent, not the other factor).
    def masked_gram(r):
        real = jnp.isfinite(r)
        return jnp.sum(jnp.where(real[:, None] & real[None, :], r[:, None] * r[None, :], 0.0))

    with pytest.raises(AssertionError, match=r"ragged gradients: row \d+ \(length \d+, bucket"):
        pxt.assert_ragged_transparent(masked_gram, B, T, grad=True, padding=st.just(np.nan),
                                      buckets={T: [8]}, max_examples=5, shrink=False,
                                      masking=False)
    # The same function passes when polyexec masks.
    pxt.assert_ragged_transparent(masked_gram, B, T, grad=True, padding=st.just(np.nan),
                                  buckets={T: [8]}, max_examples=3)
    with pytest.warns(UserWarning, match="not padding-safe"), \
            pytest.raises(AssertionError, match=r"the plan is not padding-safe.*tile"):
        pxt.assert_ragged_transparent(lambda r: jnp.tile(r, 2), B, T, buckets={T: [8]},
                                      max_examples=2, shrink=False)
