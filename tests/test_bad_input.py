"""Bad input found by probing the public API: each is refused before anything traces or
compiles, as a PolyexecError subclass whose message names the argument, what was expected and
what came -- or, where legal but surprising, warned about. Never silently filtered or wrapped."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polyexec as px

T = px.LengthVar("T", max=64)
B = px.LengthVar("B", max=8)


def _masked_total(x, lengths):
    return jnp.sum(jnp.where(px.sequence_mask(lengths, x, axis=1), x, 0.0))


def _ragged():
    return px.bucketed(_masked_total,
                       in_specs=(px.Spec((B, T), jnp.float32),
                                 px.Spec((B,), jnp.int32, lengths_of=T)),
                       buckets={T: [8, 64], B: [8]})


def _single():
    return px.bucketed(lambda x: x * 2, in_specs=(px.Spec((T,), jnp.float32),),
                       buckets={T: [8, 64]}, name="double")


def _refused(call, error, message):
    """``call()`` raises exactly ``error`` with exactly ``message``, compiling nothing."""
    with px.forbid_compiles():
        with pytest.raises(error) as info:
            call()
    assert type(info.value) is error and isinstance(info.value, px.PolyexecError)
    assert str(info.value) == message


X = np.ones((2, 5), np.float32)
KEYS = jax.random.split(jax.random.key(0), 2)     # made here: refusing them compiles nothing

# -- lengths that do not fit int32: checked as given, never after a wrapping cast ---------------

LENGTHS = [
    ("int64 above 2**32", np.array([2**32 + 3, 2], np.int64),
     "args[1][0] = 4294967299: lengths of 'T' must be <= args[0].shape[1] = 5"),
    ("int64 below -2**32", np.array([-(2**32) + 5, 2], np.int64),
     "args[1][0] = -4294967291: lengths of 'T' must be >= 0"),
    ("uint32 max", np.array([2, 2**32 - 1], np.uint32),
     "args[1][1] = 4294967295: lengths of 'T' must be <= args[0].shape[1] = 5"),
    ("python list above 2**32", [2, 2**33],
     "args[1][1] = 8589934592: lengths of 'T' must be <= args[0].shape[1] = 5"),
]


@pytest.mark.parametrize("lengths, message", [c[1:] for c in LENGTHS], ids=[c[0] for c in LENGTHS])
def test_lengths_beyond_int32_are_refused_not_wrapped(lengths, message):
    f = _ragged()
    _refused(lambda: f(X, lengths), px.SpecError, message)
    assert f.traces == 0 and f.stats.calls == 0
    # Valid int64 lengths still run (cast to int32 after the check).
    assert float(f(X, np.array([5, 2], np.int64))) == 7.0


def test_lengths_of_must_be_integers_even_without_a_spec_dtype():
    f = px.bucketed(_masked_total, in_specs=(px.Spec((B, T), jnp.float32),
                                             px.Spec((B,), lengths_of=T)))
    _refused(lambda: f(X, np.array([2.5, 1.0])), px.SpecError,
             "args[1].dtype: expected an integer dtype for the lengths of 'T' (Spec('B', "
             "pad=0)), received float64")


def test_narrowing_integer_inputs_must_fit_the_dtype_they_run_at():
    f = px.bucketed(lambda x: x + 1, in_specs=(px.Spec((T,), jnp.int32),), buckets={T: [8]})
    _refused(lambda: f(np.array([1, 2**40, 3], np.int64)), px.SpecError,
             "args[0][1] = 1099511627776: expected values that fit int32 (the dtype it runs at, "
             "in [-2147483648, 2147483647]), received 1099511627776 (int64)")
    assert f(np.array([1, -2, 3], np.int64)).tolist() == [2, -1, 4]


# -- arguments that are not arrays -----------------------------------------------------------

NOT_ARRAYS = [
    ("None for a Spec'd array", lambda f: f(None, np.array([1, 2], np.int32)),
     "args[0]: expected an array for Spec('B T', float32, pad=0), received NoneType None"),
    ("None for the lengths", lambda f: f(X, None),
     "args[1]: expected an array for Spec('B', int32, pad=0), received NoneType None"),
    ("empty tuple", lambda f: f((), np.array([1, 2], np.int32)),
     "args[0]: expected an array for Spec('B T', float32, pad=0), received tuple ()"),
    ("a list of strings", lambda f: f([["a", "b"]], np.array([1], np.int32)),
     "args[0]: expected an array of numbers or bools, received list of dtype <U1"),
    ("a typed PRNG key", lambda f: f(X, KEYS),
     "args[1]: expected an array of numbers or bools, received a typed PRNG key array (dtype "
     "key<fry>, shape (2,)): a key has no length axis to pad (give it None in in_specs: it is "
     "then passed through as it is)"),
]


@pytest.mark.parametrize("call, message", [c[1:] for c in NOT_ARRAYS], ids=[c[0] for c in NOT_ARRAYS])
def test_non_arrays_for_spec_arguments(call, message):
    f = _ragged()
    _refused(lambda: call(f), px.SpecError, message)
    assert f.traces == 0


# -- called under a JAX transformation: the arguments are tracers ------------------------------

TRACERS = [
    ("jit, a Spec'd argument", lambda f, m, x, rows: jax.jit(lambda x: f(m, x))(x),
     "args[1]", "float32[5]"),
    ("grad, a Spec'd argument", lambda f, m, x, rows: jax.grad(lambda x: f(m, x).sum())(x),
     "args[1]", "float32[5]"),
    ("vmap over rows", lambda f, m, x, rows: jax.vmap(lambda r: f(m, r))(rows),
     "args[1]", "float32[5]"),
    ("jit, the model", lambda f, m, x, rows: jax.jit(lambda m: f(m, x))(m),
     "args[0]['w']", "float32[]"),
    ("grad, the model", lambda f, m, x, rows: jax.grad(lambda m: f(m, x).sum())(m),
     "args[0]['w']", "float32[]"),
]


@pytest.mark.parametrize("call, path, aval", [c[1:] for c in TRACERS], ids=[c[0] for c in TRACERS])
def test_tracers_are_refused_naming_the_argument(call, path, aval):
    f = px.bucketed(lambda m, x: m["w"] * x, in_specs=(None, px.Spec((T,), jnp.float32)),
                    buckets={T: [8]})
    model = {"w": jnp.asarray(np.float32(2.0))}
    x, rows = jnp.asarray(np.ones(5, np.float32)), jnp.asarray(np.ones((2, 5), np.float32))
    _refused(lambda: call(f, model, x, rows), px.SpecError,
             f"{path}: expected a concrete array, received a JAX tracer ({aval}): the bucketed "
             f"function was called inside jax.jit, jax.grad, jax.vmap or another "
             f"transformation. It reads sizes on the host and runs its own program compiled per "
             f"bucket, which takes no tracers: call it outside the transformation, or transform "
             f"the function it wraps instead (px.bucketed(jax.grad(loss), ...))")
    assert f.traces == 0
    assert f(model, x).tolist() == [2.0] * 5      # outside any transformation it runs


# -- declarations: LengthVar, Spec -----------------------------------------------------------

DECLARATIONS = [
    ("max beyond int32", lambda: px.LengthVar("T", max=2**31 + 5), px.SpecError,
     "LengthVar('T'): max: expected an int <= 2147483647 (sizes run as int32), received 2147483653"),
    ("unknown dtype name", lambda: px.Spec("T", "floaty"), px.SpecError,
     "Spec('T'): dtype: expected a numeric or bool dtype such as jnp.float32, jnp.int32 or "
     "'bfloat16', received 'floaty'"),
    ("object dtype", lambda: px.Spec("T", object), px.SpecError,
     "Spec('T'): dtype: expected a numeric or bool dtype such as jnp.float32, jnp.int32 or "
     "'bfloat16', received <class 'object'> (object)"),
    ("string dtype", lambda: px.Spec("T", np.str_), px.SpecError,
     "Spec('T'): dtype: expected a numeric or bool dtype such as jnp.float32, jnp.int32 or "
     "'bfloat16', received <class 'numpy.str_'> (str)"),
    ("dims an int", lambda: px.Spec(5), px.SpecError,
     "Spec: dims: expected a string of length-variable names and ints (\"B T 64\") or a "
     "sequence of LengthVars, names and ints, received int 5"),
    ("dims None", lambda: px.Spec(None), px.SpecError,
     "Spec: dims: expected a string of length-variable names and ints (\"B T 64\") or a "
     "sequence of LengthVars, names and ints, received NoneType None"),
    ("pad None", lambda: px.Spec("T", pad=None), px.SpecError,
     "Spec('T'): pad: expected a number or bool (the value padding is filled with), received "
     "NoneType None"),
    ("pad a list", lambda: px.Spec("T", pad=[0]), px.SpecError,
     "Spec('T'): pad: expected a number or bool (the value padding is filled with), received "
     "list [0]"),
    ("lengths_of an int", lambda: px.Spec("B", lengths_of=3), px.SpecError,
     "Spec('B'): lengths_of: expected a LengthVar or a length-variable name, received 3"),
]


@pytest.mark.parametrize("make, error, message", [c[1:] for c in DECLARATIONS],
                         ids=[c[0] for c in DECLARATIONS])
def test_bad_declarations(make, error, message):
    _refused(make, error, message)


def test_good_declarations_are_unchanged():
    assert px.LengthVar("T", max=2**31 - 1).max == 2**31 - 1
    assert px.Spec("T", jnp.bfloat16).dtype == jnp.bfloat16
    assert px.Spec("T", bool, pad=False).dtype == np.bool_
    assert px.Spec("T", "int8", pad=np.int8(-1)).pad == -1
    assert px.Spec((T, "4"), jnp.float32, pad=float("-inf")).dims == ("T", 4)
    assert px.Spec("B", lengths_of=T).lengths_of == "T"


# -- bucket sizes ------------------------------------------------------------------------------

BUCKETS = [
    ("non-positive sizes", [-4, 0, 64],
     "buckets for 'T': expected sizes >= 1, received -4, 0 in [-4, 0, 64]"),
    ("empty list", [], "buckets for 'T': expected at least one bucket size (or None for the "
                       "default powers of two), received []"),
    ("empty tuple", (), "buckets for 'T': expected at least one bucket size (or None for the "
                        "default powers of two), received ()"),
]


@pytest.mark.parametrize("sizes, message", [c[1:] for c in BUCKETS], ids=[c[0] for c in BUCKETS])
def test_bad_bucket_sizes_are_refused(sizes, message):
    _refused(lambda: px.bucketed(lambda x: x, in_specs=(px.Spec((T,), jnp.float32),),
                                 buckets={T: sizes}), px.SpecError, message)
    # The same through the LengthVar's own default policy.
    V = px.LengthVar("T", max=64, buckets=sizes)
    _refused(lambda: px.bucketed(lambda x: x, in_specs=(px.Spec((V,), jnp.float32),)),
             px.SpecError, message)


def test_bucket_sizes_outside_the_bounds_warn_once_and_are_not_compiled():
    U = px.LengthVar("U", min=4, max=64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = px.bucketed(lambda x: x, in_specs=(px.Spec((U,), jnp.float32),),
                        buckets={U: [1, 2, 16, 64, 128, 256]})
    assert [str(w.message) for w in caught] == [
        "buckets for 'U': sizes 1, 2 below min=4 and 128, 256 above max=64 of "
        "LengthVar('U', min=4, max=64) are not compiled: no input can have them (drop them, or "
        "change the LengthVar's bounds)"]
    assert caught[0].category is UserWarning and caught[0].filename == __file__
    assert f.bucket_sizes("U") == (16, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # sizes within the bounds: not a word
        assert px.bucketed(lambda x: x, in_specs=(px.Spec((U,), jnp.float32),),
                           buckets={U: [4, 16, 64]}).bucket_sizes("U") == (4, 16, 64)


# -- warmup ------------------------------------------------------------------------------------

WARMUP = [
    ("size below min", _single, dict(sizes=[{"T": 0}]), px.SpecError,
     "double.warmup: sizes[0]['T']: expected a size in [1, 64] (LengthVar('T', min=1, max=64)), "
     "received 0"),
    ("size above max", _single, dict(sizes=[{"T": 8}, {T: 65}]), px.LengthOverflowError,
     "double.warmup: sizes[1]['T']: expected a size in [1, 64] (LengthVar('T', min=1, max=64)), "
     "received 65"),
    ("size not an int", _single, dict(sizes=[{"T": 8.0}]), px.OptionError,
     "double.warmup: sizes[0]['T']: expected an int size, received float 8.0"),
    ("unknown variable", _single, dict(sizes=[{"Q": 3}]), px.OptionError,
     "double.warmup: sizes[0]: expected keys among this function's length variables (T), "
     "received 'Q'"),
    ("another LengthVar of the same name", _single,
     dict(sizes=[{px.LengthVar("T", max=32): 8}]), px.OptionError,
     "double.warmup: sizes[0]: LengthVar('T', min=1, max=32) is not this function's "
     "LengthVar('T', min=1, max=64)"),
    ("an input variable missing", _ragged, dict(sizes=[{"T": 16}]), px.OptionError,
     "_masked_total.warmup: sizes[0]: expected a size for every variable the inputs bind "
     "(B, T), missing 'B' in {'T': 16}"),
    ("one dict, not a list", _single, dict(sizes={"T": 16}), px.OptionError,
     "double.warmup: sizes: expected a list of {name: size} dicts, one per bucket (e.g. "
     "sizes=[{'T': 16}]), received a single dict {'T': 16}"),
    ("a list of ints", _single, dict(sizes=[16]), px.OptionError,
     "double.warmup: sizes[0]: expected a {name: size} dict over the variables (T), received "
     "int 16"),
    ("a string", _single, dict(sizes="T=16"), px.OptionError,
     "double.warmup: sizes: expected a list of {name: size} dicts, one per bucket, received "
     "str 'T=16'"),
    ("negative max_workers", _single, dict(max_workers=-1), px.OptionError,
     "double.warmup: max_workers: expected an int >= 1 or None (one thread per bucket, up to "
     "the CPU count), received -1"),
    ("zero max_workers", _single, dict(max_workers=0), px.OptionError,
     "double.warmup: max_workers: expected an int >= 1 or None (one thread per bucket, up to "
     "the CPU count), received 0"),
]


@pytest.mark.parametrize("make, kwargs, error, message", [c[1:] for c in WARMUP],
                         ids=[c[0] for c in WARMUP])
def test_bad_warmup_options(make, kwargs, error, message):
    f = make()
    _refused(lambda: f.warmup(**kwargs), error, message)
    assert f.traces == 0 and f.stats.compiles == 0


def test_good_warmup_sizes_are_unchanged():
    f = _single()
    assert f.warmup(sizes=[{T: 3}, {"T": np.int64(64)}], max_workers=1) == [{"T": 8}, {"T": 64}]
    assert f.stats.compiles == 2


# -- data-dependent ops and bucketed itself ----------------------------------------------------

OPS = [
    ("compact x None", lambda: px.compact(None, np.ones(3, bool)), px.SpecError,
     "compact: x: expected an array (or a nested list of numbers or bools), received NoneType None"),
    ("compact mask None", lambda: px.compact(np.ones(3), None), px.SpecError,
     "compact: mask: expected an array (or a nested list of numbers or bools), received "
     "NoneType None"),
    ("compact x strings", lambda: px.compact(["a", "b"], np.ones(2, bool)), px.SpecError,
     "compact: x: expected an array (or a nested list of numbers or bools), received list "
     "['a', 'b']"),
    ("nonzero None", lambda: px.nonzero(None), px.SpecError,
     "nonzero: mask: expected an array (or a nested list of numbers or bools), received "
     "NoneType None"),
    ("nonzero ragged", lambda: px.nonzero([[True], [True, False]]), px.SpecError,
     "nonzero: mask: expected an array (or a nested list of numbers or bools), received list "
     "[[True], [True, False]]"),
    ("loop_until step not callable", lambda: px.loop_until(5, 0, max_steps=3), px.OptionError,
     "loop_until: step: expected a callable (i, carry) -> (carry, item, stop), received int 5"),
    ("bucketed fn not callable", lambda: px.bucketed(5, in_specs=(None,)), px.OptionError,
     "bucketed: fn: expected a callable or a px.Plan, received int 5"),
    ("bucketed fn a string", lambda: px.bucketed("f", in_specs=(None,)), px.OptionError,
     "bucketed: fn: expected a callable or a px.Plan, received str 'f'"),
    ("trace fn not callable", lambda: px.trace(5, px.Spec("T", jnp.float32)), px.OptionError,
     "trace: fn: expected a callable, received int 5"),
    ("bucketed variables None", lambda: _with_variables(None), px.OptionError,
     "bucketed(double): variables: expected a sequence of px.LengthVar (e.g. variables=[T]), "
     "received NoneType None"),
    ("bucketed variables one LengthVar", lambda: _with_variables(T), px.OptionError,
     "bucketed(double): variables: expected a sequence of px.LengthVar (e.g. variables=[T]), "
     "received a single LengthVar LengthVar('T', min=1, max=64)"),
    ("bucketed variables a string", lambda: _with_variables("T"), px.OptionError,
     "bucketed(double): variables: expected a sequence of px.LengthVar (e.g. variables=[T]), "
     "received str 'T'"),
    ("bucketed variables holding a name", lambda: _with_variables([T, "B"]), px.OptionError,
     "bucketed(double): variables[1]: expected a px.LengthVar, received str 'B'"),
    ("trace variables None",
     lambda: px.trace(lambda x: x, px.Spec((T,), jnp.float32), variables=None), px.OptionError,
     "trace(<lambda>): variables: expected a sequence of px.LengthVar (e.g. variables=[T]), "
     "received NoneType None"),
]


def _with_variables(variables):
    return px.bucketed(lambda x: x, in_specs=(px.Spec((T,), jnp.float32),), name="double",
                       variables=variables)


@pytest.mark.parametrize("call, error, message", [c[1:] for c in OPS], ids=[c[0] for c in OPS])
def test_bad_arguments_to_ops(call, error, message):
    _refused(call, error, message)


def test_ops_still_take_lists_and_scalars():
    values, count = px.compact([1.0, 2.0, 3.0], [True, False, True])
    assert values.tolist() == [1.0, 3.0, 0.0] and int(count) == 2
    indices, count = px.nonzero([False, True])
    assert indices.tolist() == [1, -1] and int(count) == 1
