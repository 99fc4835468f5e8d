"""Data-dependent sizes: bounded ops that return their actual size, and partition points.

An op whose output size depends on the data (boolean masking, NonZero, a loop that stops on a
condition) is written as a *bounded* op, the way OpenVINO's VPUX plugin does it: the output is an
upper-bound buffer (as large as the op can ever produce), the real entries packed at its front,
and the real size comes back as an extra int32 output, ``count``. A bounded op is an ordinary
JAX function: it traces under symbolic shapes, jits, and (`compact`) differentiates.

Naming a `LengthVar` with ``length=K`` makes the op *define* ``K``: inside `px.bucketed` the
function is then cut at that op (see `_partition`), the count is read on the host, and what
follows runs at the smallest bucket of ``K`` that holds it. Outside a bucketed function
``length=`` changes nothing.
"""

from __future__ import annotations

import dataclasses
import threading
import traceback
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import source_info_util

from . import _context
from ._errors import OptionError, PolyexecError, SpecError
from ._spec import LengthVar

# Equations made inside these ops are attributed to the user's call line (plan.describe).
source_info_util.register_exclusion(__file__)

# -- the partition context ----------------------------------------------------------------------

_STATE = threading.local()


@dataclasses.dataclass(frozen=True)
class Injected:
    """What an earlier segment handed over at partition point ``index``: the values (new
    program inputs of the current segment, with ``K`` along the cut axis)."""

    name: str
    values: Any            # pytree of tracers
    treedef: Any


class Cut(BaseException):
    """Stops the trace of a segment at its partition point (a BaseException so that a user's
    ``except Exception`` cannot swallow it). Carries what the segment returns."""

    def __init__(self, *, index: int, var: LengthVar, values: Any, count: Any, axes: tuple,
                 fills: tuple, where: str):
        super().__init__(f"partition point {index} ({var.name}) at {where}")
        self.index = index
        self.var = var
        self.values = values
        self.count = count
        self.axes = axes          # per values leaf: the cut axis, or None (carried whole)
        self.fills = fills        # per values leaf: the fill value of the unused tail
        self.where = where


@dataclasses.dataclass
class Context:
    """State of one segment trace. ``mode="partition"``: the first ``len(injected)`` partition
    points return injected inputs and the next one raises `Cut`. ``mode="bounded"``: no point
    cuts; each defines its variable in-program and its count becomes an extra output."""

    mode: Literal["partition", "bounded"]
    injected: list[Injected]
    input_names: frozenset[str] = frozenset()     # the variables bound by the input shapes
    variables: Mapping[str, LengthVar] = dataclasses.field(default_factory=dict)  # all the call knows
    top: Any = None                       # the trace the bucketed function itself runs in
    points: list[tuple[str, str]] = dataclasses.field(default_factory=list)   # (name, where)
    counts: dict[str, Any] = dataclasses.field(default_factory=dict)          # bounded mode
    defined: dict[str, LengthVar] = dataclasses.field(default_factory=dict)
    # Set by the traced wrapper (`_partition._wrap`) when the function stops or returns:
    cut: Any = None                       # the CutPoint this segment stopped at, if any
    user_tree: Any = None                 # the function's output treedef (last segment)
    user_paths: list[str] = dataclasses.field(default_factory=list)


def current() -> Context | None:
    return getattr(_STATE, "context", None)


class active:
    """``with active(ctx):`` — partition points consult ``ctx`` while the function is traced."""

    def __init__(self, context: Context):
        self.context = context

    def __enter__(self):
        self.previous = current()
        _STATE.context = self.context
        self.context.top = jax.extend.core.get_opaque_trace_state()
        return self.context

    def __exit__(self, *exc):
        _STATE.context = self.previous
        return False


def _caller() -> str:
    """``file:line: `code``` of the innermost user frame calling into polyexec."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if not _context.is_library(frame.filename):
            return _context.describe_frame(frame)
    return "<unknown location>"


def _resolve(length: LengthVar | str, fn: str) -> LengthVar:
    if isinstance(length, LengthVar):
        return length
    ctx = current()
    if isinstance(length, str) and ctx is not None and length in ctx.variables:
        return ctx.variables[length]
    raise SpecError(f"{fn}: length: expected a LengthVar (or the name of one the bucketed call "
                    f"was given, e.g. in out_specs or buckets), received {length!r}")


def _scalar_count(count: Any, fn: str):
    count = jnp.asarray(count)
    if count.shape != () or not jnp.issubdtype(count.dtype, jnp.integer):
        raise SpecError(f"{fn}: count must be an integer scalar, received "
                        f"{count.dtype}{list(count.shape)}")
    return count.astype(jnp.int32)


def define(values: Any, count: Any, length: LengthVar | str, axes: Any, fill: Any, fn: str):
    """The partition point behind every ``length=`` argument; see `partition`."""
    var = _resolve(length, fn)
    count = _scalar_count(count, fn)
    leaves, treedef = jax.tree_util.tree_flatten(values)
    axes_leaves = treedef.flatten_up_to(axes) if not isinstance(axes, int) else [axes] * len(leaves)
    if not any(a is not None for a in axes_leaves):
        raise SpecError(f"{fn}: no value has an axis of length {var.name}")
    for i, (leaf, axis) in enumerate(zip(leaves, axes_leaves)):
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise SpecError(f"{fn}: values leaf {i} is a {type(leaf).__name__}, not an array")
        if axis is not None and not -leaf.ndim <= axis < leaf.ndim:
            raise SpecError(f"{fn}: axis {axis} is out of range for values leaf {i} of rank "
                            f"{leaf.ndim}")
    axes_leaves = [None if a is None else a % leaf.ndim for a, leaf in zip(axes_leaves, leaves)]
    ctx = current()
    if ctx is None:
        # Not under a bucketed trace (eager use, the user's own jit, the per-bucket slow path):
        # the op stays bounded; inside a binding, valid_length(K) answers the count.
        _context.define_length(var.name, count)
        return values, count
    where = _caller()
    if jax.extend.core.get_opaque_trace_state() != ctx.top:
        raise PolyexecError(
            f"{fn}(..., length={var.name!r}) at {where} runs inside a transformation nested in "
            f"the bucketed function (jax.jit, vmap, grad, scan, cond, ...). A data-dependent "
            f"length can only be defined at the top level of the function: drop the inner "
            f"transformation (px.bucketed compiles the whole function anyway) or drop length=")
    for name, other in ctx.points:
        if name == var.name:
            raise PolyexecError(f"length variable {var.name!r} is defined twice, at {other} and at "
                                f"{where}: give each data-dependent op its own LengthVar")
    if var.name in ctx.input_names:
        raise PolyexecError(f"{fn}(..., length={var.name!r}) at {where}: {var.name!r} is already a "
                            f"length variable of the inputs; name the data-dependent size with a "
                            f"new LengthVar")
    index = len(ctx.points)
    ctx.points.append((var.name, where))
    ctx.defined[var.name] = var
    if ctx.mode == "bounded":
        ctx.counts[var.name] = count
        _context.define_length(var.name, count)
        return values, count
    if index < len(ctx.injected):
        injected = ctx.injected[index]
        if injected.name != var.name or injected.treedef != treedef:
            raise PolyexecError(
                f"{fn} at {where}: partition point {index} defined {injected.name!r} with values "
                f"{injected.treedef} when the function was traced up to it, but now defines "
                f"{var.name!r} with {treedef}: the function must make the same data-dependent "
                f"ops in the same order on every trace")
        return injected.values, _context.valid_length(var.name)
    fills = tuple(np.asarray(fill if fill is not None else 0).astype(leaf.dtype)
                  for leaf in leaves)
    raise Cut(index=index, var=var, values=values, count=count, axes=tuple(axes_leaves),
              fills=fills, where=where)


# -- the bounded ops ----------------------------------------------------------------------------


def _check_array(value: Any, fn: str, name: str) -> None:
    """A `SpecError` naming the argument unless ``value`` is an array, a tracer, or what NumPy
    reads as numbers or bools: None, a string or a ragged list would otherwise fail inside
    ``jnp.asarray`` with a message naming neither the op nor the argument. Only checks: the
    caller converts with ``jnp.asarray`` itself (a Python scalar stays weakly typed), after
    every argument passed (converting one is a device transfer, maybe a compile)."""
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        try:
            kind = np.asarray(value).dtype.kind
        except Exception:  # noqa: BLE001 -- ragged nesting and the like: refused below
            kind = "O"
        if kind not in "biufc":
            raise SpecError(f"{fn}: {name}: expected an array (or a nested list of numbers or "
                            f"bools), received {type(value).__name__} {value!r:.80}")


def _check_mask(mask, fn: str):
    _check_array(mask, fn, "mask")
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise SpecError(f"{fn}: mask must be boolean, received {mask.dtype} (use `mask != 0`)")
    return mask


def _gather_index(mask):
    """For a 1-D boolean mask: ``src`` such that ``x[src]`` lists the kept entries first, in
    order, then the dropped ones; and the count. O(n): an exclusive cumsum gives every entry its
    destination and one scatter of an int vector inverts that permutation. The heavy data then
    moves by a gather, whose gradient (a scatter-add) JAX derives."""
    m = mask.astype(jnp.int32)
    kept_before = jnp.cumsum(m) - m
    count = jnp.sum(m, dtype=jnp.int32)
    position = lax.iota(jnp.int32, mask.shape[0])
    dest = jnp.where(mask, kept_before, count + (position - kept_before))
    src = jnp.zeros_like(position).at[dest].set(position, unique_indices=True,
                                                mode="promise_in_bounds")
    return src, count


def _along(vector, axis: int, ndim: int):
    return jnp.expand_dims(vector, [d for d in range(ndim) if d != axis])


def compact(x, mask, *, axis: int | None = 0, fill: Any = 0, length: LengthVar | str | None = None):
    """Boolean masking with a static shape: ``(values, count)``.

    ``values`` has ``x``'s shape; along ``axis`` it holds the entries where ``mask`` is true,
    packed at the front in their original order, then ``fill``. ``count`` (int32) is how many
    were kept, so ``values[:count]`` equals NumPy's ``np.compress(mask, x, axis)``. ``mask`` is
    1-D with ``x.shape[axis]`` entries; with ``axis=None`` it has ``x``'s shape and both are
    flattened first (NumPy's ``x[mask]``). Traceable under symbolic shapes and jit;
    differentiable with respect to ``x`` (dropped entries get zero gradient).

    ``length=K`` (a `LengthVar`) names the kept size: inside `px.bucketed` the program is cut
    here, ``count`` is read on the host and everything after runs at the smallest bucket of
    ``K`` that holds it, with ``values`` of size ``K`` along ``axis``; ``px.valid_length(K)``
    is the count and an output `Spec` naming ``K`` is sliced to it.

    Inside a bucketed function ``x`` is padded to its bucket: leave the padding out of the
    mask (``px.arange_like(x) < px.valid_length(N)``), or it is kept and counted like data.

    >>> import numpy as np, polyexec as px
    >>> x = np.array([[1., 2.], [3., 4.], [5., 6.]], np.float32)
    >>> values, count = px.compact(x, np.array([True, False, True]))
    >>> values.tolist(), int(count)
    ([[1.0, 2.0], [5.0, 6.0], [0.0, 0.0]], 2)

    Downstream of a filter, at the size of what was kept:

    >>> import jax.numpy as jnp
    >>> N = px.LengthVar("N", max=64)
    >>> K = px.LengthVar("K", max=64)
    >>> def below_squared(x, limit):                       # x: (N,)
    ...     real = px.arange_like(x) < px.valid_length(N)   # not the padding
    ...     kept, n = px.compact(x, real & (x < limit), length=K)  # kept: (K,) from here on
    ...     return kept ** 2
    >>> f = px.bucketed(below_squared, in_specs=(px.Spec("N", jnp.float32), None),
    ...                 out_specs=px.Spec("K"))
    >>> f(np.array([-1., 2., -3., 4., 5.], np.float32), np.float32(3)).tolist()
    [1.0, 4.0, 9.0]
    >>> len(f.plan.segments)
    2
    """
    _check_array(x, "compact", "x")
    _check_array(mask, "compact", "mask")
    x = jnp.asarray(x)
    mask = _check_mask(mask, "compact")
    if axis is None:
        if mask.shape != x.shape:
            raise SpecError(f"compact(axis=None): mask must have x's shape {tuple(x.shape)}, "
                            f"received {tuple(mask.shape)}")
        x, mask, axis = jnp.reshape(x, (-1,)), jnp.reshape(mask, (-1,)), 0
    else:
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
            raise SpecError(f"compact: axis must be an int or None, received {axis!r}")
        if not -x.ndim <= axis < x.ndim:
            raise SpecError(f"compact: axis {axis} is out of range for x of rank {x.ndim}")
        axis = int(axis) % x.ndim
        if mask.ndim != 1 or not mask.shape[0] == x.shape[axis]:
            raise SpecError(f"compact: mask must be 1-D with x.shape[{axis}] = {x.shape[axis]} "
                            f"entries, received shape {tuple(mask.shape)}")
    src, count = _gather_index(mask)
    values = jnp.take(x, src, axis=axis, mode="clip")  # src is always in bounds
    kept = _along(lax.iota(jnp.int32, mask.shape[0]) < count, axis, x.ndim)
    values = jnp.where(kept, values, jnp.asarray(fill, x.dtype))
    if length is None:
        return values, count
    return define(values, count, length, axis, fill, "compact")


def nonzero(mask, *, fill: int = -1, length: LengthVar | str | None = None):
    """Indices of the true entries of ``mask`` in an upper-bound buffer: ``(indices, count)``.

    For a 1-D mask ``indices`` has shape ``(n,)``; for an N-D mask, ``(mask.size, mask.ndim)``
    (one row of coordinates per entry, NumPy's ``np.argwhere`` layout). The first ``count`` rows
    are the true entries in row-major order, the rest ``fill``. ``length=K`` defines ``K`` as
    in `compact`.

    >>> import numpy as np, polyexec as px
    >>> indices, count = px.nonzero(np.array([False, True, True, False]))
    >>> indices.tolist(), int(count)
    ([1, 2, -1, -1], 2)
    >>> indices, count = px.nonzero(np.array([[True, False], [False, True]]))
    >>> indices[:count].tolist()
    [[0, 0], [1, 1]]
    """
    mask = _check_mask(mask, "nonzero")
    if mask.ndim == 0:
        raise SpecError("nonzero: mask must have at least one dimension, received a scalar")
    if mask.ndim == 1:
        coords = lax.iota(jnp.int32, mask.shape[0])
    else:
        coords = jnp.stack([lax.broadcasted_iota(jnp.int32, mask.shape, d)
                            for d in range(mask.ndim)], axis=-1).reshape(-1, mask.ndim)
    indices, count = compact(coords, jnp.reshape(mask, (-1,)), axis=0, fill=fill)
    if length is None:
        return indices, count
    return define(indices, count, length, 0, fill, "nonzero")


def loop_until(step: Callable, init: Any, *, max_steps: Any, fill: Any = 0,
               length: LengthVar | str | None = None):
    """A ``while`` loop that writes one item per iteration into a bounded buffer.

    ``step(i, carry) -> (carry, item, stop)`` runs for ``i = 0, 1, ...`` until it returns
    ``stop=True`` (that step's item is kept) or ``max_steps`` items were written. ``item`` is
    any pytree of arrays. Returns ``(items, count, carry)``: ``items`` stacks the items along a
    new leading axis of size ``max_steps`` (rows from ``count`` on hold ``fill``), ``count`` the
    number written (int32) and ``carry`` the final carry. ``max_steps`` may be an int or a
    symbolic size such as ``x.shape[0]``. Built on `jax.lax.while_loop`: forward-mode
    differentiable, not reverse-mode.

    ``length=K`` defines ``K`` as the number of items, as in `compact` (the final carry is
    handed to the next segment whole).

    Greedy decoding that stops at an end token (token 0), at most 8 steps:

    >>> import jax.numpy as jnp, polyexec as px
    >>> next_token = jnp.array([0, 3, 1, 2])           # a toy "model": token -> next token
    >>> def step(i, token):
    ...     new = next_token[token]
    ...     return new, new, new == 0
    >>> tokens, count, _ = px.loop_until(step, jnp.int32(2), max_steps=8)
    >>> tokens[:count].tolist()
    [1, 3, 2, 1, 3, 2, 1, 3]
    >>> tokens, count, _ = px.loop_until(step, jnp.int32(3), max_steps=8, fill=-1)
    >>> tokens.tolist(), int(count)
    ([2, 1, 3, 2, 1, 3, 2, 1], 8)
    >>> next_token = jnp.array([0, 0, 1, 2])
    >>> tokens, count, _ = px.loop_until(step, jnp.int32(3), max_steps=8, fill=-1)
    >>> tokens.tolist(), int(count)
    ([2, 1, 0, -1, -1, -1, -1, -1], 3)
    """
    if not callable(step):
        raise OptionError(f"loop_until: step: expected a callable (i, carry) -> (carry, item, "
                          f"stop), received {type(step).__name__} {step!r}")
    if isinstance(max_steps, (int, np.integer)) and not isinstance(max_steps, bool):
        if max_steps < 0:
            raise SpecError(f"loop_until: max_steps must be >= 0, received {max_steps}")
    elif not jax.export.is_symbolic_dim(max_steps):
        raise SpecError(f"loop_until: max_steps must be an int or a symbolic size (x.shape[0]), "
                        f"received {max_steps!r}")
    init = jax.tree_util.tree_map(jnp.asarray, init)

    def checked_step(i, carry):
        out = step(i, carry)
        if not isinstance(out, tuple) or len(out) != 3:
            raise SpecError(f"loop_until: step(i, carry) must return (carry, item, stop), "
                            f"received {type(out).__name__}")
        new, item, stop = out
        return (jax.tree_util.tree_map(jnp.asarray, new), jax.tree_util.tree_map(jnp.asarray, item),
                jnp.asarray(stop))

    carry_shape, item_shape, stop_shape = jax.eval_shape(checked_step, jnp.int32(0), init)
    if jax.tree_util.tree_structure(carry_shape) != jax.tree_util.tree_structure(init):
        raise SpecError(f"loop_until: step returned a carry of structure "
                        f"{jax.tree_util.tree_structure(carry_shape)}, but init has "
                        f"{jax.tree_util.tree_structure(init)}")
    for new, old in zip(jax.tree_util.tree_leaves(carry_shape), jax.tree_util.tree_leaves(init)):
        if new.shape != old.shape:
            raise SpecError(f"loop_until: step changed a carry leaf's shape from {old.shape} to "
                            f"{new.shape}")
    if stop_shape.shape != () or stop_shape.dtype != jnp.bool_:
        raise SpecError(f"loop_until: step's stop must be a boolean scalar, received "
                        f"{stop_shape.dtype}{list(stop_shape.shape)}")
    buffer = jax.tree_util.tree_map(
        lambda s: jnp.full((max_steps, *s.shape), fill, s.dtype), item_shape)

    def cond(state):
        i, stop, _, _ = state
        return (i < max_steps) & ~stop

    def body(state):
        i, _, carry, buffer = state
        carry, item, stop = checked_step(i, carry)
        # A weakly typed carry (a Python float in init) must keep one dtype across iterations.
        carry = jax.tree_util.tree_map(lambda c, o: c.astype(o.dtype), carry, init)
        buffer = jax.tree_util.tree_map(
            lambda b, v: lax.dynamic_update_index_in_dim(b, jnp.asarray(v, b.dtype), i, 0),
            buffer, item)
        return i + 1, stop, carry, buffer

    if isinstance(max_steps, (int, np.integer)) and max_steps == 0:
        # An empty buffer: the loop body could not even be traced (nowhere to write item 0).
        count, carry, items = jnp.int32(0), init, buffer
    else:
        count, _, carry, items = lax.while_loop(cond, body, (jnp.int32(0), jnp.bool_(False),
                                                             init, buffer))
    if length is None:
        return items, count, carry
    axes = (jax.tree_util.tree_map(lambda _: 0, items),
            jax.tree_util.tree_map(lambda _: None, carry))
    (items, carry), count = define((items, carry), count, length, axes, fill, "loop_until")
    return items, count, carry


def partition(values: Any, count: Any, *, length: LengthVar | str, axis: int = 0,
              fill: Any = 0):
    """Mark a partition point: ``values`` (a pytree of arrays, each holding ``count`` real
    entries at the front of ``axis``) define the data-dependent size ``length``.

    This is what ``length=`` of `compact`, `nonzero` and `loop_until` calls; use it directly for
    a bounded op of your own. Inside `px.bucketed`, the program is cut here: the segment before
    returns ``values`` and ``count``, the host reads ``count``, and the code after runs at the
    smallest bucket of ``length`` holding it, seeing ``values`` with size ``length`` along
    ``axis``. Elsewhere it returns its arguments unchanged. The count may be below
    ``length.min`` (0 when nothing is kept): the next segment then runs at the smallest bucket,
    with ``px.valid_length(length)`` equal to the count.

    >>> import jax.numpy as jnp, numpy as np, polyexec as px
    >>> T = px.LengthVar("T", max=32)
    >>> U = px.LengthVar("U", max=32)
    >>> def until_negative(x):                              # x: (T,)
    ...     n = jnp.argmax(jnp.append(x < 0, True)).astype(jnp.int32)   # first negative
    ...     prefix, n = px.partition(x, jnp.minimum(n, x.shape[0]), length=U)
    ...     return jnp.cumsum(prefix)                      # (U,) from here on
    >>> f = px.bucketed(until_negative, in_specs=(px.Spec("T", jnp.float32),),
    ...                 out_specs=px.Spec("U"))
    >>> f(np.array([1., 2., 3., -1., 5.], np.float32)).tolist()
    [1.0, 3.0, 6.0]
    """
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise SpecError(f"partition: axis must be an int, received {axis!r}")
    return define(values, count, length, int(axis), fill, "partition")
