"""Every bad input fails before anything is traced or compiled, with a message that names the
argument path, the axis, and what was expected vs received."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polyexec as px
from examples.rnn.model import CharLM, loss_fn

F32 = "Spec('B T', float32, pad=0)"


def _masked_total(x, lengths):
    return jnp.sum(jnp.where(px.sequence_mask(lengths, x, axis=1), x, 0.0))


def _make():
    T = px.LengthVar("T", min=2, max=64)
    B = px.LengthVar("B", max=4)
    return px.bucketed(_masked_total,
                       in_specs=(px.Spec("B T", jnp.float32),
                                 px.Spec("B", jnp.int32, lengths_of="T")),
                       buckets={T: [16, 64], B: [4]})


def ones(shape, dtype=np.float32):
    return np.ones(shape, dtype)


CASES = [
    ("wrong rank", (ones(5), ones(1, np.int32)), px.SpecError,
     f"args[0]: expected rank 2 for {F32}, received rank 1 (shape (5,))"),
    ("wrong dtype", (ones((2, 5), np.int32), ones(2, np.int32)), px.SpecError,
     f"args[0].dtype: expected float32 for {F32}, received int32"),
    ("float lengths", (ones((2, 5)), ones(2, np.float32)), px.SpecError,
     "args[1].dtype: expected int32 for Spec('B', int32, pad=0), received float32"),
    ("inputs disagree on B", (ones((2, 5)), ones(3, np.int32)), px.SpecError,
     "args[1].shape[0] = 3 disagrees with args[0].shape[0] = 2: both are length variable 'B'"),
    ("T above max", (ones((2, 65)), ones(2, np.int32)), px.LengthOverflowError,
     "args[0].shape[1] = 65 is above T's max=64 (LengthVar('T', min=2, max=64))"),
    ("B above max", (ones((5, 8)), ones(5, np.int32)), px.LengthOverflowError,
     "args[0].shape[0] = 5 is above B's max=4 (LengthVar('B', min=1, max=4))"),
    ("T below min", (ones((2, 1)), ones(2, np.int32)), px.SpecError,
     "args[0].shape[1] = 1 is below T's min=2 (LengthVar('T', min=2, max=64))"),
    ("negative length", (ones((3, 5)), np.array([1, 4, -2], np.int32)), px.SpecError,
     "args[1][2] = -2: lengths of 'T' must be >= 0"),
    ("length above T", (ones((2, 5)), np.array([3, 6], np.int32)), px.SpecError,
     "args[1][1] = 6: lengths of 'T' must be <= args[0].shape[1] = 5"),
    # Checked as given: a cast to int32 first would read 2**32 + 3 as 3.
    ("length beyond int32", (ones((2, 5)), np.array([2**32 + 3, 2], np.int64)), px.SpecError,
     "args[1][0] = 4294967299: lengths of 'T' must be <= args[0].shape[1] = 5"),
    ("Spec'd argument None", (None, ones(2, np.int32)), px.SpecError,
     f"args[0]: expected an array for {F32}, received NoneType None"),
    ("too few arguments", (ones((2, 5)),), px.SpecError,
     "expected 2 positional arguments (one per in_specs entry), received 1"),
    ("too many arguments", (ones((2, 5)), ones(2, np.int32), 3), px.SpecError,
     "expected 2 positional arguments (one per in_specs entry), received 3"),
]


@pytest.mark.parametrize("args, error, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_before_anything_compiles(args, error, message):
    f = _make()
    with px.forbid_compiles():
        with pytest.raises(error) as info:
            f(*args)
    assert str(info.value) == message
    assert type(info.value) is error
    assert f.stats.compiles == 0 and f.traces == 0 and f.stats.calls == 0
    # The function is not poisoned: a good call afterwards compiles its one bucket.
    assert float(f(ones((2, 5)), np.array([5, 2], np.int32))) == 7.0
    assert f.stats.compiles == 1


def test_error_hierarchy():
    assert issubclass(px.LengthOverflowError, px.SpecError)
    assert issubclass(px.SpecError, px.PolyexecError) and issubclass(px.SpecError, ValueError)
    for cls in (px.PolymorphismError, px.CompileError):
        assert issubclass(cls, px.PolyexecError)


def test_model_argument_path_names_the_token_axis():
    T = px.LengthVar("T", min=2, max=32)
    B = px.LengthVar("B", max=4)
    model = CharLM(cell="gru", embed=4, hidden=8, key=jax.random.PRNGKey(0))
    f = px.bucketed(loss_fn, in_specs=(None, px.Spec("B T", jnp.int32),
                                       px.Spec("B", jnp.int32, lengths_of="T")),
                    buckets={T: [32], B: [4]})
    tokens = np.zeros((2, 33), np.int32)
    with px.forbid_compiles(), pytest.raises(px.LengthOverflowError) as info:
        f(model, tokens, np.array([33, 3], np.int32))
    assert str(info.value) == ("args[1].shape[1] = 33 is above T's max=32 "
                               "(LengthVar('T', min=2, max=32))")
    with pytest.raises(px.SpecError) as info:
        f(model, tokens[:, :10], np.array([10, 11], np.int32))
    assert str(info.value) == "args[2][1] = 11: lengths of 'T' must be <= args[1].shape[1] = 10"
    assert f.stats.compiles == 0 and f.traces == 0


def test_pytree_argument_paths_and_fixed_axes():
    T = px.LengthVar("T", max=16)
    B = px.LengthVar("B", max=4)
    f = px.bucketed(lambda batch: batch["x"] * batch["w"][None],
                    in_specs=({"x": px.Spec("B T 3", jnp.float32),
                               "w": px.Spec("T 3", jnp.float32)},))
    with px.forbid_compiles():
        with pytest.raises(px.SpecError) as info:
            f({"x": ones((2, 5, 4)), "w": ones((5, 3))})
        assert str(info.value) == ("args[0]['x'].shape[2]: expected 3 for Spec('B T 3', float32, "
                                   "pad=0), received 4")
        with pytest.raises(px.SpecError) as info:
            f({"x": ones((2, 5, 3)), "w": ones((6, 3))})
        assert str(info.value) == ("args[0]['x'].shape[1] = 5 disagrees with args[0]['w'].shape[0] "
                                   "= 6: both are length variable 'T'")
        with pytest.raises(px.SpecError, match=r"^in_specs does not match the structure of the "
                                               r"values: "):
            f({"x": ones((2, 5, 3))})
    assert f.stats.compiles == 0 and f.traces == 0


def test_unhashable_static_leaf_is_rejected():
    T = px.LengthVar("T", max=16)
    f = px.bucketed(lambda opts, x: x, in_specs=(None, px.Spec("T", jnp.float32)))
    with pytest.raises(px.SpecError) as info:
        f({"flags": {1, 2}}, ones(3))
    assert str(info.value) == ("args[0]['flags']: a non-array leaf of an argument without a Spec "
                               "is static and must be hashable; received an unhashable set")


def test_non_array_input_is_rejected():
    T = px.LengthVar("T", max=16)
    f = px.bucketed(lambda x: x, in_specs=(px.Spec("T"),))
    with pytest.raises(px.SpecError) as info:
        f(object())
    assert str(info.value) == ("args[0]: expected an array, received object that NumPy can only "
                               "hold as dtype=object")


# -- errors when declaring ---------------------------------------------------------------------

def test_spec_naming_an_unknown_variable():
    T = px.LengthVar("T", max=16)
    with pytest.raises(px.SpecError) as info:
        px.bucketed(lambda x: x, in_specs=(px.Spec("T Unknown_Q", jnp.float32),))
    assert str(info.value).startswith("bucketed(<lambda>): Spec name 'Unknown_Q': expected a "
                                      "LengthVar named 'Unknown_Q' given to this call")
    assert "Unknown_Q = px.LengthVar('Unknown_Q', max=...); received none (known: T)" in str(info.value)
    with pytest.raises(px.SpecError, match="^bucketed.<lambda>.: Spec name 'Unknown_R'"):
        px.bucketed(lambda x, n: x, in_specs=(px.Spec("T"), px.Spec("T", lengths_of="Unknown_R")))


def test_buckets_naming_a_variable_no_spec_uses():
    T = px.LengthVar("T", max=16)
    B = px.LengthVar("B", max=4)
    with pytest.raises(px.SpecError) as info:
        px.bucketed(lambda x: x, in_specs=(px.Spec("T"),), buckets={"B": [2, 4]}, name="f")
    assert str(info.value) == ("bucketed(f): buckets: expected keys among the variables the Specs "
                               "use (T), received 'B'")


@pytest.mark.parametrize("policy", ["64", 5, [8, "x"], [0.5]], ids=repr)
def test_bucket_sizes_must_be_ints(policy):
    T = px.LengthVar("T", max=64)
    with pytest.raises(px.SpecError) as info:
        px.bucketed(lambda x: x, in_specs=(px.Spec("T"),), buckets={T: policy})
    assert str(info.value) == (f"buckets for 'T': expected a bucket policy (with .sizes) or a "
                               f"list of ints, received {policy!r}")


def test_in_specs_must_be_a_tuple():
    T = px.LengthVar("T", max=16)
    with pytest.raises(px.SpecError, match=r"^bucketed\(<lambda>\): in_specs: expected a tuple with "
                                           r"one entry per positional argument"):
        px.bucketed(lambda x: x, px.Spec("T"))


@pytest.mark.parametrize("make, message", [
    (lambda: px.LengthVar("T", min=0, max=8), "LengthVar('T'): min: expected >= 1, received 0"),
    (lambda: px.LengthVar("T", min=9, max=8), "LengthVar('T'): max: expected >= min=9, received 8"),
    (lambda: px.LengthVar("T", max=8.5), "LengthVar('T'): max: expected an int, received 8.5"),
    (lambda: px.LengthVar("2T", max=8), "LengthVar: name: expected an identifier, received '2T'"),
    (lambda: px.Spec("B T-1"),
     "Spec dims 'B T-1': expected length-variable names, LengthVars or ints, received 'T-1'"),
    (lambda: px.LengthVar("T", max=2**31),
     "LengthVar('T'): max: expected an int <= 2147483647 (sizes run as int32), received 2147483648"),
    (lambda: px.Spec("T", "floaty"),
     "Spec('T'): dtype: expected a numeric or bool dtype such as jnp.float32, jnp.int32 or "
     "'bfloat16', received 'floaty'"),
], ids=["min", "max<min", "float max", "name", "dims", "max beyond int32", "dtype"])
def test_declaration_errors(make, message):
    with pytest.raises(px.SpecError) as info:
        make()
    assert str(info.value) == message


def test_plan_shapes_rejects_wrong_sizes():
    T = px.LengthVar("T", min=2, max=64)
    plan = px.trace(lambda x: jnp.cumsum(x), px.Spec("T", jnp.float32))
    with pytest.raises(px.SpecError) as info:
        plan.shapes(T=65)
    assert str(info.value) == "T=65 is outside [2, 64] (LengthVar('T', min=2, max=64))"
    with pytest.raises(px.SpecError) as info:
        plan.shapes(T=5, B=2)
    assert str(info.value) == ("<lambda>: shapes() needs exactly the sizes of T; unknown: ['B'], "
                               "missing: []")
