"""Rules for primitives that compute each output position from the same input position:
elementwise maths and layout-only primitives, which pass through, and ``dim_as_value``.

- elementwise primitives and layout-only ones (``broadcast_in_dim``, ``iota``, ``transpose``,
  ``squeeze``, ...) pass through: output position ``i`` reads input position ``i`` (or a
  broadcast scalar), so logical positions read logical positions.
- ``dim_as_value``: the dimension evaluated at the real sizes (`Ctx.count`); a length ragged
  along rows, in code without the rows axis, is each row's own (`Ctx.own_length`).
"""

from __future__ import annotations

from .._jax_internals import dim_vars
from ._registry import ELEMENTWISE, PAD_AND_PACK, deffacts, defrule

defrule(*"""
    abs acos acosh add add_any and asin asinh atan atan2 atanh bessel_i0e bessel_i1e
    bitcast_convert_type cbrt ceil clamp clz complex conj convert_element_type copy copy_p cos
    cosh digamma div eq eq_to erf erf_inv erfc exp exp2 expm1 floor ge gt igamma igamma_grad_a
    igammac imag integer_pow is_finite le le_to lgamma log log1p logistic lt lt_to max min mul
    mulhi ne neg nextafter not or polygamma population_count pow random_gamma_grad real reduce_precision
    regularized_incomplete_beta rem round rsqrt select_n shift_left shift_right_arithmetic
    shift_right_logical sign sin sinh sqrt square sub tan tanh threefry2x32 xor zeta
    squeeze transpose stack unstack stop_gradient optimization_barrier device_put
    sharding_constraint pvary zeros_like debug_callback debug_print
""".split())(ELEMENTWISE)
# Why the layout ones are safe: transpose/squeeze only permute or drop size-1 axes;
# stack/unstack add or remove an axis of constant size (one entry per operand).
# jax.debug callbacks return nothing the program reads (they may print padding, no more).

# Index arithmetic on a small constant folds while rewriting (`_core._folded`).
deffacts("convert_element_type", fold=lambda x, p: x.astype(p["new_dtype"]))
# Linear in all operands: all of them zero, the result is zero (`_core._only_from_empty`).
deffacts(*"convert_element_type add_any add sub neg copy copy_p reduce_precision transpose "
         "squeeze".split(), linear=True)
# Maths a packed row recomputes from each cell's position (masks made from positions).
deffacts(*"convert_element_type eq ne lt le gt ge and or not xor add sub mul neg max min "
         "select_n abs sign".split(), positional=True)
# Zeros stay zeros: a tail zeroed in the operand is zeroed in the result, along the same axis
# or, through a transpose (output axis i is operand axis permutation[i]), the one it moves to.
deffacts(*"convert_element_type copy copy_p neg reduce_precision".split(),
         zeroed_through=lambda eqn, axes: axes)
deffacts("transpose", zeroed_through=lambda eqn, axes: frozenset(
    i for i, a in enumerate(eqn.params["permutation"]) if a in axes))
# A scan's carry passes through them unchanged in kind (`_control`: does a carry accumulate).
deffacts(*"convert_element_type transpose squeeze copy copy_p neg reduce_precision".split(),
         carries=True)


@defrule("dim_as_value", layout=PAD_AND_PACK)
def _dim_as_value(ctx, eqn, invals):
    d = eqn.params["dim"]
    rows = ctx.rows_of(d)
    if rows is not None and rows not in dim_vars(d):
        # ``x.shape[1]`` of ragged (B, T) rows inside per-row code: each row's own length.
        return [ctx.own_length(eqn, d, rows)]
    return [ctx.count(d)]     # a count over rows (B*T) is the sum of the rows' real lengths
