"""Rules for reductions over length axes, and cumulative ones.

- ``reduce_{sum,max,min,prod,and,or,xor}``, ``argmax``/``argmin``, ``reduce``: the tail of every
  reduced length axis is replaced by the reduction's identity (``reduce``: its init value).
- ``cumsum``/``cumprod``/``cummax``/``cummin``/``cumlogsumexp``: forward ones read only a prefix
  and pass through; ``reverse=True`` ones start from the logical end (tail -> identity).
"""

from __future__ import annotations

from ._core import acts_along_params, bind_eqn_with, defrule, fill_tail, is_sym, operand_avals
from ._families import CUMULATIVE, REDUCERS


def _summed_tails(eqn):
    """A sum reads its length axes with their tails zeroed where the operand is made."""
    shape = eqn.invars[0].aval.shape
    return [(0, [a for a in eqn.params["axes"] if is_sym(shape[a])])]


@defrule("reduce_sum", zeroed_reads=_summed_tails, acts_on=acts_along_params)
@defrule(*(name for name in REDUCERS if name != "reduce_sum"), acts_on=acts_along_params)
def _reduction(ctx, eqn, invals):
    (x,) = invals
    axes = eqn.params["axes"]
    if not any(is_sym(x.shape[a]) for a in axes):
        return None
    fill = REDUCERS[eqn.primitive.name].identity(x.dtype)
    return bind_eqn_with(eqn, [fill_tail(ctx, x, axes, fill)])


@defrule("reduce")
def _reduce(ctx, eqn, invals):
    # lax.reduce: operands then their init values, which are the reduction's identities.
    n = len(invals) // 2
    operands, inits = invals[:n], invals[n:]
    axes = eqn.params["dimensions"]
    if not any(is_sym(operands[0].shape[a]) for a in axes):
        return None
    operands = [fill_tail(ctx, x, axes, init) for x, init in zip(operands, inits)]
    return bind_eqn_with(eqn, [*operands, *inits])


def _cumulative_moves(eqn):
    return [(operand_avals(eqn)[0], (eqn.params["axis"],))]


@defrule(*CUMULATIVE, moves=_cumulative_moves, acts_on=acts_along_params, moves_rows_why=(
    "{name} accumulates across the rows ({rows}) of a value ragged along them: a shorter "
    "row's padding would reach the rows after it"))
def _cumulative(ctx, eqn, invals):
    # Forward: position i reads 0..i, a logical prefix. Reverse: i reads i..n-1, the tail
    # included, so the tail becomes the identity and the sums start from the logical end.
    (x,) = invals
    axis = eqn.params["axis"]
    if not eqn.params["reverse"] or not is_sym(x.shape[axis]):
        return None
    fill = CUMULATIVE[eqn.primitive.name].identity(x.dtype)
    return bind_eqn_with(eqn, [fill_tail(ctx, x, (axis,), fill)])

