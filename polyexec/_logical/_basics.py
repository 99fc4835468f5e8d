"""Dimensions and values every rule uses, with no interpreter state: whether a dimension is
symbolic and grows with the lengths, the identities of the combining operations, rebinding an
equation, reading its parameters, and the annotation the interpreter hands a rule for each
operand (`Known`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._jax_internals import (convert_element_type, dim_bounds, dim_vars, evaluate_dim,
                              is_constant_dim, terms, var_dim)


def is_sym(d) -> bool:
    return not is_constant_dim(d)


def has_sym(shape) -> bool:
    return any(is_sym(d) for d in shape)


def monotone(d) -> bool:
    """Whether ``d`` never exceeds its value at the bucket sizes when evaluated at real sizes
    that are at most the bucket sizes (then the logical positions of an axis of size ``d`` fit
    in the physical array). A structural proof first; a single-variable expression with a known
    upper bound (every LengthVar has one) is then checked exhaustively: JAX normalises
    ``min(T, 3)`` to ``T - max(0, T - 3)`` and ``ceil(T/2)`` to ``-floordiv(-T, 2)``, which the
    structure alone does not show to be monotone."""
    if not is_sym(d):
        return True
    if _structurally_monotone(d):
        return True
    names = dim_vars(d)
    if len(names) != 1:
        return False
    (name,) = names
    lo, hi = dim_bounds(var_dim(name, d.scope))
    if not (math.isfinite(hi) and hi - lo <= 1 << 14):
        return False
    values = [int(evaluate_dim(d, {name: v})) for v in range(max(int(lo), 0), int(hi) + 1)]
    return all(a <= b for a, b in zip(values, values[1:]))


def _structurally_monotone(d) -> bool:
    # A sum of positive multiples of products of non-negative, non-decreasing factors.
    for coeff, factors in terms(d):
        if not factors:
            continue            # the constant term
        if coeff <= 0:
            return False
        single = len(factors) == 1 and factors[0][1] == 1
        if not all(_factor_monotone(f, need_nonneg=not single) for f, _ in factors):
            return False
    return True


def _factor_monotone(f, need_nonneg: bool) -> bool:
    if f.var is not None:
        return True             # length variables are >= 1
    ops = f.operands
    if f.operation == "floordiv":
        num, den = ops
        return (not is_sym(den) and int(den) > 0 and _monotone_expr(num)
                and (not need_nonneg or _nonneg(num)))
    if f.operation in ("max", "min"):
        if not all(_monotone_expr(o) for o in ops):
            return False
        if not need_nonneg:
            return True
        nonneg = [_nonneg(o) for o in ops]
        return any(nonneg) if f.operation == "max" else all(nonneg)
    return False                # mod is not monotone


def _monotone_expr(e) -> bool:
    return not is_sym(e) or _structurally_monotone(e)


def _nonneg(e) -> bool:
    if not is_sym(e):
        return int(e) >= 0
    lo, _ = dim_bounds(e, sign_only=True)
    return lo >= 0


def iota_along(shape, axis):
    return lax.broadcasted_iota(np.int32, tuple(shape), axis)


def filled(shape, fill, dtype):
    return lax.broadcast_in_dim(lax.convert_element_type(fill, dtype), tuple(shape), ())


def lowest_value(dtype):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return False
    if jnp.issubdtype(dtype, jnp.inexact):
        return -np.inf
    return jnp.iinfo(dtype).min


def ranked(x):
    """``x`` as ``top_k`` orders it, as ints where it is a float: XLA's TopK compares floats
    by their total order (``-NaN < -inf < ... < -0.0 < +0.0 < ... < +inf < +NaN``), which
    ``lax.sort`` and ``max`` do not (they tie the zeros and put every NaN last). The float's
    bits read as a signed int keep that order for positive floats; a negative one's magnitude
    bits are flipped so that a larger magnitude ranks lower."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    bits = lax.bitcast_convert_type(x, jnp.dtype(f"int{jnp.dtype(x.dtype).itemsize * 8}"))
    return lax.select(bits < 0, lax.bitwise_xor(bits, filled(bits.shape, jnp.iinfo(
        bits.dtype).max, bits.dtype)), bits)


def highest_value(dtype):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return True
    if jnp.issubdtype(dtype, jnp.inexact):
        return np.inf
    return jnp.iinfo(dtype).max


def all_ones(dtype):
    return True if np.dtype(dtype) == np.bool_ else -1 if jnp.issubdtype(dtype, jnp.signedinteger) \
        else jnp.iinfo(dtype).max


def bind_eqn(eqn, invals):
    out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def bind_eqn_with(eqn, invals, **changes):
    out = eqn.primitive.bind(*invals, **{**eqn.params, **changes})
    return list(out) if eqn.primitive.multiple_results else [out]


def sub_jaxprs(params):
    for value in params.values():
        for item in (value if isinstance(value, (tuple, list)) else (value,)):
            if isinstance(item, jax.extend.core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jax.extend.core.Jaxpr):
                yield item


def is_empty(aval) -> bool:
    """Whether an array of this aval has no elements whatever the sizes (a constant 0 axis)."""
    return any(not is_sym(d) and int(d) == 0 for d in getattr(aval, "shape", ()))


def acts_along_params(eqn, i: int, axis: int, shape) -> bool:
    """`Entry.acts_on` of a primitive that acts along the axes its parameter names (a
    reduction's ``axes``, a sort's ``dimension``, a cumulative op's ``axis``) and keeps every
    other axis per position."""
    for key in ("axes", "dimensions", "dimension", "axis"):
        if key in eqn.params:
            value = eqn.params[key]
            return axis in (value if isinstance(value, (tuple, list)) else (value,))
    return False


def operand_avals(eqn) -> list:
    """The avals of an equation's array operands (what the facts of `Entry` read)."""
    return [v.aval for v in eqn.invars if hasattr(v.aval, "shape")]


def same_dim(a, b) -> bool:
    if a is b:          # a symbolic dimension's `==` subtracts the two, even from itself
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - dimensions of different scopes do not compare
        return False


def literal_start(idx, component: int) -> int | None:
    """The largest start a gather's (or scatter's) literal indices give along ``component``,
    None when they are traced."""
    if isinstance(idx, np.ndarray) and idx.size:
        return int(np.max(idx[..., component]))
    return None


def one_position(size) -> bool:
    """A window of one position (``x[:, k]``), which the rules clamp into each row."""
    return not is_sym(size) and size == 1


def like_aval(x, aval):
    """A rule's result with exactly the original dtype and weak type (scan carries and branch
    outputs must keep their types)."""
    if not hasattr(aval, "dtype"):
        return x
    have = jax.typeof(x)
    if have.dtype == aval.dtype and getattr(have, "weak_type", False) == aval.weak_type:
        return x
    return convert_element_type(x, aval.dtype, aval.weak_type)


@dataclasses.dataclass(frozen=True)
class Known:
    """What the interpreter knows of one plain value beyond its aval: its annotation, one per
    variable of the program being evaluated, held beside the value (`eval_jaxpr`) as JAX's
    batching holds a tracer's batch dimension.

    - ``zeroed``: the length axes beyond whose logical end the value holds 0 (`fill_tail`), so
      a reader that needs that tail zeroed (a contraction, a sum) finds it done.
    - ``from_lengths``: made from lengths alone (`Ctx.from_lengths_of`): the same in every row,
      but what a rule makes of its tail is each row's own (`Ctx.length`).

    Values held in a layout's own form -- per row (``per_row``), per sequence or per cell of
    packed rows (``per_sequence``, ``per_cell``) -- or not packed at all (``unpackable``) are
    plain arrays (or None) so annotated: a rule reads its operands' forms here, by position,
    and states its outputs' in ``ctx.results``."""

    zeroed: frozenset = frozenset()
    from_lengths: bool = False
    # Made from positions alone (``iota`` and integer or boolean maths of it: a causal mask):
    # its entries as a function of their indices, ``positions(index) -> value``, ``index``
    # one int array per axis, all broadcasting together (`Ctx.positions_of`). Packed rows
    # recompute such a value at each cell's positions instead of gathering it there.
    positions: Callable | None = dataclasses.field(default=None, compare=False)
    # Packed rows: why the value cannot be packed (a per-sequence value no rule keeps, an
    # equation refused), naming its line. It has no value (None); what reads it is refused
    # in turn, so the plan fails only if a result needs it (`PackedCtx.held_outputs`).
    unpackable: str | None = None
    # Packed rows: a value without the rows axis that differs per sequence all the same (a
    # per-sequence number meeting positions: ``jnp.arange(T) / T``; ``T - 1 - iota``, which
    # ``x[:, ::-1]`` indexes with), held with the rows axis in front, so cell ``(r, c)`` of
    # a packed length holds the entry of the sequence there, at its position.
    per_cell: bool = False
    # Packed rows: a value with one entry per sequence (a scan's final carry, ``x[:, -1]``,
    # a sum over T alone, a ``(B,)`` input), held at every cell of its sequence: the logical
    # value with the grid's columns inserted after its rows axis ``sequence_axis``, or, for
    # a number per sequence without one (``x.shape[1]``; ``sequence_axis`` None), with
    # leading ``(rows, columns)`` axes (`_sequences`). ``sequence_var``: the packed variable
    # whose grid holds it (several ragged variables pack each in its own grid, `PackedCtx`).
    per_sequence: bool = False
    sequence_axis: int | None = None
    sequence_var: str | None = None
    # Ragged rows: a value that differs per row although it has no axis of the rows variable
    # ``per_row`` names (``x.shape[1]`` of a ragged ``(B, T)`` array is each row's length),
    # held with one extra leading axis, the rows; collapsed onto the rows axis as soon as an
    # equation's result has one. ``below``: made from a length that is negative for rows
    # below the declared min (`_core.value_floor`, a `_core.RowFloor`): the rows that short
    # are refused once it becomes a float.
    per_row: str | None = None
    below: Any = None

    def passed_on(self) -> "Known":
        """What a sub-program (a call's, a loop body's, one row's) knows of this value handed
        to it, or a caller of a result of its program: all but a zeroed tail, which is only
        this context's own, since a child's masks also drop its ended rows."""
        return dataclasses.replace(self, zeroed=frozenset())


PLAIN = Known()


def room_of(d, var: str) -> int:
    """The cells a packed length needs after each sequence: ``c`` for ``T + c`` (``c > 0``;
    ``jnp.pad`` by one cell each side gives ``T + 2``), else 0 -- ``T`` and ``T - 1`` need
    none, and a length that exceeds ``T`` by more than a constant (``2*T``) has no room that
    would do (`PackedCtx.refusal` refuses it).

    >>> import jax
    >>> T, = jax.export.symbolic_shape("T")
    >>> room_of(T + 2, "T"), room_of(T - 1, "T"), room_of(2 * T, "T")
    (2, 0, 0)
    """
    if not is_sym(d) or dim_vars(d) != {var}:
        return 0
    excess = d - var_dim(var, d.scope)
    return int(excess) if not is_sym(excess) and int(excess) > 0 else 0


def room_needed(jaxpr, var: str) -> int:
    """The room a packed program leaves after each sequence: the largest `room_of` any value
    of ``jaxpr`` (every program inside it included) has along the packed variable ``var``."""
    dims, stack = set(), [jaxpr]
    while stack:
        j = stack.pop()
        values = [*j.invars, *(v for eqn in j.eqns for v in eqn.outvars)]
        for v in values:
            dims.update(getattr(getattr(v, "aval", None), "shape", ()))
        stack.extend(p for eqn in j.eqns for p in sub_jaxprs(eqn.params))
    # Each distinct dimension once: `room_of` does symbolic arithmetic, and the 12-layer
    # LM's values have some 8,000 dimensions, a few dozen of them distinct.
    return max((room_of(d, var) for d in dims), default=0)
