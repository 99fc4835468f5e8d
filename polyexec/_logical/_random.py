"""Rules for random draws shaped by a length (``random_bits``: dropout, ``jax.random.uniform``,
``normal``, ``bernoulli`` of ``x.shape``, typed keys and raw ``PRNGKey`` ones alike).

The contract (DESIGN.md): every real cell draws, bit for bit, what ``jax.jit`` draws on the
exact-size input -- the call's arrays cut to their real sizes, each ragged axis at its longest
row. JAX's default PRNG makes that possible: under ``jax_threefry_partitionable`` (on by
default since JAX 0.5) cell ``i`` of ``random_bits(key, shape)`` is ``threefry2x32(key, (hi,
lo))`` of ``i``'s flat row-major index in ``shape`` and of nothing else. The rewrite knows each
real cell's index along every axis (the logical positions come first, padding after them; in
packed rows, the cell's sequence's index in the call and its position there) and each axis's
exact-size extent, so it computes the flat index ``jax.jit`` would see and draws threefry at
it. Then a real cell's bits are also the same in every bucket and layout: the same example gets
the same dropout mask wherever it runs. A shape whose only length is its leading axis (``(T,
F)``) has that flat index already at every real cell, in any bucket, so JAX's own draw stands.
Padding cells draw something too; no result reads them (the rewrite's masks keep the padding
out, as for any value).

A draw that cannot equal ``jax.jit``'s raises `NoRule`, a verdict naming the user's line:
partitionable threefry turned off (the bits of every cell then depend on the whole shape's
size), another key implementation (an RBG key's bits come from XLA's RngBitGenerator over the
whole shape), or more than 2**32 cells (the counter's high word; never met in practice).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p

from .._jax_internals import dim_bounds, dim_vars
from ._basics import has_sym, is_sym
from ._registry import ELEMENTWISE, NoRule, defrule, padded_rule
from ._sequences import grid_shape, spread

_UINT = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}


def _exact_draws_only(key, shape) -> None:
    """Raise `NoRule` unless a per-cell counter reproduces JAX's draw of ``shape``."""
    if not hasattr(key, "dtype"):
        raise NoRule(f"a random draw of shape {shape} with a key held per row or sequence")
    impl = str(jax.random.key_impl(key))
    if impl != "threefry2x32":
        raise NoRule(f"a random draw along a length with a {impl!r} key: its bits depend on "
                     f"the whole shape, so the bucket changes them; use a threefry key "
                     f"(jax.random.key(seed), the default) to draw what jax.jit draws")
    if not jax.config.jax_threefry_partitionable:
        raise NoRule("a random draw along a length with jax_threefry_partitionable off: every "
                     "cell's bits then depend on the whole shape's size, so the bucket "
                     "changes them; leave the flag at its default (True) to draw what "
                     "jax.jit draws")
    cells = math.prod(dim_bounds(d)[1] if is_sym(d) else int(d) for d in shape)
    if not cells < 2 ** 32:
        raise NoRule(f"a random draw of shape {shape}, up to {cells} cells: over 2**32 cells "
                     f"the counter's high word is not computed per cell")


def _flat_index(index, extents):
    """uint32: each cell's row-major flat index in a shape of ``extents`` (ints or int32
    tracers), from ``index``, its index along each axis (arrays broadcasting together)."""
    flat, stride = None, None
    for i, n in zip(reversed(index), reversed(extents)):
        term = lax.convert_element_type(i, np.uint32)
        if stride is not None:
            term = term * stride
        flat = term if flat is None else flat + term
        n = lax.convert_element_type(n, np.uint32)
        stride = n if stride is None else stride * n
    return flat


def _draw_at(eqn, key, counts):
    """``eqn``'s ``random_bits`` with each cell's counter given (uint32 ``counts``, the cells'
    flat indices, below 2**32: the high word is 0): JAX's partitionable threefry at that
    index, the bit widths combined as JAX combines them. A batch of keys (a key array of shape
    ``K``) draws per key, ``K`` in front, as JAX's batching of the primitive does."""
    def one_key(data):          # data: uint32[2]
        return _bits(eqn, *(jnp.broadcast_to(data[i], counts.shape) for i in (0, 1)), counts)

    draw = one_key
    for _ in range(key.ndim):
        draw = jax.vmap(draw)
    return draw(jax.random.key_data(key))


def _bits(eqn, k1, k2, counts):
    """Threefry of each cell's key words ``k1, k2`` at its counter, the bit widths combined as
    JAX combines them (all uint32 of one shape)."""
    bit_width = eqn.params["bit_width"]
    dtype = _UINT[bit_width]
    bits1, bits2 = threefry2x32_p.bind(k1, k2, jnp.zeros_like(counts), counts)
    if bit_width == 64:
        return (lax.shift_left(lax.convert_element_type(bits1, dtype), dtype(32))
                | lax.convert_element_type(bits2, dtype))
    return lax.convert_element_type(bits1 ^ bits2, dtype)


# Per key: a key array's i-th key (folded with the i-th message, wrapped from the i-th data,
# seeded from the i-th seed) is made from its own inputs alone, so a key per position of a
# length (``jax.vmap`` of ``fold_in(key, t)`` over ``jnp.arange(T)``) or per row is the same
# key in every bucket.
defrule("random_fold_in", "random_wrap", "random_unwrap", "random_seed")(ELEMENTWISE)


@defrule("random_split")
def _random_split(ctx, eqn, invals):
    """``random_split(key, shape)``: key ``i`` is threefry at ``i``'s flat index in
    ``shape``, exact in any bucket when only the leading axis has a length (``split(key, B)``,
    a key per row); further length axes would move the flat index, so refused. Each key of a
    key array splits on its own."""
    (key,) = invals
    shape = tuple(eqn.params["shape"])
    if not has_sym(shape):
        return None
    _exact_draws_only(key, shape)
    if has_sym(shape[1:]):
        raise NoRule(f"a split of a key into {shape} keys: a length past the first axis moves "
                     f"each key's index with the bucket; split into ({shape[0]}, ...) and "
                     f"reshape after")
    return None


@defrule("random_split", layout="pack")
def _random_split_packed(ctx, eqn, invals):
    """``split(key, B)`` over packed rows (equinox's per-example keys for ``jax.vmap``): a
    key per sequence, held at every cell of it (`Known.per_sequence`): key ``b`` is threefry of the
    key at counter ``b``, the sequence's index in the call, as its padded row's key. Keys of
    no rows (``split(key, T)``, a key per position) are the padded rule's."""
    (key,) = invals
    shape = tuple(eqn.params["shape"])
    out = tuple(eqn.outvars[0].aval.shape)
    if not ctx.row_axes(out):
        return padded_rule(eqn)(ctx, eqn, invals)
    _exact_draws_only(key, shape)
    if key.ndim or str(shape[0]) != ctx.rows_name or has_sym(shape[1:]):
        raise NoRule(f"a split of a key into {shape} keys over packed rows: one key a "
                     f"sequence ({ctx.rows_name}, ...) from one key is placed by sequence")
    held_shape = grid_shape(ctx, shape, 0)
    index = [spread(ctx.sequence_index(held_shape[1]), held_shape, (0, 1)),
             *[lax.broadcasted_iota(np.int32, held_shape, a + 1) for a in range(1, len(shape))]]
    counts = _flat_index(index, [ctx.exact_extent(d) for d in shape])
    data = jax.random.key_data(key)
    k1, k2 = (jnp.broadcast_to(data[i], held_shape) for i in (0, 1))
    bits = threefry2x32_p.bind(k1, k2, jnp.zeros_like(counts), counts)
    return ctx.held_per_sequence([jax.random.wrap_key_data(
        jnp.stack(bits, -1), impl=jax.random.key_impl(key))], [0])


@defrule("random_bits")
def _random_bits(ctx, eqn, invals):
    """``random_bits(key, shape)`` with length axes in ``shape``: cell ``i`` draws threefry at
    its flat index in the exact-size shape, the strides the axes' real extents (a ragged axis
    at its longest row). For ``(B, T, F)`` cell ``(b, t, f)`` draws at ``(b * T_real + t) * F +
    f``, as ``jax.jit`` on the exact-size input does."""
    (key,) = invals
    shape = tuple(eqn.params["shape"])
    if not has_sym(shape):
        return None                 # per key: each key's draw is its own already
    _exact_draws_only(key, shape)
    for d in shape:
        rows = ctx.rows_of(d)
        if rows is not None and rows in dim_vars(d):
            # Logically the real cells of ragged rows lie end to end along ``B*T``; jax.jit's
            # exact-size array spaces them by the longest row, padding between them.
            raise NoRule(f"a random draw along {d}, the cells of rows ragged along {rows} "
                         f"counted together: jax.jit's draw on the exact-size input spaces "
                         f"them by the longest row, so no cell's index is its own; draw along "
                         f"the rows and the length ({rows}, ...) and reshape after")
    if not has_sym(shape[1:]):
        return None                 # (T, F): the bucket's flat index is the exact one
    index = [lax.broadcasted_iota(np.int32, shape, a) for a in range(len(shape))]
    return [_draw_at(eqn, key, _flat_index(index, [ctx.exact_extent(d) for d in shape]))]


@defrule("random_bits", layout="pack")
def _random_bits_packed(ctx, eqn, invals):
    """A draw along the packed rows and a packed length draws, at each real cell, what the
    pad layout draws there: cell ``(r, c)`` holding position ``t`` of the call's sequence ``b``
    has ``b`` as its index along the rows and ``t`` along a packed length (``T``, ``T - 1``;
    two of them for attention's ``(B, H, T, T)``), the strides the exact-size extents (the
    call's sequences, its longest sequence). A pair of cells of two sequences, or a cell
    outside every sequence, draws something no result reads (the frame keeps it out). One
    along other lengths only (a per-position ``(T, F)`` noise shared by every sequence has no
    rows axis: position ``t`` draws the same in either layout) is the padded rule. A draw
    along the rows alone (a per-sequence ``(B, F)`` noise) is per sequence: each sequence
    draws what its row draws padded, held at every cell of it (`Known.per_sequence`)."""
    (key,) = invals
    shape = tuple(eqn.params["shape"])
    rows = ctx.row_axes(shape)
    if not rows:
        return padded_rule(eqn)(ctx, eqn, invals)
    _exact_draws_only(key, shape)
    if has_sym(key.shape):
        # Padded, a batch of keys draws per key at its index; packed, its rows axis would
        # have to follow each cell's sequence.
        raise NoRule(f"a random draw of shape {shape} with a key per sequence of a packed "
                     f"row: its bits cannot be placed by sequence")
    packed = ctx.packed_axes(shape)
    counts = [a for a, d in enumerate(shape)
              if is_sym(d) and ctx.rows_name in dim_vars(d) and a not in rows]
    if len(rows) != 1 or counts:
        raise NoRule(f"a random draw of shape {shape} over packed rows: only one rows axis "
                     f"with packed lengths draws by its sequence and position")
    (r,) = rows
    extents = [ctx.exact_extent(d) for d in shape]
    if not packed:                  # per sequence, held at every column
        held_shape = grid_shape(ctx, shape, r)
        columns = held_shape[r + 1]
        index = [spread(ctx.sequence_index(columns), held_shape, (r, r + 1)) if a == r
                 else lax.broadcasted_iota(np.int32, held_shape, a + (a > r))
                 for a in range(len(shape))]
        return ctx.held_per_sequence([_draw_at(eqn, key, _flat_index(index, extents))],
                                     [key.ndim + r])
    index = []
    for a, d in enumerate(shape):
        if a == r:
            index.append(spread(ctx.sequence_index(shape[packed[0]]), shape, (r, packed[0])))
        elif a in packed:
            index.append(spread(ctx.cells(d)[0], shape, (r, a)))
        else:                       # a constant axis, or another length: its own positions
            index.append(lax.broadcasted_iota(np.int32, shape, a))
    return [_draw_at(eqn, key, _flat_index(index, extents))]


@defrule("random_bits", layout="per_sequence")
def _random_bits_per_sequence(ctx, eqn, invals):
    """A key per sequence (``jax.vmap`` of a draw over per-example keys: ``fold_in(key,
    ids[b])``, ``split(key, B)``) drawing along one packed length: the cell holding position
    ``t`` of a sequence draws with that sequence's key at ``t``'s flat index in the draw's
    exact-size shape, as its padded row does."""
    (key,) = invals
    shape = tuple(eqn.params["shape"])
    out = tuple(eqn.outvars[0].aval.shape)
    held = ctx.operands[0]
    if not held.per_sequence or held.sequence_axis != 0 or key.ndim != 2:
        raise NoRule("a random draw with keys held per sequence other than one key a sequence")
    _exact_draws_only(key, shape)
    frame = ctx.one_frame(out)
    if frame is None or frame[0] != 0:
        raise NoRule(f"a random draw of shape {shape} with a key per sequence along no packed "
                     f"length, or several")
    p = frame[1]
    data = jax.random.key_data(lax.slice_in_dim(key, 0, out[p], axis=1))
    index = [spread(ctx.cells(d)[0], out, (0, p)) if a == p
             else lax.broadcasted_iota(np.int32, out, a) for a, d in enumerate(out)][1:]
    counts = _flat_index(index, [ctx.exact_extent(d) for d in shape])
    k1, k2 = (spread(data[..., i], out, (0, p)) for i in (0, 1))
    return [_bits(eqn, k1, k2, counts)]
