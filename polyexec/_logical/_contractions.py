"""Rules for contractions and windows: ``dot_general``, convolutions, windowed reductions and
the max-pooling derivatives.

- ``dot_general``: contracted length axes are zeroed on both operands; batch/free axes pass.
- ``conv_general_dilated``, ``reduce_window*``, ``select_and_{scatter,gather}_add``: the tail
  becomes the padding value; when the low padding is itself a length expression (SAME with a
  stride) the padded operand is built explicitly with the logical low padding, so the zero (or
  identity) padding sits at the logical ends.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ._basics import (bind_eqn, bind_eqn_with, has_sym, highest_value, iota_along, is_sym,
                      lowest_value)
from ._core import fill_tail, place_window, take_clamped, windowed
from ._registry import NoRule, PAD_AND_PACK, deffacts, defrule, padded_rule
from ._families import WINDOWS
from ._cells import by_position
from ._packed import PackedCtx, shifted_within
from ._sequences import by_cell, first_only, held, refused, segments, shapes_of


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
    lhs = fill_tail(ctx, lhs, [a for a, _ in pairs], 0, known=ctx.operands[0],
                     shared=_holds_rows(ctx, rhs.shape, [rhs.shape[b] for _, b in pairs]) or None)
    rhs = fill_tail(ctx, rhs, [b for _, b in pairs], 0, known=ctx.operands[1],
                     shared=_holds_rows(ctx, lhs.shape, [lhs.shape[a] for a, _ in pairs]) or None)
    return bind_eqn_with(eqn, [lhs, rhs])


def _contracts_rows(eqn, row_axes) -> bool:
    """A weight's gradient ``x.T @ g``: the rows of the left operand contracted."""
    (lc, _), _ = eqn.params["dimension_numbers"]
    return any(a in row_axes(eqn.invars[0].aval.shape) for a in lc)


deffacts("dot_general", sums_rows=_contracts_rows)


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
        lhs = fill_tail(ctx, lhs, (lhs_spec[1],), 0, known=ctx.operands[0])
        rhs = fill_tail(ctx, rhs, (rhs_spec[1],), 0, known=ctx.operands[1])
        changed = True
    if ((bg != 1 and is_sym(lhs.shape[lhs_spec[0]]))
            or (fg != 1 and is_sym(rhs.shape[rhs_spec[0]]))):
        raise NoRule("grouped convolution over a length axis")
    padding, lhs_dilation = list(p["padding"]), list(p["lhs_dilation"])
    for i, (la, ra) in enumerate(zip(lhs_spec[2:], rhs_spec[2:])):
        if is_sym(rhs.shape[ra]):
            rhs = fill_tail(ctx, rhs, (ra,), 0, known=ctx.operands[1])
            changed = True
        lo, hi = padding[i]
        if not is_sym(lo):
            if is_sym(lhs.shape[la]):
                # The tail becomes zeros: the zero padding then starts at the logical end.
                lhs = fill_tail(ctx, lhs, (la,), 0, known=ctx.operands[0])
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
    done = windowed(ctx, operands, inits, eqn.params, "base_dilation", ctx.operands[:n])
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
    done = windowed(ctx, [tangents, operand], fills, eqn.params, "base_dilation", ctx.operands)
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
        source = fill_tail(ctx, source, range(source.ndim), 0, known=ctx.operands[0])
        changed = True
    fill = _select_fill(eqn, operand.dtype)
    done = windowed(ctx, [operand], [fill], eqn.params, None, ctx.operands[1:])
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

# --------------------------------------------------------------------------------------------
# Packed rows (``layout="pack"``, its per-cell and per-sequence values): the same primitives'
# rules over rows that hold several sequences (`_packed` is the layout's machinery).


@defrule("dot_general", layout="pack")
def _dot_general_packed(ctx: PackedCtx, eqn, invals):
    lhs, rhs = invals
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    out = eqn.outvars[0].aval.shape
    if len(ctx.row_axes(out)) > 1:
        raise NoRule("a contraction pairing the rows of packed rows")
    if any(ctx.paired_axes(x.shape) for x in invals):
        return _paired_contraction(ctx, eqn, lhs, rhs)
    if ctx.row_axes(out) and ctx.packed_axes(out) and any(
            ctx.packed_axes(x.shape) and not ctx.row_axes(x.shape) for x in invals):
        return _placed_contraction(ctx, eqn, lhs, rhs)
    if len(ctx.packed_axes(out)) > 1 or any(len(ctx.packed_axes(x.shape)) > 1 for x in invals):
        return _pairing(ctx, eqn, lhs, rhs)
    for x, contracted in ((lhs, lc), (rhs, rc)):
        rows, packed = set(ctx.row_axes(x.shape)), set(ctx.packed_axes(x.shape))
        c = set(contracted)
        if packed & c and not rows <= c:
            pooled = _along_each_sequence(ctx, eqn, lhs, rhs)
            if pooled is not None:
                return pooled
            return ctx.refuse_per_sequence(eqn, "a contraction over a packed length alone")
        if rows & c and not packed <= c:
            return ctx.refuse_per_sequence(eqn, "a contraction over the rows alone")
        if rows & c and not packed and ctx.alive is None:
            return ctx.refuse_per_sequence(eqn, "a contraction over the rows")
    return padded_rule(eqn)(ctx, eqn, invals)


def _paired_contraction(ctx: PackedCtx, eqn, lhs, rhs):
    """Inside a scan over one length, a contraction of values paired with the step's cell
    (attention over the encoder's cells at a decoder step, ``einsum("bs,bsh->bh", w, enc)``):
    over the cells of the step's example only, both operands zero outside them."""
    (lc, rc), _ = eqn.params["dimension_numbers"]
    for x, contracted in ((lhs, lc), (rhs, rc)):
        if len(ctx.packed_axes(x.shape)) > 1 or (ctx.packed_axes(x.shape)
                                                 and not ctx.paired_axes(x.shape)):
            raise NoRule("a contraction inside a scan of a value of two packed lengths")
    if not any(a in ctx.paired_axes(x.shape) for x, c in ((lhs, lc), (rhs, rc)) for a in c):
        return None          # the paired length kept: per cell
    return bind_eqn(eqn, [ctx.frame_only(x, 0) if ctx.paired_axes(x.shape) else x
                          for x in (lhs, rhs)])


def _placed_contraction(ctx: PackedCtx, eqn, lhs, rhs):
    """A per-position operand contracted with packed rows into packed rows (a ``(T, T)``
    matrix: ``einsum("ts,bsf->btf", jnp.tri(T), x)`` for running sums, a fixed mixing matrix):
    placed into the rows by position first (`by_position`: each cell its own positions),
    then batched over the rows with the other operand. A contraction over a packed length
    then reads each sequence's own cells only, as attention's ``w @ v`` does."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    k = 0 if not ctx.row_axes(lhs.shape) else 1            # the per-position operand
    fixed, rows_value = (lhs, rhs) if k == 0 else (rhs, lhs)
    (fc, vc), (fb, vb) = ((lc, rc), (lb, rb)) if k == 0 else ((rc, lc), (rb, lb))
    rows = ctx.row_axes(rows_value.shape)
    if len(rows) != 1 or rows[0] in vc or rows[0] in vb or ctx.row_axes(fixed.shape):
        raise NoRule("a contraction of a per-position value into packed rows, not one rows "
                      "axis kept free")
    (r,) = rows
    packed = [1 + a for a in ctx.packed_axes(fixed.shape)]
    placed = by_position(ctx, fixed, tuple(range(1, fixed.ndim + 1)),
                          (rows_value.shape[r], *fixed.shape), 0, packed)
    fc, fb, vb = tuple(a + 1 for a in fc), (0, *(a + 1 for a in fb)), (r, *vb)
    operands = [placed, rows_value]
    if set(packed) & set(fc):          # over a packed length: within each sequence only
        operands = [ctx.frame_only(x, 0) for x in operands]
    numbers = ((fc, vc), (fb, vb)) if k == 0 else ((vc, fc), (vb, fb))
    (out,) = bind_eqn_with(eqn, operands if k == 0 else operands[::-1],
                        dimension_numbers=numbers)
    # The rows came out first (a batch axis): back among the free axes, where they were.
    free = [d for d in range(rows_value.ndim) if d not in vc and d not in vb[1:]]
    before = fixed.ndim - len(fc) - len(fb) + 1 if k == 0 else 0
    return [jnp.moveaxis(out, 0, len(lb) + before + free.index(r))]


def _along_each_sequence(ctx: PackedCtx, eqn, lhs, rhs):
    """A contraction along a packed length alone, batched over the rows (attention pooling,
    ``einsum("bt,btf->bf", w, x)``): per sequence, over its own cells -- the products per
    cell (the length made a batch axis too), summed per sequence like `_sequences.along_sequences`.
    None for another contraction."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    (lr, rr), (lp, rp) = ((ctx.row_axes(x.shape) for x in (lhs, rhs)),
                          (ctx.packed_axes(x.shape) for x in (lhs, rhs)))
    if not (len(lr) == len(rr) == len(lp) == len(rp) == 1 and lr[0] in lb and rr[0] in rb
            and lb.index(lr[0]) == rb.index(rr[0]) and lp[0] in lc and rp[0] in rc
            and lc.index(lp[0]) == rc.index(rp[0])):
        return None
    i = lc.index(lp[0])
    first = lambda b, r: (r, *(d for d in b if d != r))      # noqa: E731 - the rows first
    numbers = ((lc[:i] + lc[i + 1:], rc[:i] + rc[i + 1:]),
               ((*first(lb, lr[0]), lp[0]), (*first(rb, rr[0]), rp[0])))
    (cells,) = bind_eqn_with(eqn, [ctx.frame_only(lhs, 0), ctx.frame_only(rhs, 0)],
                          dimension_numbers=numbers)
    # cells: (rows, other batch axes..., length, free axes...): each sequence's own sum.
    grid, r_out = segments(ctx, cells, 0, len(lb), "add", 0), lb.index(lr[0])
    return ctx.held_per_sequence([by_cell(grid, r_out)], [r_out])


def _pairing(ctx: PackedCtx, eqn, lhs, rhs):
    """A contraction inside each packed row that pairs its cells: attention's scores
    ``q @ k.T`` (over features: every pair, those of two sequences outside the frame) and
    their use ``w @ v`` (over a packed length: each cell's own sequence only, both operands
    zero outside the frame)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lr, rr = ctx.row_axes(lhs.shape), ctx.row_axes(rhs.shape)
    if not (lr and rr and lr[0] in lb and rr[0] in rb and lb.index(lr[0]) == rb.index(rr[0])):
        raise NoRule("a contraction pairing cells of packed rows, not batched over the rows")
    lp, rp = ctx.packed_axes(lhs.shape), ctx.packed_axes(rhs.shape)
    if any((a in lp) != (b in rp) for a, b in zip(lc, rc)):
        raise NoRule("a contraction of a packed length with another axis")
    if not any(a in lp for a in lc):
        return None
    if not ctx.packed_axes(eqn.outvars[0].aval.shape):
        return ctx.refuse_per_sequence(eqn, "a contraction over packed lengths")
    return bind_eqn(eqn, [ctx.frame_only(x, 0) for x in (lhs, rhs)])


@defrule("conv_general_dilated", layout="pack")
def _conv_packed(ctx: PackedCtx, eqn, invals):
    """A convolution along a packed length with stride 1: every tap reads its own sequence,
    and zeros beyond its edges, as the exact-size convolution's zero padding does. The
    convolution becomes one per tap ``k``: the operand shifted by ``k * dilation - low`` with
    the cells whose tap falls outside their sequence zeroed, convolved with tap ``k`` alone.
    Its transposes are the same two forms: the input gradient is again a convolution over the
    length (the kernel reversed); the kernel gradient pairs the input with the output
    gradient over the length (window = the length, one output per tap)."""
    lhs, rhs = invals
    p = eqn.params
    lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
    spatial = [i for i, a in enumerate(lhs_spec[2:]) if a in ctx.packed_axes(lhs.shape)]
    rows = ctx.row_axes(lhs.shape)
    if not spatial:
        if any(ctx.packed_axes(x.shape) for x in invals) or rows == [lhs_spec[1]]:
            raise NoRule("a convolution over the rows or with a packed kernel, not along a "
                          "packed length")
        return None          # rows as the batch, the length not convolved: per position
    (i,) = spatial
    la, ra, oa = lhs_spec[2 + i], rhs_spec[2 + i], out_spec[2 + i]
    lo, hi = p["padding"][i]
    if is_sym(lo) or is_sym(hi) or p["lhs_dilation"][i] != 1 or any(
            is_sym(x.shape[a]) for x in invals for a in range(x.ndim)
            if a not in (*ctx.row_axes(x.shape), *ctx.packed_axes(x.shape))):
        raise NoRule("a convolution along a packed length with a length-dependent or "
                      "input-dilated padding, or over another length")
    if rows == [lhs_spec[0]] and not is_sym(rhs.shape[ra]):
        # Along the length: the forward pass and the input gradient.
        if p["window_strides"][i] != 1 or p["batch_group_count"] != 1:
            raise NoRule("a strided or batch-grouped convolution along a packed length (each "
                          "sequence's outputs would start at another column, or mix rows)")
        taps, step, length = rhs.shape[ra], p["rhs_dilation"][i], eqn.outvars[0].aval.shape[oa]
        out = None
        for k in range(taps):
            x = shifted_within(ctx, lhs, rows[0], la, k * step - lo, length)
            (y,) = bind_eqn_with(eqn, [x, lax.slice_in_dim(rhs, k, k + 1, axis=ra)],
                              padding=_replace(p["padding"], i, (0, 0)),
                              rhs_dilation=_replace(p["rhs_dilation"], i, 1))
            out = y if out is None else out + y
        return [out]
    if (rows == [lhs_spec[1]] and ctx.row_axes(rhs.shape) == [rhs_spec[1]]
            and ctx.packed_axes(rhs.shape) == [ra] and not is_sym(eqn.outvars[0].aval.shape[oa])):
        # The kernel gradient: input and output gradient paired over the rows and the length.
        if p["rhs_dilation"][i] != 1 or p["feature_group_count"] != 1:
            raise NoRule("the kernel gradient of a strided or feature-grouped convolution along "
                          "a packed length")
        length, step = rhs.shape[ra], p["window_strides"][i]
        rhs = ctx.frame_only(rhs, 0)
        outs = []
        for k in range(eqn.outvars[0].aval.shape[oa]):
            x = shifted_within(ctx, lhs, rows[0], la, k * step - lo, length)
            outs += bind_eqn_with(eqn, [x, rhs], window_strides=_replace(p["window_strides"], i, 1),
                               padding=_replace(p["padding"], i, (0, 0)))
        return [lax.concatenate(outs, oa)]
    raise NoRule("a convolution pairing packed rows in another way (not along the length "
                  "with the rows as its batch, nor a kernel gradient over them)")


def _replace(values, i, value):
    values = list(values)
    values[i] = value
    return tuple(values)


# Per-sequence values of packed rows (``layout="per_sequence"``, `_basics.Known.per_sequence`).


@defrule("dot_general", layout="per_sequence")
def _contract_sequences(ctx, eqn, invals):
    """A contraction over the rows of per-sequence values (a head's weight gradient
    ``h.T @ g``): over every sequence once, at its first cell."""
    lhs_shape, rhs_shape = shapes_of(eqn.invars)
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lr, rr = ctx.row_axes(lhs_shape), ctx.row_axes(rhs_shape)
    if not (lr and lr[0] in lc) and not (rr and rr[0] in rc):
        if any(ctx.packed_axes(s) for s in (lhs_shape, rhs_shape)):
            return _against_cells(ctx, eqn, invals, (lhs_shape, rhs_shape))
        return None
    if any(k.per_sequence and k.sequence_axis is None for k in ctx.operands) or any(
            ctx.packed_axes(s) for s in (lhs_shape, rhs_shape)):
        raise NoRule("a contraction over the sequences of a per-sequence value and another "
                      "kind of value")
    if not (lr and rr and lr[0] in lc and rr[0] in rc and lc.index(lr[0]) == rc.index(rr[0])):
        raise NoRule("a contraction of the sequences with another axis")
    # Both at first cells only: a cell outside every sequence holds anything (NaN: 0 * NaN).
    (lhs, la), (rhs, ra) = (held(ctx, x, s, k) for x, s, k in
                            zip(invals, (lhs_shape, rhs_shape), ctx.operands))
    lhs, rhs = first_only(ctx, lhs, la, 0), first_only(ctx, rhs, ra, 0)

    def moved(dims, a):
        return tuple(d + (d > a) for d in dims)

    numbers = ((moved(lc, la) + (la + 1,), moved(rc, ra) + (ra + 1,)),
               (moved(lb, la), moved(rb, ra)))
    return bind_eqn_with(eqn, [lhs, rhs], dimension_numbers=numbers)


def _against_cells(ctx, eqn, invals, shapes):
    """A per-sequence value contracted with a value along a packed length, batched over the
    rows (attention pooling's gradients: ``g @ x.T`` and ``w[..., None] * g`` per sequence):
    the per-sequence operand read at each cell of the other's packed axis, which both then
    share as a batch axis."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    k = 0 if ctx.operands[0].per_sequence else 1          # the per-sequence operand
    seq, other = invals[k], invals[1 - k]
    (sc, oc), (sb, ob) = ((lc, rc), (lb, rb)) if k == 0 else ((rc, lc), (rb, lb))
    frame, a = ctx.one_frame(shapes[1 - k]), ctx.operands[k].sequence_axis
    if (ctx.operands[1 - k].per_sequence or a is None or frame is None
            or a not in sb or frame[0] not in ob or sb.index(a) != ob.index(frame[0])
            or frame[1] in oc):
        raise NoRule("a contraction of a per-sequence value with a value along a packed "
                      "length, not batched over the rows")
    _, p = frame
    cells = lax.slice_in_dim(seq, 0, shapes[1 - k][p], axis=a + 1)
    moved = tuple(d + (d > a) for d in sc), (*(d + (d > a) for d in sb), a + 1)
    ours, theirs = moved, (oc, (*ob, p))
    numbers = tuple(zip(ours, theirs)) if k == 0 else tuple(zip(theirs, ours))
    (out,) = bind_eqn_with(eqn, [cells, other] if k == 0 else [other, cells],
                        dimension_numbers=numbers)
    # The packed axis comes out after the batch axes: back to its place among the other's
    # free axes.
    free = [d for d in range(len(shapes[1 - k])) if d not in oc and d not in ob]
    before = len(shapes[k]) - len(sc) - len(sb) if k == 0 else 0
    return [jnp.moveaxis(out, len(lb), len(lb) + before + free.index(p))]


# A window over a per-sequence value's columns would read other sequences' copies.
defrule("conv_general_dilated", "reduce_window_sum", "reduce_window_max", "reduce_window_min",
        "select_and_scatter_add", "select_and_gather_add", layout="per_sequence")(refused)
