"""Rules for contractions and windows: ``dot_general``, convolutions, windowed reductions and
the max-pooling derivatives.

- ``dot_general``: contracted length axes are zeroed on both operands; batch/free axes pass.
- ``conv_general_dilated``, ``reduce_window*``, ``select_and_{scatter,gather}_add``: the tail
  becomes the padding value; when the low padding is itself a length expression (SAME with a
  stride) the padded operand is built explicitly with the logical low padding, so the zero (or
  identity) padding sits at the logical ends.
"""

from __future__ import annotations

from jax import lax

from ._core import (PAD_AND_PACK, NoRule, bind_eqn_with, defrule, fill_tail, has_sym,
                    highest_value, iota_along, is_sym, lowest_value, place_window, take_clamped,
                    windowed)
from ._families import WINDOWS


def _contracted_tails(eqn):
    """A contraction reads the length axes it contracts with their tails zeroed where each
    operand is made."""
    (lc, rc), _ = eqn.params["dimension_numbers"]
    lhs, rhs = (v.aval.shape for v in eqn.invars)
    pairs = [(a, b) for a, b in zip(lc, rc) if is_sym(lhs[a]) or is_sym(rhs[b])]
    return [(0, [a for a, _ in pairs]), (1, [b for _, b in pairs])]


def _contraction_acts_on(eqn, i, axis, shape):
    (lc, rc), _ = eqn.params["dimension_numbers"]
    return axis in (lc, rc)[i]


@defrule("dot_general", zeroed_reads=_contracted_tails, acts_on=_contraction_acts_on)
def _dot_general(ctx, eqn, invals):
    lhs, rhs = invals
    (lc, rc), _ = eqn.params["dimension_numbers"]
    pairs = [(a, b) for a, b in zip(lc, rc) if is_sym(lhs.shape[a]) or is_sym(rhs.shape[b])]
    if not pairs:
        return None         # batch and free length axes are per position
    # An operand made from lengths alone (a per-position weight in per-row code) may be
    # zeroed at the longest row's length when the other operand has the rows: that one is
    # zeroed at each row's own, so no row reads past its end. Otherwise its contraction
    # differs per row with no axis to hold it (`Ctx.length` refuses).
    lhs = fill_tail(ctx, lhs, [a for a, _ in pairs], 0,
                     shared=_holds_rows(ctx, rhs.shape, [rhs.shape[b] for _, b in pairs]) or None)
    rhs = fill_tail(ctx, rhs, [b for _, b in pairs], 0,
                     shared=_holds_rows(ctx, lhs.shape, [lhs.shape[a] for a, _ in pairs]) or None)
    return bind_eqn_with(eqn, [lhs, rhs])


def _holds_rows(ctx, shape, lengths) -> bool:
    """Whether a value of ``shape`` has the rows axis of every ragged length in ``lengths``."""
    found = [ctx.rows_of(d) for d in lengths]
    return all(ctx.row_axes(shape, rows) for rows in found if rows is not None)


@defrule("conv_general_dilated")
def _conv(ctx, eqn, invals):
    lhs, rhs = invals
    p = eqn.params
    lhs_spec, rhs_spec, _ = p["dimension_numbers"]
    fg, bg = p["feature_group_count"], p["batch_group_count"]
    changed = False
    if is_sym(lhs.shape[lhs_spec[1]]) or is_sym(rhs.shape[rhs_spec[1]]):
        # Feature groups split these axes at physical offsets; batch groups split the batch
        # and output features, each group still contracting every feature (a depthwise
        # convolution's kernel gradient contracts the rows this way).
        if fg != 1:
            raise NoRule("grouped convolution over length features")
        lhs = fill_tail(ctx, lhs, (lhs_spec[1],), 0)
        rhs = fill_tail(ctx, rhs, (rhs_spec[1],), 0)
        changed = True
    if ((bg != 1 and is_sym(lhs.shape[lhs_spec[0]]))
            or (fg != 1 and is_sym(rhs.shape[rhs_spec[0]]))):
        raise NoRule("grouped convolution over a length axis")
    padding, lhs_dilation = list(p["padding"]), list(p["lhs_dilation"])
    for i, (la, ra) in enumerate(zip(lhs_spec[2:], rhs_spec[2:])):
        if is_sym(rhs.shape[ra]):
            rhs = fill_tail(ctx, rhs, (ra,), 0)
            changed = True
        lo, hi = padding[i]
        if not is_sym(lo):
            if is_sym(lhs.shape[la]):
                # The tail becomes zeros: the zero padding then starts at the logical end.
                lhs = fill_tail(ctx, lhs, (la,), 0)
                changed = True
        else:
            # SAME with a stride: the low padding depends on the length. Build the padded
            # operand with the logical low padding and convolve it unpadded.
            n, ld = lhs.shape[la], lhs_dilation[i]
            lhs = place_window(ctx, lhs, la, lo, ld - 1, (n - 1) * ld + 1 + lo + hi, 0)
            padding[i], lhs_dilation[i] = (0, 0), 1
            changed = True
    if not changed:
        return None
    return bind_eqn_with(eqn, [lhs, rhs], padding=tuple(padding), lhs_dilation=tuple(lhs_dilation))


@defrule(*WINDOWS, layout=PAD_AND_PACK)
def _reduce_window_fixed(ctx, eqn, invals):
    """One rule for every layout: the layout reads the window past its lengths' edges
    (`Ctx.window`)."""
    (x,) = invals
    return ctx.window(eqn, x, WINDOWS[eqn.primitive.name])


@defrule("reduce_window")
def _reduce_window(ctx, eqn, invals):
    n = len(invals) // 2
    operands, inits = invals[:n], invals[n:]
    done = windowed(ctx, operands, inits, eqn.params, "base_dilation")
    if done is None:
        return None
    operands, padding, base_dilation = done
    return bind_eqn_with(eqn, [*operands, *inits], padding=padding, base_dilation=base_dilation)


def _select_fill(eqn, dtype):
    prim = eqn.params["select_prim"]
    if prim is lax.ge_p or prim is lax.gt_p:
        return lowest_value(dtype)
    if prim is lax.le_p or prim is lax.lt_p:
        return highest_value(dtype)
    raise NoRule(f"select_prim {prim}")


@defrule("select_and_gather_add")
def _select_and_gather_add(ctx, eqn, invals):
    # The JVP of max pooling: the tangent at each window's selected position. The operand's
    # tail loses every selection; the tangents' tail is zero anyway.
    tangents, operand = invals
    fills = [0, _select_fill(eqn, operand.dtype)]
    done = windowed(ctx, [tangents, operand], fills, eqn.params, "base_dilation")
    if done is None:
        return None
    (tangents, operand), padding, base_dilation = done
    return bind_eqn_with(eqn, [tangents, operand], padding=padding, base_dilation=base_dilation)


@defrule("select_and_scatter_add")
def _select_and_scatter_add(ctx, eqn, invals):
    # The transpose of max pooling: each window's cotangent (``source``) is added at the
    # window's selected position of ``operand``. Cotangents of windows beyond the logical
    # output become zero; the operand's tail loses every selection.
    source, operand = invals
    changed = False
    if has_sym(source.shape):
        source = fill_tail(ctx, source, range(source.ndim), 0)
        changed = True
    fill = _select_fill(eqn, operand.dtype)
    done = windowed(ctx, [operand], [fill], eqn.params, None)
    if done is None:
        return bind_eqn_with(eqn, [source, operand]) if changed else None
    (padded,), padding, _ = done
    (out,) = bind_eqn_with(eqn, [source, padded], padding=padding)
    # Where the operand was padded explicitly, read the result back at the logical offset.
    for a, (lo, _) in enumerate(eqn.params["padding"]):
        if is_sym(lo):
            n = operand.shape[a]
            out = take_clamped(ctx, out, iota_along((n,), 0) + ctx.length(lo), a)
    return [out]


