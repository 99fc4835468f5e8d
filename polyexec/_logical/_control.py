"""Rules for control flow and calls: they recurse into the equation's programs, so they are
registered as *structural* (the equations inside count, not the container).

- ``scan`` with a symbolic ``length``: a ``while`` loop over the logical length only (from the
  logical end when ``reverse=True``), so the tail is never computed; a ``cond`` per step
  measured 1.6-2.8x slower than plain padding on a GRU backward pass, a ``select`` freezing the
  carry 0-20%.
- ``while`` with a batched predicate (``jax.vmap`` of a loop): lanes beyond a logical length
  are made false, so the loop ends when the real lanes do, as at the exact size.
- ``while``, ``cond``, and the call-like primitives (``jit``, ``closed_call``, ``core_call``,
  ``remat2``, ``custom_jvp_call``, ``custom_vjp_call``) recurse into their programs; calls are
  inlined (the logical program is run, not differentiated again).
"""

from __future__ import annotations

import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._basics import filled, is_sym, operand_avals, sub_jaxprs
from ._basics import PLAIN, Known
from ._core import eval_closed, fill_tail, take_rows
from ._registry import NoRule, deffacts, defrule, lookup_rule, padded_rule
from ._packed import PackedCtx
from ._sequences import at_column, held, per_sequence, refused, spread


def _scanned_moves(eqn):
    p = eqn.params
    return [(aval, (0,)) for aval in operand_avals(eqn)[p["num_consts"] + p["num_carry"]:]]


@defrule("scan", structural=True, moves=_scanned_moves, moves_rows_why=(
    "a scan over the rows ({rows}) of a value ragged along them (lax.map): each step's row "
    "has no index to read its length by (jax.vmap keeps it)"))
def _scan(ctx, eqn, invals):
    p = eqn.params
    nc, ncarry = p["num_consts"], p["num_carry"]
    consts, init, xs = invals[:nc], invals[nc:nc + ncarry], invals[nc + ncarry:]
    length = p["length"]
    body = p["jaxpr"]
    if not is_sym(length):
        if not ctx.recorder.touched(body):
            return None

        def step(carry, x):
            out = eval_closed(ctx.child(eqn), body, [*consts, *carry, *x], ctx.operands[:nc])
            return out[:ncarry], out[ncarry:]

        carry, ys = lax.scan(step, list(init), list(xs), length=length, reverse=p["reverse"],
                             unroll=p["unroll"])
        return [*carry, *ys]
    rows = ctx.rows_of(length)
    if rows is not None and any(ctx.row_axes(x.shape, rows) for x in (*init, *xs)):
        return _ragged_scan(ctx, eqn, consts, init, xs, rows)
    # A scan over a length axis runs for the logical length only, as a while loop (what
    # lax.scan lowers to anyway): the carry is never touched by the tail, which is not even
    # computed -- cheaper than a padded scan, where a `select` freezing the carry per step
    # measured up to 20% slower on the GRU train step. Reverse scans start at the logical end.
    stop = ctx.length(length)
    ys_avals = [v.aval for v in eqn.outvars[ncarry:]]
    ys0 = [filled(a.shape, 0, a.dtype) for a in ys_avals]

    def cond(state):
        return state[0] < stop

    def loop(state):
        i, carry, ys = state
        at = stop - 1 - i if p["reverse"] else i
        x = [at_step(v, at) for v in xs]
        out = eval_closed(ctx.child(eqn), body, [*consts, *carry, *x], ctx.operands[:nc])
        ys = [_set_step(y, v.astype(y.dtype), at)
              for y, v in zip(ys, out[ncarry:])]
        return i + 1, list(out[:ncarry]), ys

    _, carry, ys = lax.while_loop(cond, loop, (np.int32(0), list(init), ys0))
    ctx.recorder.rewritten.add(id(eqn))
    return [*carry, *ys]


def _ragged_scan(ctx, eqn, consts, init, xs, rows):
    """A scan over a length ragged along ``rows``: positions up to the longest row, each row
    frozen once its own sequence has ended (forward) or not yet begun (reverse: a row's first
    step is its own last position). Inside the body the ended rows are not real rows, so a
    reduction over the rows (a gradient summed over the batch) leaves them out."""
    p = eqn.params
    body, length = p["jaxpr"], p["length"]
    carry_axes = []
    for j, x in enumerate(init):
        axes = ctx.row_axes(x.shape, rows)
        if len(axes) > 1:
            raise NoRule(f"a carry of shape {tuple(x.shape)} has several {rows} axes")
        if not axes and not _invariant_or_per_row(body.jaxpr, p["num_consts"] + j, j, ctx, rows):
            raise NoRule(f"carry {j} of shape {tuple(x.shape)} has no {rows} axis yet "
                          f"changes at every step without "
                          f"reading the rows (a step counter?): with per-row lengths its "
                          f"final value is ambiguous")
        carry_axes.append(axes[0] if axes else None)
    per_row = ctx.per_row(length)
    # Up to the longest real row, never past it: a batch padded to its bucket (as training
    # pads it) still stops where its longest sequence does.
    stop = jnp.max(jnp.where(ctx.row_mask(rows), per_row, 0)).astype(np.int32)
    held = [bool(k.per_row) for k in ctx.operands]       # constants, carries, scanned values
    held_ys = _held_outputs(ctx, eqn, held, rows) if any(held) else ()
    carry, ys, _ = frozen_scan(ctx, eqn, consts, init, xs, carry_axes, stop,
                               alive_at=lambda at: at < per_row, held_ys=held_ys)
    ctx.recorder.rewritten.add(id(eqn))
    ctx.results = [None] * len(carry) + [Known(per_row=rows) if i < len(held_ys) and
                                         held_ys[i] else None for i in range(len(ys))]
    return [*carry, *ys]


def at_step(x, at, axis=0):
    # ``at`` counts steps from 0: no negative index to wrap (a select per index XLA runs at
    # every step of the loop; jax's own scan skips it the same way).
    return lax.dynamic_index_in_dim(x, at, axis, keepdims=False, allow_negative_indices=False)


def _set_step(x, value, at):
    return lax.dynamic_update_index_in_dim(x, value, at, 0, allow_negative_indices=False)


def frozen_scan(ctx, eqn, consts, init, xs, carry_axes, stop, *, alive_at, restart_at=None,
                freeze=True, consts_at=None, init_at=None, keep=(), held_ys=(), paired_at=None,
                held=()):
    """The scan ``eqn`` as a while loop over steps ``0 .. stop - 1`` (from ``stop - 1`` down
    when reversed), for carries with a rows axis (``carry_axes``: its position, None for a
    carry without one): at step ``at`` the rows ``alive_at(at)`` compute, the others keep
    their carry; the rows ``restart_at(at)`` first take their initial carry again (a new
    sequence of a packed row). The body sees ``alive`` in its context, so a reduction over
    the rows there reads the live ones. With ``freeze=False`` the other rows compute too:
    for a caller that never reads their carries (`_packed_scan`). ``consts_at(at)`` and
    ``init_at(at)``, when given, are the constants and the initial carries at step ``at``
    (they differ per step in packed rows). Returns the final carries, the stacked outputs,
    and the carries after every step for those ``keep`` marks (None for the others).
    Ragged rows: constants and scanned values may be held per row (`Known.per_row`, by their
    operands' position), and so are the outputs per step that ``held_ys`` names
    (`_held_outputs`), stacked per row; a carry or another output that turns out per row
    raises `_NotHeld`.
    Packed rows: ``paired_at(at)`` (`PackedCtx.paired`) pairs each step's cell with another
    packed length's cells of its example; the carries ``held`` marks (that length's cells:
    the gradient of an encoder's states read at every decoder step) never restart, and keep
    their value outside the step's pairs, so each example's cells change at its own steps."""
    p = eqn.params
    ncarry, body = p["num_carry"], p["jaxpr"]
    held = list(held) or [False] * ncarry
    # A constant held per sequence is read at each step's column (``consts_at``): plain there.
    consts_known = [PLAIN if k.per_sequence else k for k in ctx.operands[:len(consts)]]
    xs_known = [Known(per_row=k.per_row, below=k.below) if k.per_row else PLAIN
                for k in ctx.operands[len(consts) + len(init):]]
    ys0 = [filled(v.aval.shape, 0, v.aval.dtype) for v in eqn.outvars[ncarry:]]
    if held_ys:
        held_rows = next(k.per_row for k in ctx.operands if k.per_row)
        n = ctx.rows_vector_shape(held_rows)
        ys0 = [filled((*n, *y.shape), 0, y.dtype) if h else y for y, h in zip(ys0, held_ys)]
    ys0 += [filled((p["length"], *jnp.shape(c)), 0, c.dtype)
            for c, k in zip(init, keep) if k]

    def by_rows(mask, value, other, axis):
        return lax.select(lax.broadcast_in_dim(mask, jnp.shape(value), (axis,)), value, other)

    def loop(state):
        i, carry, ys = state
        at = stop - 1 - i if p["reverse"] else i
        alive = alive_at(at)
        if restart_at is not None:
            restart = restart_at(at)
            carry = [c if a is None or h else by_rows(restart, c0, c, a)
                     for c, c0, a, h in zip(carry, init if init_at is None else init_at(at),
                                            carry_axes, held)]
        x = [at_step(v, at, 1 if k.per_row else 0) for v, k in zip(xs, xs_known)]
        here = consts if consts_at is None else consts_at(at)
        child = (ctx.child(eqn, alive=alive) if paired_at is None else
                 ctx.child(eqn, alive=alive, paired=paired_at(at)))
        out = eval_closed(child, body, [*here, *carry, *x],
                          [*consts_known, *[PLAIN] * len(carry), *xs_known])
        held_out = [k is not None and bool(k.per_row) for k in child.results]
        if any(k is not None and k.per_sequence for k in child.results):
            raise NoRule("a scan's step makes a value per sequence of another length")
        if any(held_out[:ncarry]):
            raise _NotHeld("a carry without a rows axis turns per row")
        new = [n if a is None or not freeze else by_rows(alive, n, old, a)
               for n, old, a in zip(out[:ncarry], carry, carry_axes)]
        new = [lax.select(child.frame(jnp.shape(n)), n, old) if h else n
               for n, old, h in zip(new, carry, held)]
        kept = [n for n, k in zip(new, keep) if k]
        ys = [_set_held_step(y, v, at, h) if j < len(held_ys) and held_ys[j]
              else _set_step(y, _plain(v, h).astype(y.dtype), at)
              for j, (y, v, h) in enumerate(zip(ys, [*out[ncarry:], *kept],
                                                [*held_out[ncarry:], *[False] * len(kept)]))]
        return i + 1, new, ys

    _, carry, ys = lax.while_loop(lambda s: s[0] < stop, loop, (np.int32(0), list(init), ys0))
    n_ys = len(eqn.outvars) - ncarry
    kept = iter(ys[n_ys:])
    return carry, ys[:n_ys], [next(kept) if k else None for k in keep]


class _NotHeld(Exception):
    """A scan's body made a value per row where `_held_outputs` did not foresee one: the scan
    runs once per row instead (`_eval_row_varying`)."""


def _plain(v, held: bool):
    if held:
        raise _NotHeld("an output per step turns per row")
    return v


def _set_held_step(y, v, at, held: bool):
    """Step ``at`` of an output stacked per row (rows first): a value held per row
    (``held``), or one for all rows."""
    v = v if held else lax.broadcast_in_dim(
        v, (y.shape[0], *jnp.shape(v)), tuple(range(1, 1 + jnp.ndim(v))))
    return lax.dynamic_update_index_in_dim(y, v.astype(y.dtype), at, 1,
                                           allow_negative_indices=False)


def _held_outputs(ctx, eqn, held, rows) -> list[bool]:
    """Which outputs per step of a scan's body are per row: those without a ``rows`` axis
    made from an input held per row (``held``, by position: constants, carries, scanned
    values) or from a ragged length read as a number (``x.shape[1]``), as the interpreter
    collapses a per-row value onto the rows axis of the first result that has one."""
    jaxpr = eqn.params["jaxpr"].jaxpr
    per_row = {v for v, h in zip(jaxpr.invars, held) if h}
    for e in jaxpr.eqns:
        reads = any(not isinstance(v, jax.extend.core.Literal) and v in per_row
                    for v in e.invars)
        if reads or (e.primitive.name == "dim_as_value" and ctx.rows_of(e.params["dim"]) == rows):
            per_row.update(v for v in e.outvars if not ctx.row_axes(v.aval.shape, rows))
    return [v in per_row for v in jaxpr.outvars[eqn.params["num_carry"]:]]


def _scan_held(ctx, eqn, invals):
    """A scan over a length ragged along rows that reads a value held per row (`Known.per_row`):
    ``x.shape[1]`` as a number, which JAX's indexing reads to normalise ``x[:, t]`` in a scan
    over ``jnp.arange(x.shape[1])``, or a scanned index made from it. The ragged scan hands
    it to the body as it is (an index held per row reads each row's own position) and stacks
    an output per step that is per row per row -- where running the whole scan once per row
    does B times the work, and loses a carry summed over the rows (a weight's gradient).
    None for any other scan, which does run once per row."""
    p = eqn.params
    nc, ncarry = p["num_consts"], p["num_carry"]
    consts, init, xs = invals[:nc], invals[nc:nc + ncarry], invals[nc + ncarry:]
    rows = ctx.rows_of(p["length"]) if is_sym(p["length"]) else None
    held = [k.per_row for k in ctx.operands]
    if (rows is None or any(held[nc:nc + ncarry]) or any(r and r != rows for r in held)
            or not any(ctx.row_axes(jnp.shape(x), rows)
                       for x, r in zip(invals[nc:], held[nc:]) if not r)):
        return None
    try:
        return _ragged_scan(ctx, eqn, consts, init, xs, rows)
    except (_NotHeld, NoRule):
        return None


deffacts("scan", row_varying=_scan_held)


def _invariant_or_per_row(jaxpr, invar: int, outvar: int, ctx, rows) -> bool:
    """Whether a carry without a rows axis stays the same, or its new value reads some value
    with a rows axis (then it gathers over the rows, and the ended ones are masked there)."""
    if jaxpr.outvars[outvar] is jaxpr.invars[invar]:
        return True
    seen = {v for v in jaxpr.invars if ctx.row_axes(getattr(v.aval, "shape", ()), rows)}
    for eqn in jaxpr.eqns:
        if any(v in seen for v in eqn.invars if not isinstance(v, jax.extend.core.Literal)) or \
                any(ctx.row_axes(getattr(v.aval, "shape", ()), rows) for v in eqn.outvars):
            seen.update(eqn.outvars)
    return jaxpr.outvars[outvar] in seen


@defrule("while", structural=True)
def _while(ctx, eqn, invals):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
    if not ctx.recorder.touched(p["cond_jaxpr"]) and not ctx.recorder.touched(p["body_jaxpr"]):
        # Length-axis carries with no length-sensitive operation inside: per position.
        return None

    def run(key, consts, known_consts, c, known):
        """The condition's or the body's outputs, and their annotations."""
        child = ctx.child(eqn)
        out = eval_closed(child, p[key], [*consts, *c], [*known_consts, *known])
        return out, child.results

    def pred(c, known=()):
        (ok,), (k,) = run("cond_jaxpr", cconsts, ctx.operands[:cn], c, known)
        return ok, k

    def body(c, known=()):
        return run("body_jaxpr", bconsts, ctx.operands[cn:cn + bn], c, known)

    if not eqn.params["cond_jaxpr"].out_avals[0].shape:
        # Only ragged rows give a per-row condition; the probe traces it once more, outside.
        _, probe = pred(list(init), ctx.operands[cn + bn:]) if ctx.rows else (None, None)
        if probe is not None and probe.per_row:
            return _per_row_while(ctx, eqn, pred, body, init, probe.per_row)
        return list(lax.while_loop(lambda c: pred(c)[0], lambda c: body(c)[0], list(init)))
    # A batched predicate (``jax.vmap`` of a while whose condition reads the batched values):
    # one predicate per lane, over the carries' leading axes; the loop runs while any lane
    # does and a lane's carries stop changing once its predicate is false, as JAX lowers it.
    # The lanes beyond a logical length are made false, so padding (NaN, inf) can neither
    # keep the loop running -- forever, for a condition like ``~(c >= x)`` -- nor count.
    def lanes(c):
        live, _ = pred(c)
        return fill_tail(ctx, live, range(live.ndim), False)

    def step(c):
        live, (new, _) = lanes(c), body(c)
        return [lax.select(lax.broadcast_in_dim(live, jnp.shape(n), tuple(range(live.ndim))),
                           n, old) for n, old in zip(new, c)]

    return list(lax.while_loop(lambda c: jnp.any(lanes(c)), step, list(init)))


def _per_row_while(ctx, eqn, pred, body, init, rows):
    """A while loop whose condition differs per row (``t < x.shape[1]`` with lengths ragged
    along ``rows``): each row loops until its own condition fails, as ``jax.vmap`` of the loop
    over the rows would at each row's exact length. Every carry is held per row -- one
    without a rows axis (the step counter) with the rows in front (`Known.per_row`), since it
    ends at each row's own value -- and a row whose condition is false keeps its carries
    while the others go on. Rows that are not real (padding a batch to its bucket) never
    run."""
    held = [not ctx.row_axes(jnp.shape(x), rows) for x in init]
    known = [Known(per_row=rows) if h else PLAIN for h in held]
    n = ctx.rows_vector_shape(rows)

    def per_row(x, k):
        if k is not None and k.per_row:
            return x
        return lax.broadcast_in_dim(x, (*n, *jnp.shape(x)), tuple(range(1, 1 + jnp.ndim(x))))

    def unwrap(values, ks):
        return [per_row(x, k) if h else x for x, k, h in zip(values, ks, held)]

    def live(state):
        ok = per_row(*pred(state, known))
        real = ctx.row_mask(rows)
        return ok if real is None else lax.bitwise_and(ok, real)

    def step(state):
        keep = live(state)
        new = unwrap(*body(state, known))
        out = []
        for x, old, h in zip(new, state, held):
            axis = 0 if h else ctx.row_axes(jnp.shape(x), rows)[0]
            out.append(lax.select(lax.broadcast_in_dim(keep, jnp.shape(x), (axis,)), x, old))
        return out

    final = lax.while_loop(lambda s: jnp.any(live(s)), step,
                           unwrap(list(init), [PLAIN] * len(init)))
    ctx.recorder.rewritten.add(id(eqn))
    ctx.results = known
    return final


@defrule("cond", structural=True)
def _cond(ctx, eqn, invals):
    branches = eqn.params["branches"]
    if not any(ctx.recorder.touched(b) for b in branches):
        return None
    index, *ops = invals
    fns = [functools.partial(lambda br, *a: eval_closed(ctx.child(eqn), br, a), br)
           for br in branches]
    return list(lax.switch(index, fns, *ops))


def _call(key):
    def rule(ctx, eqn, invals):
        # Inlined: the logical program is exported and run, never differentiated again, so
        # custom derivative rules have nothing left to do.
        child = ctx.child(eqn)
        outs = eval_closed(child, eqn.params[key], invals, ctx.operands)
        ctx.results = child.results    # what it made from lengths or positions alone
        return outs
    return rule


# Inline: per-row values flow through a call's equations as through any other equations.
defrule("jit", "pjit", "remat2", "checkpoint", structural=True, inline=True)(_call("jaxpr"))
defrule("closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", structural=True,
        inline=True)(_call("call_jaxpr"))
defrule("custom_vjp_call_jaxpr", structural=True, inline=True)(_call("fun_jaxpr"))

# --------------------------------------------------------------------------------------------
# Packed rows (``layout="pack"``, its per-cell and per-sequence values): the same primitives'
# rules over rows that hold several sequences (`_packed` is the layout's machinery).


@defrule("while", layout=("pack", "per_sequence"))
def _while_packed(ctx: PackedCtx, eqn, invals):
    raise NoRule("a while_loop or fori_loop over packed rows: its trip count (a loop over "
                  "x.shape[1]) or its carry differs per sequence, and the sequences sharing a "
                  "packed row would need different trip counts in one loop; a scan over the "
                  "length, lax.scan(step, h, jnp.swapaxes(x, 0, 1)), packs")


@defrule("scan", layout=("pack", "per_sequence"))
def _scan_packed(ctx: PackedCtx, eqn, invals):
    p = eqn.params
    nc, ncarry = p["num_consts"], p["num_carry"]
    consts, init, xs = invals[:nc], invals[nc:nc + ncarry], invals[nc + ncarry:]
    length = p["length"]
    has_rows = [bool(ctx.row_axes(v.aval.shape)) for v in eqn.invars[nc:]]
    var = ctx.var_of(length)
    if var is None or not any(has_rows):
        if any(k.per_sequence for k in ctx.operands):
            raise NoRule("a scan over another length than the packed one reads a "
                          "per-sequence value")
        return padded_rule(eqn)(ctx, eqn, invals)
    with ctx.asking_in(var):
        return _packed_scan(ctx, eqn, consts, init, xs)


def _packed_scan(ctx: PackedCtx, eqn, consts, init, xs):
    """A scan over a packed length: every column once, up to the last real cell. At each
    sequence's first step (its last, for a reverse scan) the row's carry restarts from its
    initial value; ``alive`` marks the rows whose cell is real, so a gradient summed over the
    rows inside the body reads those only. Outside the frame the carry runs on, not frozen:
    every real cell restarts its sequence or follows a real cell of it (freezing it cost the
    GRU train step 9%). A per-sequence initial carry or constant (an encoder's state, the
    gradient of a final carry) is read at each step's column; a final carry that is read is
    each sequence's own, kept from the step that ends it."""
    p = eqn.params
    body, length, nc = p["jaxpr"], p["length"], p["num_consts"]
    shapes = [tuple(v.aval.shape) for v in eqn.invars]
    const_shapes, init_shapes = shapes[:nc], shapes[nc:nc + len(init)]
    known = ctx.operands
    const_known, init_known = known[:nc], known[nc:nc + len(init)]
    if any(k.per_sequence and k.sequence_axis is None for k in known[:nc + len(init)]) or any(
            k.per_sequence for k in known[nc + len(init):]):
        raise NoRule("a scan over a packed length reading a per-sequence number")
    if any(not ctx.row_axes(x.shape[1:]) for x in xs):
        raise NoRule("a scan over a packed length whose scanned input has no rows axis (a "
                     "loop over the positions, jnp.arange(T) or a fori_loop to x.shape[1], "
                     "reading x[:, t]: the sequences sharing a packed row are at other "
                     "positions at each step); a scan over the length's values, "
                     "lax.scan(step, h, jnp.swapaxes(x, 0, 1)), packs")
    # Another packed length's cells (a decoder's scan reading its encoder's (B, S, H)) pair
    # with each step's cell: its example's cells only (`PackedCtx.paired`). The scan's own
    # length's cells would be the whole sequence at each of its steps.
    step_shapes = [*const_shapes, *init_shapes, *(tuple(x.shape[1:]) for x in xs)]
    others = {ctx.var_of(s[a]) for s in step_shapes if ctx.row_axes(s)
              for a in ctx.packed_axes(s)}
    if ctx.var in others or any(ctx.packed_axes(s) and not ctx.row_axes(s)
                                for s in step_shapes):
        raise NoRule("a scan over a packed length that reads a whole packed value at each step")
    held_carries = [bool(ctx.packed_axes(s)) for s in init_shapes]
    carry_axes = []
    for j, shape in enumerate(init_shapes):
        axes = ctx.row_axes(shape)
        if len(axes) > 1:
            raise NoRule(f"a carry of shape {shape} has several rows axes")
        if not axes and not _accumulates(body.jaxpr, nc + j, j, ctx):
            raise NoRule(f"carry {j} of shape {shape} has no rows axis and changes by "
                          f"more than a sum over the rows (a step counter, a value the rows "
                          f"update in turn): over packed rows its steps are not any "
                          f"sequence's")
        carry_axes.append(axes[0] if axes else None)
    in_frame = ctx.in_frame(length)                       # (rows, columns)
    pos, seglen = ctx.cells(length)
    first = in_frame & ((pos == ctx.at_lengths(length, seglen) - 1) if p["reverse"] else (pos == 0))
    columns = lax.broadcasted_iota(np.int32, jnp.shape(in_frame), 1)
    stop = jnp.max(jnp.where(in_frame, columns + 1, 0), initial=0).astype(np.int32)

    def at(values, known):
        if not any(k.per_sequence for k in known):
            return None
        return lambda step: [at_column(v, k.sequence_axis, step) if k.per_sequence else v
                             for v, k in zip(values, known)]

    starting = [at_column(c, k.sequence_axis, 0) if k.per_sequence else c
                for c, k in zip(init, init_known)]
    keep = [a is not None and not h and v in ctx.recorder.used
            for a, h, v in zip(carry_axes, held_carries, eqn.outvars)]
    paired_at = None
    if others:
        current = _step_mask(jnp.where(in_frame, ctx.sequence_index(length), -1))
        paired_at = lambda at: {v: current(at) for v in others}  # noqa: E731
    carry, ys, steps = frozen_scan(
        ctx, eqn, consts, starting, xs, carry_axes, stop,
        alive_at=_step_mask(in_frame), restart_at=_step_mask(first), freeze=False,
        consts_at=at(consts, const_known), init_at=at(init, init_known), keep=keep,
        paired_at=paired_at, held=held_carries)
    final, unread, held_at = [], [], {}
    for c, c0, k, shape, a, kept, h in zip(carry, init, init_known, init_shapes, carry_axes,
                                           steps, held_carries):
        if a is None or h:          # no rows, or another length's cells: as they are
            final.append(c)
        elif kept is None:          # never read: no per-sequence copy, not packed
            unread.append(len(final))
            final.append(None)
        else:
            initial, held_at[len(final)] = held(ctx, c0, shape, k)
            final.append(_final_carry(ctx, kept, initial, held_at[len(final)], length,
                                      p["reverse"]))
    if unread:
        ctx.refuse_per_sequence(eqn, "the final carry of a scan", unread)
    results = ctx.results or [None] * len(eqn.outvars)
    ctx.results = [per_sequence(held_at[i], ctx.var) if i in held_at else k
                   for i, k in enumerate(results)]
    return [*final, *ys]


def _step_mask(mask):
    """A ``(rows, columns)`` bool mask as a function of the step ``at`` (a column): stored
    as ``(columns, rows)``, each step reads one contiguous row of it, where a column of the
    ``(rows, columns)`` array is a strided read -- one kernel less in the packed GRU's
    forward loop."""
    by_step = mask.T
    return lambda at: at_step(by_step, at)


def _final_carry(ctx: PackedCtx, steps, initial, a: int, length, reverse: bool):
    """Each sequence's final carry, held per sequence along its rows axis ``a``: the carry
    after its last step (its first, reversed), read from the carries after every step
    (``steps``, stacked on a leading axis); a sequence with no step (length 0, or 1 over
    ``T - 1``) keeps its ``initial`` carry (held per sequence)."""
    steps = jnp.moveaxis(steps, 0, a + 1)            # each row's carry after each column
    count = ctx.at_lengths(length, ctx.seglen)              # (rows, columns): each sequence's steps
    start = ctx.sequence_starts()
    last = start if reverse else start + count - 1
    shape = list(steps.shape)
    shape[a + 1] = ctx.pos.shape[1]
    got = take_rows(ctx, steps, spread(jnp.maximum(last, 0), shape, (a, a + 1)), a + 1)
    ran = spread(count > 0, got.shape, (a, a + 1))
    return lax.select(ran, got, initial)


def _accumulates(jaxpr, invar: int, outvar: int, ctx: PackedCtx) -> bool:
    """Whether a carry without a rows axis is left alone or grows by a sum over the rows that
    does not read it (``ct_w + x.T @ g``: a weight gradient of a scan's transpose). Then the
    order in which cells are visited does not matter, and the frozen rows add nothing."""
    out, inv = jaxpr.outvars[outvar], jaxpr.invars[invar]
    if out is inv:
        return True
    made = {v: e for e in jaxpr.eqns for v in e.outvars}
    eqn = made.get(out)
    if eqn is None or eqn.primitive.name not in ("add", "add_any"):
        return False
    carried = [v for v in eqn.invars if _is_carry(v, inv, made)]
    if len(carried) != 1:
        return False
    (other,) = [v for v in eqn.invars if v is not carried[0]] or [None]
    if other is None or _reads(other, inv, made):
        return False
    while True:
        e = made.get(other)
        if e is None:
            return False
        entry = lookup_rule(e.primitive)
        if entry is not None and entry.sums_rows is not None and entry.sums_rows(
                e, ctx.row_axes):
            return True
        called = _called(e)
        if called is not None:
            # Inside a call (``jax.checkpoint`` of the step: the backward scan adds the
            # weight gradient the recomputing call returns): follow the call's own output.
            made = {v: inner for inner in called.eqns for v in inner.outvars}
            other = called.outvars[e.outvars.index(other)]
            continue
        if entry is None or not entry.carries:
            return False
        other = e.invars[0]


def _called(eqn):
    """The program of a call-like equation (``jit``, ``remat2``, ``closed_call``...: one
    sub-program whose outputs are the equation's), None for any other."""
    entry = lookup_rule(eqn.primitive)
    programs = list(sub_jaxprs(eqn.params))
    if (entry is None or not entry.inline or len(programs) != 1
            or len(programs[0].outvars) != len(eqn.outvars)):
        return None
    return programs[0]


def _is_carry(v, inv, made) -> bool:
    """Whether ``v`` is the carry ``inv`` itself, or it cast (a Python ``0.0`` initial carry
    is weakly typed: the body converts it before adding)."""
    while v is not inv:
        e = made.get(v) if not isinstance(v, jax.extend.core.Literal) else None
        if e is None or e.primitive.name not in ("convert_element_type", "copy", "copy_p"):
            return False
        v = e.invars[0]
    return True


def _reads(v, target, made) -> bool:
    seen, stack = set(), [v]
    while stack:
        u = stack.pop()
        if u is target:
            return True
        if id(u) in seen or u not in made:
            continue
        seen.add(id(u))
        stack.extend(w for w in made[u].invars if not isinstance(w, jax.extend.core.Literal))
    return False


defrule("cond", "custom_linear_solve", layout="per_sequence")(refused)
