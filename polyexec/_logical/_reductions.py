"""Rules for reductions over length axes, and cumulative ones.

- ``reduce_{sum,max,min,prod,and,or,xor}``, ``argmax``/``argmin``, ``reduce``: the tail of every
  reduced length axis is replaced by the reduction's identity (``reduce``: its init value).
- ``cumsum``/``cumprod``/``cummax``/``cummin``/``cumlogsumexp``: forward ones read only a prefix
  and pass through; ``reverse=True`` ones start from the logical end (tail -> identity).
"""

from __future__ import annotations

import numpy as np

from ._core import _all_ones, _bind_with, _fill_tail, _highest, _is_sym, _lowest, _rule


_REDUCE_IDENTITY = {
    "reduce_sum": lambda dt: 0, "reduce_prod": lambda dt: 1, "reduce_max": _lowest,
    "reduce_min": _highest, "reduce_and": _all_ones, "reduce_or": lambda dt: 0,
    "reduce_xor": lambda dt: 0, "argmax": _lowest, "argmin": _highest,
}


@_rule(*_REDUCE_IDENTITY)
def _reduction(ctx, eqn, invals):
    (x,) = invals
    axes = eqn.params["axes"]
    if not any(_is_sym(x.shape[a]) for a in axes):
        return None
    fill = _REDUCE_IDENTITY[eqn.primitive.name](x.dtype)
    return _bind_with(eqn, [_fill_tail(ctx, x, axes, fill)])


@_rule("reduce")
def _reduce(ctx, eqn, invals):
    # lax.reduce: operands then their init values, which are the reduction's identities.
    n = len(invals) // 2
    operands, inits = invals[:n], invals[n:]
    axes = eqn.params["dimensions"]
    if not any(_is_sym(operands[0].shape[a]) for a in axes):
        return None
    operands = [_fill_tail(ctx, x, axes, init) for x, init in zip(operands, inits)]
    return _bind_with(eqn, [*operands, *inits])


_CUMULATIVE_IDENTITY = {"cumsum": lambda dt: 0, "cumprod": lambda dt: 1, "cummax": _lowest,
                        "cummin": _highest, "cumlogsumexp": lambda dt: -np.inf}


@_rule(*_CUMULATIVE_IDENTITY)
def _cumulative(ctx, eqn, invals):
    # Forward: position i reads 0..i, a logical prefix. Reverse: i reads i..n-1, the tail
    # included, so the tail becomes the identity and the sums start from the logical end.
    (x,) = invals
    axis = eqn.params["axis"]
    if not eqn.params["reverse"] or not _is_sym(x.shape[axis]):
        return None
    fill = _CUMULATIVE_IDENTITY[eqn.primitive.name](x.dtype)
    return _bind_with(eqn, [_fill_tail(ctx, x, (axis,), fill)])

