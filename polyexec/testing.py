"""Property tests for your own bucketed functions: hypothesis strategies and a transparency check.

Bucketing must be invisible: ``px.bucketed(f)(x)`` pads ``x`` up to a bucket, runs the bucket's
program and slices the result back, and that has to equal ``f(x)`` run at the exact size — for
values and for gradients. `assert_bucket_transparent` property-tests exactly that over random
sizes within each `LengthVar`'s bounds; the strategies it is built from are public so that your
own tests can draw sizes, spec-shaped arrays and per-example lengths. For ragged batches (a
``lengths_of`` input), `ragged_batches` draws rows at the lengths where padding bugs live with
padding that poisons whatever reads it, and `assert_ragged_transparent` checks that per-row code
gives each row exactly what it gives that row alone.

This module needs ``hypothesis`` (the ``test`` extra); ``import polyexec`` alone never imports it.

>>> import jax.numpy as jnp, numpy as np, polyexec as px
>>> from polyexec import testing as pxt
>>> T = px.LengthVar("T", min=1, max=12)
>>> def mean_over_time(x):                        # x: (T,), padded with zeros
...     return jnp.sum(x) / px.valid_length(T)    # divide by the real length, not the padded one
>>> report = pxt.assert_bucket_transparent(mean_over_time, (px.Spec("T", jnp.float32),),
...                                        max_examples=4)
>>> report.values.traces                           # one Python trace, however many sizes
1
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

try:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from hypothesis.extra import numpy as hnp
except ImportError as e:  # the runtime does not need hypothesis; only this module does
    raise ImportError("polyexec.testing needs hypothesis: pip install 'polyexec[test]' "
                      "(or pip install hypothesis)") from e

from ._context import binding
from ._executor import Bucketed, bucketed
from ._layouts import clear_ragged_tails
from ._errors import OptionError
from ._spec import LengthVar, Spec, bucket_sizes, resolve_vars

__all__ = ["sizes", "size_dicts", "arrays", "lengths", "assert_bucket_transparent",
           "TransparencyReport", "RaggedBatch", "edge_lengths", "ragged_batches", "assert_ragged_transparent",
           "RaggedTransparencyReport"]


def _var(var: LengthVar | str) -> LengthVar:
    if isinstance(var, LengthVar):
        return var
    return resolve_vars([var], (), "polyexec.testing")[var]


def sizes(var: LengthVar | str, *, min: int | None = None, max: int | None = None):
    """Sizes of ``var``: ints within its bounds ``[var.min, var.max]`` (narrowed by min/max).

    >>> import polyexec as px
    >>> from hypothesis import given
    >>> from polyexec.testing import sizes
    >>> T = px.LengthVar("T", min=2, max=40)
    >>> @given(sizes(T))
    ... def check(t):
    ...     assert 2 <= t <= 40
    >>> check()
    """
    var = _var(var)
    lo = var.min if min is None else min
    hi = var.max if max is None else max
    if not var.min <= lo <= hi <= var.max:
        raise OptionError(f"sizes({var}): expected {var.min} <= min <= max <= {var.max}, "
                          f"received min={lo}, max={hi}")
    return st.integers(lo, hi)


def size_dicts(*variables: LengthVar | str):
    """``{name: size}`` dicts, one size per variable, each within its bounds.

    >>> import polyexec as px
    >>> from hypothesis import given
    >>> from polyexec.testing import size_dicts
    >>> T = px.LengthVar("T", min=2, max=40)
    >>> B = px.LengthVar("B", max=4)
    >>> @given(size_dicts(B, T))
    ... def check(s):
    ...     assert sorted(s) == ["B", "T"] and 1 <= s["B"] <= 4 and 2 <= s["T"] <= 40
    >>> check()
    """
    return st.fixed_dictionaries({_var(v).name: sizes(v) for v in variables})


def _default_elements(dtype: np.dtype):
    # Small magnitudes keep float comparisons meaningful at the default tolerances (a sum of a
    # few hundred values in [-1, 1] differs by ~1e-5 between two summation orders); integers are
    # non-negative so that integer inputs work as token ids or indices.
    if dtype.kind == "f":
        return st.floats(-1, 1, width=8 * dtype.itemsize if dtype.itemsize in (2, 4, 8) else 64)
    if dtype.kind in "iu":
        return st.integers(0, 127)
    if dtype.kind == "b":
        return st.booleans()
    if dtype.kind == "c":
        return st.complex_numbers(max_magnitude=1, width=8 * dtype.itemsize)
    raise OptionError(f"arrays: expected a dtype with default elements (bool, int, float, "
                      f"complex) or elements=..., received {dtype}")


def _shape(spec: Spec, size_of: Mapping[str, int]) -> tuple[int, ...]:
    missing = [d for d in spec.var_names if d not in size_of]
    if missing:
        raise OptionError(f"arrays({spec}): sizes: expected an entry for "
                          f"{', '.join(missing)}, received {dict(size_of)}")
    return tuple(size_of[d] if isinstance(d, str) else d for d in spec.dims)


def arrays(spec: Spec, sizes: Mapping[str, int], *, elements=None):
    """NumPy arrays matching ``spec`` at the given sizes (dtype: the spec's, else float32).

    Elements default to floats in [-1, 1], integers in [0, 127], booleans; a ``lengths_of=T``
    spec gets lengths in ``[0, sizes[T]]``. Combine with `size_dicts` to draw sizes first:

    >>> import jax.numpy as jnp, polyexec as px
    >>> from hypothesis import given
    >>> from polyexec.testing import arrays, size_dicts
    >>> T = px.LengthVar("T", min=2, max=40)
    >>> B = px.LengthVar("B", max=4)
    >>> spec = px.Spec("B T 3", jnp.float32)
    >>> @given(size_dicts(B, T).flatmap(lambda s: arrays(spec, s).map(lambda x: (s, x))))
    ... def check(case):
    ...     s, x = case
    ...     assert x.shape == (s["B"], s["T"], 3) and x.dtype == jnp.float32
    >>> check()
    """
    dtype = np.dtype(spec.dtype if spec.dtype is not None else np.float32)
    shape = _shape(spec, sizes)
    if elements is None and spec.lengths_of is not None:
        limit = sizes[spec.lengths_of] if spec.lengths_of in sizes else _var(spec.lengths_of).max
        elements = st.integers(0, limit)
    if elements is None:
        elements = _default_elements(dtype)
    return hnp.arrays(dtype, shape, elements=elements)


def lengths(batch: int, max_len: int, *, min_len: int = 0):
    """Per-example lengths: int32 arrays of shape ``(batch,)`` with values in [min_len, max_len].

    >>> from hypothesis import given
    >>> from polyexec.testing import lengths
    >>> @given(lengths(4, 10, min_len=2))
    ... def check(n):
    ...     assert n.shape == (4,) and n.dtype == "int32" and ((2 <= n) & (n <= 10)).all()
    >>> check()
    """
    if not 0 <= min_len <= max_len:
        raise OptionError(f"lengths: expected 0 <= min_len <= max_len, received "
                          f"min_len={min_len}, max_len={max_len}")
    return hnp.arrays(np.int32, (int(batch),), elements=st.integers(min_len, max_len))


@dataclasses.dataclass(frozen=True)
class TransparencyReport:
    """What `assert_bucket_transparent` ran: the bucketed functions (for their ``traces`` and
    ``stats``) and every size dict it checked."""

    values: Bucketed
    grads: Bucketed | None
    sizes: tuple[dict[str, int], ...]


def _filter_grad(fn: Callable, argnums: int | Sequence[int]) -> Callable:
    """``jax.grad(fn, argnums)`` with equinox filter semantics: only the floating-point array
    leaves of the differentiated arguments are differentiated (others get ``None``), so a model
    with integer buffers or static fields can be differentiated like any pytree of arrays."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    def grad_fn(*args):
        parts = [eqx.partition(args[i], eqx.is_inexact_array) for i in nums]

        def differentiable(diffs):
            full = list(args)
            for i, d, (_, rest) in zip(nums, diffs, parts):
                full[i] = eqx.combine(d, rest)
            return fn(*full)

        grads = jax.grad(differentiable)(tuple(d for d, _ in parts))
        return grads[0] if isinstance(argnums, int) else grads

    grad_fn.__name__ = f"grad_{getattr(fn, '__name__', 'fn')}"
    return grad_fn


def _compare(actual, expected, what: str, size_of: Mapping[str, int], bucket: Mapping[str, int],
             rtol: float, atol: float) -> None:
    a_leaves, a_tree = jax.tree_util.tree_flatten_with_path(actual)
    e_leaves, e_tree = jax.tree_util.tree_flatten_with_path(expected)
    where = f"at sizes {dict(size_of)} (bucket {dict(bucket)})"
    if a_tree != e_tree:
        raise AssertionError(f"bucketed {what} {where}: output structure {a_tree} differs from "
                             f"the exact-size run's {e_tree}")
    for (path, a), (_, e) in zip(a_leaves, e_leaves):
        a, e = np.asarray(a), np.asarray(e)
        if a.shape != e.shape:
            raise AssertionError(
                f"bucketed {what} {where}: out{jax.tree_util.keystr(path)} has shape {a.shape}, "
                f"the exact-size run gives {e.shape} (its out_specs Spec, or the plan's symbolic "
                f"output shape, does not cut it back to the real sizes)")
        np.testing.assert_allclose(
            a, e, rtol=rtol, atol=atol,
            err_msg=f"bucketed {what} {where} differ at out{jax.tree_util.keystr(path)}")


def assert_bucket_transparent(fn: Callable, in_specs: Sequence[Any], *, out_specs: Any = None,
                              buckets: Mapping[LengthVar | str, Any] | None = None,
                              fixed_args: Sequence[Any] = (),
                              grad_argnums: int | Sequence[int] | None = None,
                              elements: Mapping[int, Any] | None = None,
                              max_examples: int | None = None, shrink: bool = True,
                              masking: bool = True,
                              rtol: float = 1e-5, atol: float = 1e-5) -> TransparencyReport:
    """Property-test that ``px.bucketed(fn, in_specs, out_specs, buckets)`` equals ``fn`` run at
    the exact size, for random sizes within every `LengthVar`'s bounds and random inputs.

    ``in_specs`` are those of `px.bucketed`; the arguments whose spec is ``None`` (a model, a
    constant) are taken from ``fixed_args``, in order; the others are drawn with `arrays`
    (``elements`` maps an argument's index to its element strategy, e.g. token ids). The
    reference runs ``fn`` jitted at the exact shapes with `px.valid_length` (and
    `px.max_length`) answering the exact sizes. With ``grad_argnums``, gradients are checked
    too: ``bucketed(grad(fn, grad_argnums))`` against ``grad(fn, grad_argnums)`` at the exact
    size (``fn`` must return a scalar); gradients with respect to Spec'd inputs are sliced back
    by the same Spec. Raises ``AssertionError`` naming the sizes, the bucket and the output
    leaf; hypothesis prints the falsifying inputs. ``max_examples`` defaults to the active
    hypothesis profile's. ``shrink=False`` reports the first failing example as found: every
    shrinking step at a new size compiles a new exact-size reference, which for a scanned model
    can take minutes. ``masking=False`` checks the physical program instead (as
    ``px.bucketed(..., masking=False)`` runs it): code that must mask by hand to be right.
    Call it from a plain test, not from inside another ``@given``.

    >>> import jax.numpy as jnp, polyexec as px
    >>> from polyexec.testing import assert_bucket_transparent
    >>> T = px.LengthVar("T", min=2, max=24)
    >>> B = px.LengthVar("B", max=3)
    >>> def masked_sq_sum(x, lengths):              # x: (B, T), lengths: (B,)
    ...     mask = px.sequence_mask(lengths, x, axis=1)
    ...     return jnp.sum(jnp.where(mask, x * x, 0.0))
    >>> report = assert_bucket_transparent(
    ...     masked_sq_sum, (px.Spec("B T", jnp.float32), px.Spec("B", jnp.int32, lengths_of="T")),
    ...     grad_argnums=0, buckets={T: [8, 16]}, max_examples=4)
    >>> report.values.traces, report.grads.traces
    (1, 1)
    """
    in_specs = tuple(in_specs)
    fixed_positions = [i for i, s in enumerate(in_specs) if s is None]
    if len(fixed_args) != len(fixed_positions):
        raise OptionError(f"assert_bucket_transparent: fixed_args: expected "
                          f"{len(fixed_positions)} values (in_specs is None at positions "
                          f"{fixed_positions}), received {len(fixed_args)}")
    elements = dict(elements or {})
    unknown = sorted(set(elements) - (set(range(len(in_specs))) - set(fixed_positions)))
    if unknown:
        raise OptionError(f"assert_bucket_transparent: elements: expected positions of "
                          f"arguments with a Spec, received {unknown}")

    values = bucketed(fn, in_specs, out_specs, buckets, masking=masking)
    # Sizes are drawn for the variables the inputs bind (not for sizes an output or a
    # data-dependent op defines).
    is_spec = lambda x: isinstance(x, Spec)  # noqa: E731
    spec_leaves = [s for s in jax.tree_util.tree_leaves(in_specs, is_leaf=is_spec) if is_spec(s)]
    names = dict.fromkeys([n for s in spec_leaves for n in s.var_names]
                          + [s.lengths_of for s in spec_leaves if s.lengths_of])
    variables = [values.variables[n] for n in names]
    grads = None
    if grad_argnums is not None:
        nums = (grad_argnums,) if isinstance(grad_argnums, int) else tuple(grad_argnums)
        grad_specs = tuple(in_specs[i] for i in nums)
        grads = bucketed(_filter_grad(fn, grad_argnums), in_specs,
                         grad_specs[0] if isinstance(grad_argnums, int) else grad_specs, buckets,
                         masking=masking)

    def reference(size_items, *args):
        # Exact sizes: valid_length is the size itself, and so is max_length.
        exact = dict(size_items)
        with binding({n: jnp.int32(s) for n, s in exact.items()}, exact):
            return fn(*args)

    def grad_reference(size_items, *args):
        exact = dict(size_items)
        with binding({n: jnp.int32(s) for n, s in exact.items()}, exact):
            return _filter_grad(fn, grad_argnums)(*args)

    # filter_jit: array leaves traced, the size items and a model's static fields static.
    jit_reference, jit_grad_reference = eqx.filter_jit(reference), eqx.filter_jit(grad_reference)
    tried: list[dict[str, int]] = []

    defaults = settings()
    phases = defaults.phases if shrink else tuple(p for p in defaults.phases if p != Phase.shrink)

    @settings(max_examples=max_examples if max_examples is not None else defaults.max_examples,
              deadline=None, phases=phases,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def check(data):
        size_of = data.draw(size_dicts(*variables), label="sizes")
        fixed = iter(fixed_args)
        args = []
        for i, spec in enumerate(in_specs):
            if spec is None:
                args.append(next(fixed))
                continue
            strategies = jax.tree_util.tree_map(
                lambda s, i=i: arrays(s, size_of, elements=elements.get(i)), spec,
                is_leaf=lambda x: isinstance(x, Spec))
            args.append(data.draw(_tree_strategy(strategies), label=f"args[{i}]"))
        items = tuple(sorted(size_of.items()))
        bucket = {n: values.bucket_for(n, s) for n, s in size_of.items()}
        got = values(*args)
        _compare(got, _without_ragged_tails(values, jit_reference(items, *args), in_specs, args,
                                            size_of), "values", size_of, bucket, rtol, atol)
        if grads is not None:
            _compare(grads(*args), jit_grad_reference(items, *args), "gradients", size_of, bucket,
                     rtol, atol)
        tried.append(size_of)

    check()
    return TransparencyReport(values, grads, tuple(tried))


def _without_ragged_tails(f, out, in_specs, args, sizes):
    """The exact-size reference as a ragged batch returns it: where a ``lengths_of`` input
    makes an output axis ragged, each row's positions beyond its length do not exist, and the
    bucketed function returns them as the pad (0)."""
    segment = f.plan.segments[-1]
    if not segment.convention.rows_at or segment.exported is None:
        return out
    ragged = {spec.lengths_of: (np.asarray(arg), spec.dims[0])
              for spec, arg in zip(in_specs, args)
              if isinstance(spec, Spec) and spec.lengths_of and len(spec.dims) == 1}
    leaves, tree = jax.tree_util.tree_flatten(out)
    cleared = [clear_ragged_tails(np.asarray(leaf), aval.shape, sizes, ragged, 0)
               for leaf, aval in zip(leaves, segment.exported.out_avals)]
    return jax.tree_util.tree_unflatten(tree, cleared)


def _tree_strategy(tree: Any):
    """One strategy drawing a pytree whose leaves are drawn from the strategies in ``tree``."""
    leaves, treedef = jax.tree_util.tree_flatten(
        tree, is_leaf=lambda x: isinstance(x, st.SearchStrategy))
    return st.tuples(*leaves).map(lambda drawn: jax.tree_util.tree_unflatten(treedef, list(drawn)))


# -- ragged batches ------------------------------------------------------------------------------

class RaggedBatch(NamedTuple):
    """One drawn ragged batch: ``x`` of shape ``(B, T, *feature_shape)`` whose row ``b`` is real
    up to ``lengths[b]`` and padding beyond it, and ``lengths`` (int32, ``(B,)``)."""

    x: np.ndarray
    lengths: np.ndarray

    def rows(self) -> list[np.ndarray]:
        """The real rows, ``x[b, :lengths[b]]``: the ragged array the padding stands for."""
        return [self.x[b, :n] for b, n in enumerate(self.lengths)]


def edge_lengths(length: LengthVar | str, buckets: Sequence[int] | None = None, *,
                 min_len: int = 0) -> tuple[int, ...]:
    """The row lengths where padding bugs live: 0 and 1 (or ``min_len``), the variable's
    ``min``, each bucket size and its neighbours (±1), and ``max`` -- those within
    ``[min_len, max]``. ``buckets`` defaults to the variable's own bucket sizes.

    >>> import polyexec as px
    >>> from polyexec.testing import edge_lengths
    >>> edge_lengths(px.LengthVar("T", min=2, max=20), [8])
    (0, 1, 2, 3, 7, 8, 9, 19, 20)
    """
    var = _var(length)
    if not 0 <= min_len <= var.max:
        raise OptionError(f"edge_lengths({var}): min_len: expected 0 <= min_len <= {var.max}, "
                          f"received {min_len}")
    sizes = bucket_sizes(var, buckets)
    near = {0, 1, var.min, var.min + 1, var.max - 1, var.max}
    near |= {s + d for s in sizes for d in (-1, 0, 1)}
    return tuple(sorted(n for n in near if min_len <= n <= var.max))


def _padding_values(dtype: np.dtype):
    # What a program must never read: NaN poisons any arithmetic, +-inf any sum, 3e38 overflows
    # a float32 sum or square to inf; for integers, the extremes (an index that reads them goes
    # far out of range, a sum overflows).
    if dtype.kind in "fc":
        big = float(np.finfo(dtype).max) if dtype.itemsize < 4 else 3e38
        return st.sampled_from([np.nan, np.inf, -np.inf, big, -big])
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return st.sampled_from([int(info.max), int(info.min)])
    if dtype.kind == "b":
        return st.just(True)
    raise OptionError(f"ragged_batches: expected a bool, int, float or complex dtype, received "
                      f"{dtype}")


def ragged_batches(batch: LengthVar | str | int, length: LengthVar | str, *,
                   buckets: Sequence[int] | None = None, feature_shape: Sequence[int] = (),
                   dtype: Any = np.float32, min_len: int = 0, elements=None, padding=None,
                   extra_padding: bool = False):
    """Ragged batches (`RaggedBatch`: ``x``, ``lengths``) with the lengths where padding bugs
    live and padding that poisons any result that reads it.

    ``batch`` rows (a `LengthVar`'s sizes, or a fixed int); each row's length is drawn mostly
    from `edge_lengths` (0/1, ``length``'s min, each bucket size of ``buckets`` and its
    neighbours, the max), otherwise anywhere in ``[min_len, length.max]``. ``x`` has shape
    ``(B, T, *feature_shape)`` with ``T`` the longest row (at least ``length.min``), or with
    ``extra_padding`` any size from there up to ``length.max`` (a batch already padded, e.g. to
    its bucket). Real elements come from ``elements`` (default: as `arrays` draws them);
    everything beyond a row's length from ``padding`` (default: NaN, +-inf and +-3e38 for
    floats, the extremes for integers).

    >>> import numpy as np, polyexec as px
    >>> from hypothesis import given
    >>> from polyexec.testing import ragged_batches
    >>> T = px.LengthVar("T", min=1, max=20)
    >>> B = px.LengthVar("B", max=4)
    >>> @given(ragged_batches(B, T, buckets=[8], feature_shape=(3,)))
    ... def check(batch):
    ...     x, lengths = batch
    ...     assert x.shape[0] == len(lengths) and x.shape[1] == max(1, *lengths)
    ...     assert all((np.abs(row) <= 1).all() for row in batch.rows())      # real: in [-1, 1]
    ...     assert not any((np.abs(x[b, n:]) <= 1).any() for b, n in enumerate(lengths))  # pad
    >>> check()
    """
    var = _var(length)
    dtype = np.dtype(dtype)
    feature_shape = tuple(int(d) for d in feature_shape)
    edges = edge_lengths(var, buckets, min_len=min_len)
    if isinstance(batch, (int, np.integer)) and not isinstance(batch, bool):
        if batch < 1:
            raise OptionError(f"ragged_batches: batch: expected a LengthVar or an int >= 1, "
                              f"received {batch}")
        batch_sizes = st.just(int(batch))
    else:
        batch_sizes = sizes(batch)
    elements = _default_elements(dtype) if elements is None else elements
    padding = _padding_values(dtype) if padding is None else padding
    one_length = st.sampled_from(edges) | st.integers(min_len, var.max)

    @st.composite
    def draw(draw_):
        b = draw_(batch_sizes)
        lengths = np.asarray(draw_(st.lists(one_length, min_size=b, max_size=b)), np.int32)
        t = max(int(lengths.max()), var.min)
        if extra_padding:
            t = draw_(st.integers(t, var.max))
        shape = (b, t, *feature_shape)
        real = draw_(hnp.arrays(dtype, shape, elements=elements))
        pad = draw_(hnp.arrays(dtype, shape, elements=padding))
        beyond = np.arange(t)[None, :] >= lengths[:, None]
        x = np.where(beyond.reshape(b, t, *(1,) * len(feature_shape)), pad, real)
        return RaggedBatch(x, lengths)

    return draw()


@dataclasses.dataclass(frozen=True)
class RaggedTransparencyReport:
    """What `assert_ragged_transparent` ran: the bucketed functions (``traces``, ``stats``,
    ``plan``), every batch's ``lengths`` and ``x.shape``, the buckets used, and the
    ``(example, row)`` pairs whose per-row reference was skipped (length 0, and ``g`` cannot
    run on an empty row)."""

    values: Bucketed
    grads: Bucketed | None
    lengths: tuple[tuple[int, ...], ...]
    shapes: tuple[tuple[int, ...], ...]
    buckets: frozenset[tuple[tuple[str, int], ...]]
    skipped: tuple[tuple[int, int], ...]


def _sum_of_outputs(g: Callable) -> Callable:
    """The scalar whose gradient is checked: ``g``'s output itself when it is a scalar, else the
    sum of all its floating-point output elements."""
    def total(row):
        leaves = [leaf for leaf in jax.tree_util.tree_leaves(g(row))
                  if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]
        return sum(jnp.sum(leaf) for leaf in leaves)
    return total


def _compare_row(have, want, *, what: str, row: int, n: int, leaf: str, bucket, pad,
                 rtol: float, atol: float) -> None:
    """Row ``have`` (as the bucketed batch returns it) against ``want`` (the row alone): equal
    within ``want``'s shape, and the pad everywhere beyond it (positions that do not exist)."""
    where = f"ragged {what}: row {row} (length {n}, bucket {dict(bucket)}) at out{leaf}"
    have, want = np.asarray(have), np.asarray(want)
    if have.ndim != want.ndim or any(h < w for h, w in zip(have.shape, want.shape)):
        raise AssertionError(f"{where}: the batch's row has shape {have.shape}, the row alone "
                             f"gives {want.shape}")
    box = tuple(slice(0, w) for w in want.shape)
    np.testing.assert_allclose(have[box], want, rtol=rtol, atol=atol,
                               err_msg=f"{where}: differs from g(x[{row}, :{n}]) run alone")
    beyond = np.ones(have.shape, bool)
    beyond[box] = False
    if beyond.any() and not np.all(have[beyond] == np.asarray(pad, have.dtype)):
        bad = np.argwhere(beyond & (have != np.asarray(pad, have.dtype)))[0]
        raise AssertionError(f"{where}: position {tuple(int(i) for i in bad)} lies beyond the "
                             f"row's own output {want.shape} but holds {have[tuple(bad)]!r}, "
                             f"not the pad {pad!r}")


def assert_ragged_transparent(g: Callable, batch: LengthVar | str, length: LengthVar | str, *,
                              feature_shape: Sequence[int] = (), dtype: Any = np.float32,
                              buckets: Mapping[LengthVar | str, Any] | None = None,
                              grad: bool = False, elements=None, padding=None,
                              extra_padding: bool = False, min_len: int = 0,
                              max_examples: int | None = None, shrink: bool = True,
                              masking: bool = True,
                              rtol: float = 1e-5, atol: float = 1e-5) -> RaggedTransparencyReport:
    """Property-test that per-row code sees each row alone: for ragged batches drawn by
    `ragged_batches`, row ``b`` of ``px.bucketed(lambda x, lengths: jax.vmap(g)(x), in_specs=
    (Spec("B T *feature_shape", dtype), Spec("B", int32, lengths_of="T")), buckets=buckets)``
    equals ``g(x[b, :lengths[b]])`` run alone (jitted at that exact length), and is the pad (0)
    beyond that row's own output (its ragged tail).

    ``g`` maps one row ``(T, *feature_shape)`` to a pytree of arrays. With ``grad=True`` the
    gradient of the sum over rows (of ``g`` itself when scalar, else of all its floating-point
    output elements) with respect to ``x`` must equal, row by row within each row's length,
    the gradient of the row alone, and be 0 beyond it. Also checked: one trace of each function
    however many batches, one compile per bucket used, and (unless ``masking=False``, which
    checks the physical program, as ``px.bucketed(..., masking=False)`` runs it) that the plan
    is padding-safe.

    Rows of length 0: ``g`` is run on the empty row ``(0, *feature_shape)``; when that raises
    (``x[-1]``, ``jnp.max`` or ``argmax`` of nothing), the row has no reference and is skipped
    (listed in the report's ``skipped``); when it runs (a mean is NaN, a scan returns its
    initial carry, a softmax or flip is empty), the row is compared like any other, NaN equal
    to NaN. Raises ``AssertionError`` naming the row, its length, the bucket and the output
    leaf; hypothesis prints the falsifying batch. ``buckets``, ``max_examples``, ``shrink``,
    ``rtol``/``atol`` as in `assert_bucket_transparent`; ``elements``, ``padding``,
    ``extra_padding``, ``min_len`` as in `ragged_batches` (whose edge lengths follow the bucket
    sizes of ``length``). Call it from a plain test, not from inside another ``@given``.

    >>> import jax, jax.numpy as jnp, polyexec as px
    >>> from polyexec.testing import assert_ragged_transparent
    >>> T = px.LengthVar("T", min=1, max=24)
    >>> B = px.LengthVar("B", max=3)
    >>> def last_minus_mean(row):                     # row: (T, 2); no mask anywhere
    ...     return row[-1] - jnp.mean(row, axis=0)
    >>> report = assert_ragged_transparent(last_minus_mean, B, T, feature_shape=(2,), grad=True,
    ...                                    buckets={T: [8, 16]}, max_examples=4)
    >>> report.values.traces, report.grads.traces
    (1, 1)
    """
    B, T = _var(batch), _var(length)
    feature_shape = tuple(int(d) for d in feature_shape)
    dtype = np.dtype(dtype)
    name = getattr(g, "__name__", type(g).__name__)
    in_specs = (Spec((B, T, *feature_shape), dtype), Spec((B,), jnp.int32, lengths_of=T.name))

    def per_row(x, lengths):
        return jax.vmap(g)(x)

    def per_row_grad(x, lengths):
        return jax.grad(lambda x: jnp.sum(jax.vmap(_sum_of_outputs(g))(x)))(x)

    per_row.__name__ = f"vmap_{name}"
    per_row_grad.__name__ = f"grad_vmap_{name}"
    values = bucketed(per_row, in_specs, None, buckets, masking=masking)
    grads = bucketed(per_row_grad, in_specs, None, buckets, masking=masking) if grad else None
    t_policy = next((p for k, p in (buckets or {}).items()
                     if (k.name if isinstance(k, LengthVar) else k) == T.name), None)
    strategy = ragged_batches(B, T, buckets=bucket_sizes(T, t_policy),
                              feature_shape=feature_shape, dtype=dtype, min_len=min_len,
                              elements=elements, padding=padding, extra_padding=extra_padding)
    reference, grad_reference = jax.jit(g), jax.jit(jax.grad(_sum_of_outputs(g)))
    empty_runs: dict[str, bool] = {}

    def runs_empty(kind: str, fn: Callable) -> bool:
        if kind not in empty_runs:
            try:
                jax.eval_shape(fn, jax.ShapeDtypeStruct((0, *feature_shape), dtype))
                empty_runs[kind] = True
            except Exception:  # noqa: BLE001 -- whatever g raises on nothing, it has no answer
                empty_runs[kind] = False
        return empty_runs[kind]

    seen_lengths, seen_shapes, skipped = [], [], []
    used: set[tuple[tuple[str, int], ...]] = set()
    defaults = settings()
    phases = defaults.phases if shrink else tuple(p for p in defaults.phases if p != Phase.shrink)

    def check_padding_safe(f: Bucketed, what: str) -> None:
        if masking and not f.plan.padding_safe:
            raise AssertionError(f"ragged {what} of {name}: the plan is not padding-safe, so "
                                 f"padding may change its result: {f.plan.padding_reason}")

    @settings(max_examples=max_examples if max_examples is not None else defaults.max_examples,
              deadline=None, phases=phases,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
              report_multiple_bugs=False)  # one AssertionError, never an ExceptionGroup
    @given(drawn=strategy)
    def check(drawn: RaggedBatch):
        x, lengths = drawn
        bucket = {B.name: values.bucket_for(B.name, x.shape[0]),
                  T.name: values.bucket_for(T.name, x.shape[1])}
        runs = [("values", values, reference, runs_empty("values", g))]
        if grads is not None:
            runs.append(("gradients", grads, grad_reference,
                         runs_empty("gradients", jax.grad(_sum_of_outputs(g)))))
        example = len(seen_lengths)
        for what, f, ref, empty_ok in runs:
            got = f(x, lengths)
            check_padding_safe(f, what)
            got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(got)
            for b, n in enumerate(int(n) for n in lengths):
                if n == 0 and not empty_ok:
                    if what == "values":
                        skipped.append((example, b))
                    continue
                want = ref(x[b, :n])
                want_leaves, want_tree = jax.tree_util.tree_flatten_with_path(want)
                if want_tree != got_tree:
                    raise AssertionError(f"ragged {what}: row {b} (length {n}, bucket {bucket}): "
                                         f"output structure {got_tree} differs from the row "
                                         f"alone's {want_tree}")
                for (path, have), (_, w) in zip(got_leaves, want_leaves):
                    _compare_row(np.asarray(have)[b], w, what=what, row=b, n=n,
                                 leaf=jax.tree_util.keystr(path), bucket=bucket, pad=0,
                                 rtol=rtol, atol=atol)
        used.add(tuple(sorted(bucket.items())))
        seen_lengths.append(tuple(int(n) for n in lengths))
        seen_shapes.append(tuple(x.shape))

    check()
    for what, f in (("values", values), ("gradients", grads)):
        if f is None:
            continue
        if f.traces != 1:
            raise AssertionError(f"ragged {what} of {name}: traced {f.traces} times, expected "
                                 f"once for every bucket")
        compiles = {key: s.compiles for key, s in f.stats.buckets.items() if s.compiles}
        if any(c != 1 for c in compiles.values()) or len(compiles) > len(used):
            raise AssertionError(f"ragged {what} of {name}: compiles per bucket {compiles}, "
                                 f"expected one for each of the {len(used)} buckets used")
    return RaggedTransparencyReport(values, grads, tuple(seen_lengths), tuple(seen_shapes),
                                    frozenset(used), tuple(skipped))
