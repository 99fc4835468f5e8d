"""Rules for reductions over length axes, and cumulative ones.

- ``reduce_{sum,max,min,prod,and,or,xor}``, ``argmax``/``argmin``, ``reduce``: over a length,
  the layout reduces with the reduction's identity (``reduce``: its init value). Padded rows
  replace the tail of every reduced length axis by it (`Ctx.reduce`); packed rows reduce
  within each sequence.
- ``cumsum``/``cumprod``/``cummax``/``cummin``/``cumlogsumexp``: the layout accumulates
  (`Ctx.accumulate`). Padded, forward ones read only a prefix and pass through;
  ``reverse=True`` ones start from the logical end (tail -> identity).
"""

from __future__ import annotations

from ._basics import acts_along_params, bind_eqn_with, is_sym, operand_avals
from ._registry import NoRule, PAD_AND_PACK, deffacts, defrule
from ._families import CUMULATIVE, REDUCERS
from ._sequences import first_only


def _summed_tails(eqn):
    """A sum reads its length axes with their tails zeroed where the operand is made."""
    shape = eqn.invars[0].aval.shape
    return [(0, [a for a in eqn.params["axes"] if is_sym(shape[a])])]


# One rule per primitive for both layouts: the layout reduces (`Ctx.reduce`), accumulates
# (`Ctx.accumulate`) along its lengths; the rule says which operands, identities and axes.


@defrule("reduce_sum", layout=PAD_AND_PACK, zeroed_reads=_summed_tails, acts_on=acts_along_params)
@defrule(*(name for name in REDUCERS if name != "reduce_sum"), layout=PAD_AND_PACK,
         acts_on=acts_along_params)
def _reduction(ctx, eqn, invals):
    (x,) = invals
    axes = eqn.params["axes"]
    if not any(is_sym(x.shape[a]) for a in axes):
        return None
    return ctx.reduce(eqn, invals, [REDUCERS[eqn.primitive.name].identity(x.dtype)], axes)


@defrule("reduce", layout=PAD_AND_PACK)
def _reduce(ctx, eqn, invals):
    # lax.reduce: operands then their init values, which are the reduction's identities.
    n = len(invals) // 2
    axes = eqn.params["dimensions"]
    if not any(is_sym(invals[0].shape[a]) for a in axes):
        return None
    return ctx.reduce(eqn, invals, invals[n:], axes)


def _cumulative_moves(eqn):
    return [(operand_avals(eqn)[0], (eqn.params["axis"],))]


@defrule(*CUMULATIVE, layout=PAD_AND_PACK, moves=_cumulative_moves, acts_on=acts_along_params,
         moves_rows_why=(
    "{name} accumulates across the rows ({rows}) of a value ragged along them: a shorter "
    "row's padding would reach the rows after it"))
def _cumulative(ctx, eqn, invals):
    (x,) = invals
    axis = eqn.params["axis"]
    if not is_sym(x.shape[axis]):
        return None
    return ctx.accumulate(eqn, x, axis, CUMULATIVE[eqn.primitive.name], eqn.params["reverse"])


# Linear, and a carry summed over a scan's steps passes through it (`_control`).
deffacts("reduce_sum", linear=True, carries=True, sums_rows=lambda eqn, row_axes: any(
    a in row_axes(eqn.invars[0].aval.shape) for a in eqn.params["axes"]))


# --------------------------------------------------------------------------------------------
# Per-sequence values of packed rows (``layout="per_sequence"``, `_basics.Known.per_sequence`).


@defrule("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
         "argmax", "argmin", layout="per_sequence")
def _over_sequences(ctx, eqn, invals):
    """A reduction over the rows of a per-sequence value (``jnp.mean(loss)``): over every
    sequence once, at its first cell."""
    (x,), (known,) = invals, ctx.operands
    axes, a = tuple(eqn.params["axes"]), known.sequence_axis
    if a is None or a not in axes:
        return None
    name = eqn.primitive.name
    if name in ("argmax", "argmin"):
        raise NoRule(f"{name} over the sequences of a per-sequence value")
    fill = REDUCERS[name].identity(x.dtype)
    physical = tuple(sorted({b + (b > a) for b in axes} | {a + 1}))
    return bind_eqn_with(eqn, [first_only(ctx, x, a, fill)], axes=physical)
