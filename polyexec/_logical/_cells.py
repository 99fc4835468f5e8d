"""Per-cell values of packed rows (``layout="pack"``): a value without the rows axis that
differs per sequence all the same (`Known.per_cell`: a per-sequence number meeting positions,
``jnp.arange(T) / T``), held with the rows axis in front so cell ``(r, c)`` of a packed length
holds the entry of the sequence there, at its position; and per-position values (``pe[:T]``,
a causal mask) placed into the rows by each cell's position (`by_position`), or recomputed
there when made from positions alone (`positions_recipe`). The packed layout's machinery
(`_packed.PackedCtx`) asks these; their rules (``layout="per_cell"``) are in each primitive's
family module.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from jax import lax

from ._basics import PLAIN, Known, bind_eqn, is_sym, same_dim
from ._registry import ELEMENTWISE, NoRule, lookup_rule
from ._sequences import spread



def per_cell(ctx, eqn, invals):
    """An equation reading a per-cell value (or making one: `PackedCtx.without_rows`):
    a call runs its equations; a primitive with a per-cell rule (``defrule(...,
    layout="per_cell")``: a broadcast, a reverse, an index) runs it; elementwise maths stays
    per cell; anything else is refused."""
    name = eqn.primitive.name
    entry = lookup_rule(eqn.primitive)
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
    out = tuple(eqn.outvars[0].aval.shape)
    if entry is not None and entry.inline:
        return entry.rule(ctx, eqn, invals)       # a call: its equations meet the value
    if entry is not None and entry.per_cell is not None:
        out_values = entry.per_cell(ctx, eqn, invals)
        if out_values is not None:
            return out_values
    if entry is not None and entry.rule is ELEMENTWISE:
        rows = ctx.row_axes(out)
        if not rows:
            cells = [onto_cells(ctx, x, sh, out, k)
                     for x, sh, k in zip(invals, shapes, ctx.operands)]
            return ctx.held_per_cell([bind_eqn(eqn, cells)[0]])
        # jnp's implicit broadcast: a (1, T) operand beside (B, T) ones -- onto the rows.
        (r,) = rows
        return ctx.evaluate(eqn, [_onto_rows(x, r) if k.per_cell else x
                                  for x, k in zip(invals, ctx.operands)],
                            [PLAIN if k.per_cell else k for k in ctx.operands])
    raise NoRule(f"{name} of a value that differs per sequence and per position (it has no "
                  f"rows axis)")


def onto_cells(ctx, x, shape, out, known: Known):
    """An operand (annotated ``known``) of an elementwise per-cell equation of logical
    ``out``, with the rows in front: a per-sequence number at each cell, a per-position value
    placed by position."""
    if known.per_cell:
        return x
    packed = ctx.packed_axes(out)
    rows = ctx.pos.shape[0]
    if known.per_sequence:
        if known.sequence_axis is not None or shape != () or len(packed) != 1:
            raise NoRule(f"a per-sequence value meets a value of shape {out}")
        v = lax.slice_in_dim(x, 0, out[packed[0]], axis=1)
        return spread(v, (rows, *out), (0, 1 + packed[0]))
    if shape == ():
        return x
    if (not ctx.row_axes(shape) and len(shape) == len(out)
            and all(not is_sym(d) and d == 1 for d in shape)):
        # jnp's broadcast of a unit axis (linspace's start, ``(1,)``, times ``T - 1``
        # positions): the same at every cell.
        return jnp.broadcast_to(jnp.reshape(x, (1, *shape)), (rows, *out))
    if ctx.row_axes(shape) or not same_shape(shape, out):
        raise NoRule(f"a per-cell value meets a value of shape {shape}")
    return by_position(ctx, x, tuple(range(1, len(out) + 1)), (rows, *out), 0,
                        [1 + p for p in packed])


def same_shape(a, b) -> bool:
    return len(a) == len(b) and all(same_dim(x, y) for x, y in zip(a, b))


def _onto_rows(x, r: int):
    """A per-cell value whose logical axis ``r`` is a unit one, as a packed value with its
    rows there."""
    return jnp.moveaxis(lax.squeeze(x, (1 + r,)), 0, r)


# Integer and boolean maths, as cheap to recompute per cell as a gather would be to read: a
# value made from positions with them (a causal mask, ``pos[:, None] >= pos[None, :]``)
# becomes one compare per cell of the scores, fused into their select as hand-written
# segment ids are; gathered, its placement cost the packed attention step two gathers over
# ``(B, H, T, T)``. Transcendental maths (a sinusoidal table) stays gathered.


def positions_recipe(eqn, reading) -> Callable | None:
    """``Known.positions`` of ``eqn``'s output from its inputs' (``reading``: value and
    annotation each): an ``iota``, or maths stated `Entry.positional`, a broadcast or a transpose of
    values made from positions and scalars."""
    name, params = eqn.primitive.name, eqn.params
    if name == "iota":
        dim, dtype = params["dimension"], params["dtype"]
        return lambda index: index[dim].astype(dtype)
    inputs = []
    for x, known in reading:
        if known.positions is not None:
            inputs.append(known.positions)
        elif getattr(x, "shape", None) == ():      # a scalar (a held value has no shape)
            inputs.append(lambda index, x=x: x)
        else:
            return None
    if name == "broadcast_in_dim" and len(inputs) == 1:
        (inner,), src = inputs, eqn.invars[0].aval.shape
        out = params["shape"]
        dims = params["broadcast_dimensions"]
        return lambda index: inner(tuple(
            np.int32(0) if not same_dim(src[k], out[d]) else index[d]
            for k, d in enumerate(dims)))
    if name == "transpose":
        (inner,), perm = inputs, params["permutation"]
        return lambda index: inner(tuple(index[perm.index(k)] for k in range(len(perm))))
    entry = lookup_rule(eqn.primitive)
    if entry is not None and entry.positional:
        return lambda index: eqn.primitive.bind(
            *jnp.broadcast_arrays(*(f(index) for f in inputs)), **params)
    return None


def by_position(ctx, x, dims, shape, rows_axis: int, packed_axes):
    """A per-position value (``pe[:T]``, a causal mask ``(T, T)``; no rows axis; its axes go
    to ``dims`` of ``shape``) into packed rows: each cell reads its own positions inside its
    sequence along ``packed_axes`` (one or two of them)."""
    first, *rest = packed_axes
    k = dims.index(first)
    pos, _ = ctx.cells(shape[first])
    x = jnp.take(x, jnp.clip(pos, 0, ctx.physical(x.shape[k]) - 1), axis=k, mode="clip")
    targets = [*dims[:k], rows_axis, first, *dims[k + 1:]]
    for t in rest:                     # the second axis: by the position in the same row
        a, b = targets.index(t), targets.index(rows_axis)
        pos, _ = ctx.cells(shape[t])
        index = jnp.clip(pos, 0, ctx.physical(x.shape[a]) - 1)
        index = jnp.expand_dims(index.T if a < b else index,
                                [i for i in range(x.ndim) if i not in (a, b)])
        x = jnp.take_along_axis(x, index, axis=a, mode="clip")
    return spread(x, shape, targets)
