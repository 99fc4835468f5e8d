"""The logical rewrite's machinery: the evaluation context (`Ctx`, the padded and ragged
layout) and the interpreter (`eval_jaxpr`, one `evaluate` step per equation).

The families of rules (`_pointwise`, `_reductions`, `_structure`, `_indexing`, `_contractions`,
`_control`, `_random`) register each rule next to its definition in the registry
(`_registry.defrule`); the package's ``__init__`` imports them all, so `rewrite` is only
reached with the registry full. What every rule uses and needs no interpreter state is in
`_basics`.

Rules take ``(ctx, eqn, invals)`` and return the outputs, or None when the equation needs no
change after all; they raise `NoRule` to report what they cannot do (a verdict naming the
user's line, and the equation runs unchanged). ``ctx.operands[i]`` is operand ``i``'s
annotation (`Known`), handed by position.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax import export, lax
from jax.extend import source_info_util

from .._context import equation_line
from .._errors import OptionError, is_int
from .._jax_internals import dim_as_value, dim_bounds, dim_vars, evaluate_dim, var_dim
from ._basics import (PLAIN, Known, bind_eqn, bind_eqn_with, filled, has_sym, iota_along,
                      is_empty, monotone, is_sym, like_aval, lowest_value, one_position,
                      operand_avals, ranked, sub_jaxprs)
from ._registry import ELEMENTWISE, MOVES_ROWS_WHY, Entry, NoRule, lookup_rule


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """An equation that reads across a length axis and that no rule makes logical."""

    primitive: str      # e.g. "fft"
    where: str          # the user's line: "file:line: `source`"
    detail: str         # why, one short phrase


@dataclasses.dataclass(frozen=True)
class RowFloor:
    """The shortest row a program reads right: a window of a fixed number of positions
    (``x[:, :k]``, ``lax.dynamic_slice(x, (0, i), (B, k))``) reads past the end of a shorter
    row, where plain JAX on that row alone would give fewer positions or fail. Ragged rows
    below ``var``'s declared min are accepted (a min is often there for JAX alone), so a call
    refuses only the rows shorter than a floor."""

    var: str            # the ragged length variable
    length: int         # rows of ``var`` shorter than this read past their end
    where: str          # the user's line: "file:line: `source`"
    why: str = ""       # what the line does to a shorter row ("": reads a fixed-size window)

    def explain(self) -> str:
        return self.why or (f"reads a fixed-size window of every row up to position "
                            f"{self.length}, past the end of a shorter row (drop or pad shorter "
                            f"rows, or slice to min(length, ...) positions)")


@dataclasses.dataclass(frozen=True)
class Logical:
    """The logical program: ``fn(*flat_inputs) -> tuple of flat outputs``."""

    fn: Callable
    unsupported: tuple[Unsupported, ...]    # empty when every equation has a rule
    rewritten: int                          # equations a rule changed
    # The packed program (`rewrite_packed`): its inputs (per-sequence ones held per cell),
    # and whether it reads a per-sequence value (then every sequence needs a cell).
    avals: tuple[Any, ...] | None = None
    per_sequence: bool = False
    # The packed program takes each cell's sequence index as a third layout input (a draw
    # along packed rows folds it in); programs without one take only ``pos`` and ``seglen``.
    reads_sequence: bool = False
    # Per packed variable, the program's cells after each sequence (`_basics.room_of`): its
    # ``pos`` and ``seglen`` are ``(B, T + room)``, and the layout leaves that many cells after
    # each one.
    rooms: dict = dataclasses.field(default_factory=dict)
    floors: tuple[RowFloor, ...] = ()       # per ragged variable, the longest floor found


# --------------------------------------------------------------------------------------------
# The evaluation context: real sizes and the values of dimension expressions


class Ctx:
    """Real sizes (int32 tracers by variable name) and the recorder, for one (sub-)program:
    the padded and ragged layouts' `_interface.Layout`, what their rules may ask.

    A sub-program (a scan body, a branch) gets a child context: it may read its parents'
    cached values (closing over them is fine), but what it computes stays in its own trace.

    Ragged lengths: ``rows`` maps a variable ragged along a rows variable (``T`` along ``B``,
    from a ``lengths_of`` input) to ``(lengths, "B")``, the per-row real lengths as an int32
    ``(B,)`` tracer. In a value with a ``B`` axis, a ``T`` axis is real up to its row's
    length; in a value without one, up to the longest row (the uniform real size). ``alive``
    (inside a scan over a ragged length) marks the rows whose sequence has not ended.
    """

    def __init__(self, sizes: dict[str, Any], recorder: "Recorder", parent: "Ctx | None" = None,
                 eqn=None, rows: Mapping[str, tuple[Any, str]] | None = None, alive=None):
        self.sizes = sizes
        self.recorder = recorder
        self.parent = parent
        self.eqn = eqn          # the equation whose sub-program this context evaluates
        self.rows = dict(rows or {})
        self.alive = alive
        self.current = None     # the equation a rule is rewriting right now
        self.from_lengths_shapes: frozenset = frozenset()   # of its inputs made from lengths
        self.own_sizes = False  # True for a per-row context (see _eval_row_varying)
        self._lengths: dict[Any, Any] = {}
        self._physical: dict[Any, Any] = {}
        self._exact: dict[Any, Any] = {}
        # The annotations (`Known`) of the current equation's operands, by position, as JAX's
        # batching hands a rule its operands' batch dimensions: set by `evaluate`.
        self.operands: tuple[Known, ...] = ()
        # The annotations of the current equation's outputs, by position, where its rule
        # states them (a call's: what its program made from lengths or positions alone).
        self.results: list[Known] | None = None

    @contextlib.contextmanager
    def applying(self, eqn, invals):
        """While a rule rewrites ``eqn``: `length` reads which of its inputs were made from
        lengths alone (``from_lengths_shapes``) and which equation asks (``current``)."""
        self.current, self.from_lengths_shapes = eqn, frozenset(
            tuple(x.shape) for x, k in zip(invals, self.operands) if k.from_lengths)
        try:
            yield
        finally:
            self.current, self.from_lengths_shapes = None, frozenset()

    def child(self, eqn, *, alive=None) -> "Ctx":
        if alive is not None and self.alive is not None:
            alive = lax.bitwise_and(alive, self.alive)
        return Ctx(self.sizes, self.recorder, self, eqn, self.rows,
                    self.alive if alive is None else alive)

    def evaluate(self, eqn, invals, operands=()) -> list:
        """One equation's outputs in this context's layout (`evaluate`, the one interpreter);
        ``operands``: its operands' annotations by position (missing ones: `PLAIN`)."""
        return evaluate(self, eqn, invals, operands)

    # -- the pad layout: what `evaluate` asks of a layout --------------------------------------
    # A packed context (`_packed.PackedCtx`) answers the same questions for packed rows.

    def held_outputs(self, eqn, invals) -> list | None:
        """The outputs of an equation that reads a value held in this layout's own form, which
        no rule of the primitive's sees: here a per-row value (`Known.per_row`), run per row."""
        if any(k.per_row for k in self.operands):
            return _eval_row_varying(self, eqn, invals)
        return None

    def held_rule(self, eqn, invals) -> Callable | None:
        """The rule for an equation reading a value held per sequence or per cell (packed rows
        only), None when it reads none."""
        return None

    def refusal(self, eqn, invals) -> str | None:
        """Why this layout cannot rewrite ``eqn`` whatever its rule, None when it can: it moves
        the rows of a ragged value, or a length of its outputs can outgrow its bucket. Rows
        below a window's reach are noted as the plan's floor (`_note_row_floor`)."""
        moved = moves_ragged_rows(self, eqn)
        if moved is not None:
            return moved
        _note_row_floor(self, eqn, invals)
        for v in eqn.outvars:
            for d in getattr(v.aval, "shape", ()):
                if not self.recorder.monotone(d):
                    return f"the length {d} can exceed its bucket size"
        return None

    def rule_for(self, eqn, entry: Entry | None) -> Callable | None:
        return None if entry is None else entry.rule

    def refused(self, eqn, invals, why: str) -> list:
        """What an equation no rule rewrites gives: flagged (`flag`), it runs as written over
        the padding."""
        self.flag(eqn, why)
        return bind_eqn(eqn, invals)

    def without_rule(self, eqn, invals, error: "NoRule") -> list:
        """A rule gave up (`NoRule`). A value made from lengths alone, reduced (or flipped...)
        along them, runs once per row at the row's own lengths, its result held per row
        (`Known.per_row`); anything else is refused with the rule's reason."""
        if self.from_lengths_shapes:
            try:
                return _eval_row_varying(self, eqn, invals,
                                         rows=self.rows_of_made_from_lengths(invals))
            except Exception:  # noqa: BLE001 - not per row either: the rule's own verdict
                pass
        return self.refused(eqn, invals, str(error))

    def as_output(self, x, aval, known=None):
        """An output of a rule as the equation's result (``known``: its stated annotation)."""
        return x if known is not None and known.per_row else like_aval(x, aval)

    def flag(self, eqn, detail: str):
        """Record an equation no rule makes logical, at the user's line (`where`)."""
        self.recorder.unsupported.setdefault(
            id(eqn), Unsupported(eqn.primitive.name, self.where(eqn), detail))

    def where(self, eqn) -> str:
        """The user's line of an equation: its own, or else (equations JAX's own functions
        trace, e.g. inside ``jnp.linalg``) that of the innermost enclosing call whose
        traceback reaches user code."""
        where, ctx = equation_line(eqn), self
        while where is None and ctx is not None:
            where = equation_line(ctx.eqn) if ctx.eqn is not None else None
            ctx = ctx.parent
        return where or "<unknown>"

    def _table_value(self, table: str, d):
        ctx = self
        while ctx is not None:
            cache = getattr(ctx, table)
            if d in cache:
                return cache[d]
            # A per-row context binds other sizes: its parents' cached lengths are not its own.
            ctx = None if ctx.own_sizes else ctx.parent
        return None

    def _cached(self, table: str, d, compute):
        if not is_sym(d):
            return int(d)
        value = self._table_value(table, d)
        if value is None:
            value = getattr(self, table)[d] = lax.convert_element_type(compute(d), np.int32)
        return value

    # -- ragged lengths ---------------------------------------------------------------------

    def rows_of(self, d) -> str | None:
        """The rows variable of the ragged variables ``d`` mentions (None: not ragged)."""
        if not is_sym(d) or not self.rows:
            return None
        found = {self.rows[n][1] for n in dim_vars(d) if n in self.rows}
        if len(found) > 1:
            raise NoRule(f"the length {d} mixes variables ragged along different rows "
                          f"({', '.join(sorted(found))})")
        return found.pop() if found else None

    def row_axes(self, shape, rows: str) -> list[int]:
        return [i for i, s in enumerate(shape) if is_sym(s) and str(s) == rows]

    def per_row(self, d, *, as_value: bool = False):
        """``d`` at each row's lengths: an int32 ``(B,)`` vector, never below 0 as the length
        of an axis (a row of length 0 has no ``T - 1`` positions, not -1), and as it is as a
        value (``x.shape[0] - 1`` of an empty row is -1, as plain JAX computes it)."""
        env = dict(self.sizes)
        for name in dim_vars(d):
            if name in self.rows:
                env[name] = self.rows[name][0]
        value = lax.convert_element_type(evaluate_dim(d, env), np.int32)
        return value if as_value else jnp.maximum(value, 0)

    def own_length(self, eqn, d, rows: str):
        """``d`` as a number (``x.shape[1]``) in code without the rows axis when ``d`` is
        ragged along ``rows``: each row's own, held per row; the one output of the current
        equation, so it states its annotation (`Known.per_row`) in ``results``."""
        self.results = [Known(per_row=rows, below=value_floor(self, eqn, d))]
        return self.per_row(d, as_value=True)

    def count(self, d):
        """``d`` as a number (``x.shape[0]``, ``B*T``) at the real sizes: a count over ragged
        rows is the sum of their lengths."""
        return self.length(d)

    def row_mask(self, rows: str):
        """The real rows of a rows axis: below the real size, and (inside a scan over a ragged
        length) still alive. An int32 ``(B,)`` bool vector, or None when every row is."""
        var = next(n for n, (_, r) in self.rows.items() if r == rows)
        lengths = self.rows[var][0]
        mask = lax.broadcasted_iota(np.int32, lengths.shape, 0) < self.sizes[rows]
        return mask if self.alive is None else lax.bitwise_and(mask, self.alive)

    def _summed(self, d, rows: str):
        """A length that counts over the rows (``B*T``: the real elements of a ragged
        ``(B, T)`` array): the sum over real rows of the per-row quotient."""
        b = var_dim(rows, d.scope)
        try:
            q = d // b
            exact = q * b == d
        except Exception:  # noqa: BLE001 - any failure: not a per-row count
            exact = False
        if not exact or rows in dim_vars(q):
            raise NoRule(f"the length {d} mixes the rows {rows} with a length ragged along "
                          f"them in a way that is not a per-row count")
        per_row = self.per_row(q) if is_sym(q) else jnp.full(self.rows_vector_shape(rows), int(q))
        return jnp.sum(jnp.where(self.row_mask(rows), per_row, 0)).astype(np.int32)

    def rows_vector_shape(self, rows: str):
        var = next(n for n, (_, r) in self.rows.items() if r == rows)
        return self.rows[var][0].shape

    def from_lengths_of(self, x, reading) -> bool:
        """Whether ``x`` is made from lengths alone -- ``jnp.arange(row.shape[0])``,
        ``jnp.ones(n)``, a table cut to ``[:n, :n]``, and what elementwise code makes of them:
        a ragged length, no rows axis, and no input holding the rows' data. Every row sees
        the same values, but a sum over its tail is each row's own (see `length`). A value
        without rows that came from the rows' data (a sum over them, a gradient of a shared
        table) is not one: its tail beyond a row's end holds the other rows' positions.
        ``reading``: the equation's inputs with their annotations."""
        shape = getattr(x, "shape", None)
        if shape is None:
            return False
        try:
            rows = {r for r in map(self.rows_of, shape) if r is not None}
            if not rows or any(self.row_axes(shape, r) for r in rows):
                return False
            for y, k in reading:
                if k.from_lengths or k.per_cell:
                    continue
                if k.per_row or any(
                        self.rows_of(d) is not None or str(d) in rows
                        for d in getattr(y, "shape", ())):
                    return False
        except NoRule:
            return False
        return True

    def positions_of(self, eqn, reading) -> Callable | None:
        """``Known.positions`` of the one output of ``eqn`` (its inputs with their annotations
        in ``reading``), when it is made from positions alone; None here: only packed rows
        read it."""
        return None

    def rows_of_made_from_lengths(self, invals) -> str:
        """The rows along which the values made from lengths among ``invals`` are ragged."""
        found = {r for x, k in zip(invals, self.operands) if k.from_lengths
                 for r in map(self.rows_of, x.shape) if r is not None}
        if len(found) != 1:
            raise NoRule(f"values made from lengths ragged along {sorted(found)}")
        return found.pop()

    def length(self, d, shape=None, shared=None):
        """The logical length of a dimension: an int, or an int32 tracer. For an axis of a
        value of ``shape``: a length ragged along rows that the value has an axis for is that
        row's length (a vector shaped to broadcast along that axis); a value without one is
        real up to the longest row, which is right for a value that came from the rows' data
        (``shared``). A value made from lengths alone (`from_lengths_of`) is the same in
        every row, but what a rule makes of its tail -- a sum, a max, a flip -- differs per row
        and has no axis to hold each row's: `NoRule` for the shape of an input of the current
        equation made so, unless ``shared=True`` (the rule zeroes a rows operand per row); the
        equation then runs once per row (`_eval_row_varying`).
        Without ``shape``, a rule asking for a ragged length of an equation with rows, or
        reading a value made from lengths (a flattened ``triu(ones((T, T)))``), gets `NoRule`:
        it reads one offset for all rows, which only a per-row rule may do."""
        rows = self.rows_of(d)
        if rows is None:
            return self._cached("_lengths", d, lambda e: evaluate_dim(e, self.sizes))
        if rows in dim_vars(d):
            return self._summed(d, rows)
        if shape is not None:
            axes = self.row_axes(shape, rows)
            if len(axes) > 1:
                raise NoRule(f"a value of shape {tuple(shape)} has several {rows} axes: which "
                              f"one holds the rows of {d} is ambiguous")
            if axes:
                out = [1] * len(shape)
                out[axes[0]] = -1
                return jnp.reshape(self.per_row(d), out)
            if shared is False or (shared is None and tuple(shape) in self.from_lengths_shapes):
                raise NoRule(f"a value of shape {tuple(shape)} reads its length {d}, which "
                              f"differs per row (ragged along {rows}), and has no {rows} axis "
                              f"to hold each row's result")
        elif self.current is not None and (self._has_rows(self.current, rows)
                                           or self.from_lengths_shapes):
            raise NoRule(f"{self.current.primitive.name} reads the length {d}, which differs "
                          f"per row (ragged along {rows}); it has no per-row rule")
        return self._cached("_lengths", d, lambda e: evaluate_dim(e, self.sizes))

    def _has_rows(self, eqn, rows: str) -> bool:
        return any(self.row_axes(getattr(v.aval, "shape", ()), rows)
                   for v in (*eqn.invars, *eqn.outvars))

    def fill_tail(self, x, axes, fill, shared=None, known=PLAIN):
        """``x`` with ``fill`` past the logical length of each of ``axes`` (`fill_tail`)."""
        return fill_tail(self, x, axes, fill, shared, known)

    def tail_mask(self, shape, axes, shared=None):
        """`logical_mask` of a value of ``shape``, as `fill_tail` and the zeroed reads ask
        for it (packed rows keep each one they make)."""
        return logical_mask(self, shape, axes, shared)

    def _derive(self, key, make):
        """``make()`` at each ask (packed rows keep it for the trace: `PackedCtx._derive`)."""
        return make()

    def filled(self, shape, fill, dtype):
        """`filled`; one with the rows axis is kept per trace where the layout keeps values
        (`_derive`; packed rows: the 12-layer LM's packed program filled some 380 selects
        from a dozen such arrays). Keyed by the fill's bits (-0.0 is not 0.0)."""
        try:
            bits = np.asarray(fill, dtype).tobytes() if np.isscalar(fill) else None
        except (OverflowError, TypeError, ValueError):
            bits = None
        if bits is None or not any(self.row_axes(shape, r) for _, r in self.rows.values()):
            return filled(shape, fill, dtype)   # traced, not a dtype value, or no rows axis
        return self._derive(("filled", tuple(shape), np.dtype(dtype), bits),
                            lambda: filled(shape, fill, dtype))

    def exact_extent(self, d):
        """The size of an axis of length ``d`` in the exact-size call ``jax.jit`` would see:
        the real sizes, a ragged length at its longest row, the rows at the call's rows (in
        packed rows, its sequences) -- whatever row a per-row context evaluates."""
        ctx = self
        while ctx.own_sizes:
            ctx = ctx.parent
        return ctx._cached("_exact", d, lambda e: evaluate_dim(e, ctx.sizes))

    def physical(self, d):
        """The bucket size of a dimension as a value (``dim_as_value``, not rewritten)."""
        return self._cached("_physical", d, dim_as_value)

    def all_real(self, d) -> bool:
        """Whether every position along an axis of length ``d`` is real in this layout, so
        that `logical_mask` needs no ``iota < length`` along it. Never in the pad layout,
        whose rows axis holds padding rows and length axes a tail; the packed layout says
        which of its axes (`_packed.PackedCtx.all_real`)."""
        return False

    # -- the families' operations --------------------------------------------------------------
    # A family (`_families`: reductions, cumulative ops, windows) has one rule for every layout,
    # which asks its layout to combine along a length, as JAX's batching rules ask a value's
    # batch dimension. The pad layout: a length's tail holds padding, so it becomes the
    # combiner's identity. A packed context combines within each sequence instead.

    def reduce(self, eqn, invals, fills, axes):
        """``eqn``, reducing ``invals``' first ``len(fills)`` operands (a ``reduce``'s init
        values follow them) over ``axes``, one of them a length: each operand's tails along
        ``axes`` become its identity in ``fills``."""
        n = len(fills)
        return bind_eqn_with(eqn, [*(fill_tail(self, x, axes, f, known=k) for x, f, k in
                                     zip(invals[:n], fills, self.operands)), *invals[n:]])

    def accumulate(self, eqn, x, axis: int, monoid, reverse: bool):
        """A cumulative ``eqn`` of ``x`` along the length ``axis``: a forward one reads a
        logical prefix and runs as written; a reverse one starts from the logical end, its tail
        the identity."""
        if not reverse:
            return None
        return bind_eqn_with(eqn, [fill_tail(self, x, (axis,), monoid.identity(x.dtype),
                                             known=self.operands[0])])

    def reverse(self, x, axis: int):
        """``x`` reversed along the length ``axis`` within its real length, its tail left
        where it is (ragged: each row within its own)."""
        n = x.shape[axis]
        length = self.length(n, x.shape)
        if jnp.ndim(length):
            return take_rows(self, x, length - 1 - iota_along(x.shape, axis), axis)
        return take_clamped(self, x, length - 1 - iota_along((n,), 0), axis)

    def top_k(self, eqn, x, axis: int):
        """``top_k`` of ``x`` along the length ``axis``, ranked as it ranks (`ranked`), the
        tail at the lowest rank (ties go to the lower index: a real position wins). Values are
        read back at the positions: a lowest-NaN fill would rank only while no pass
        canonicalises it."""
        key = ranked(x)
        values, positions = bind_eqn_with(eqn, [fill_tail(self, key, (axis,), lowest_value(
            key.dtype), known=self.operands[0])])      # the key: x's, ranked elementwise
        if key is not x:
            values = jnp.take_along_axis(x, positions, axis, mode="clip")
        return [values, positions]

    def check_relayout(self, src, dst) -> None:
        """Raise `NoRule` when this layout cannot move elements between the axes of ``src``
        and ``dst`` (a reshape that does not keep its length axes); padded rows lay the
        logical elements out row-major, so never here."""

    def sort_key(self, shape, axis: int):
        """A leading int32 key for a sort of a value of ``shape`` along the length ``axis``
        that keeps every real cell among the real cells it belongs with: here 0 for a real
        position and 1 for the tail, which sorts last."""
        return lax.convert_element_type(
            iota_along(shape, axis) >= self.length(shape[axis], shape), np.int32)

    def window(self, eqn, x, monoid):
        """A window ``eqn`` (``reduce_window_sum``, ...) of ``x``: it reads the identity past a
        length's logical end, and from a length-dependent low padding (`windowed`)."""
        done = windowed(self, [x], [monoid.identity(x.dtype)], eqn.params, "base_dilation",
                        self.operands[:1])
        if done is None:
            return None
        (x,), padding, base_dilation = done
        return bind_eqn_with(eqn, [x], padding=padding, base_dilation=base_dilation)


class Recorder:
    """What one rewrite learns as it goes (verdicts, floors), and what it knows of the whole
    program before it starts (``ragged``, ``used``)."""

    def __init__(self, *, ragged: frozenset[str] = frozenset(), used: frozenset = frozenset()):
        self.unsupported: dict[int, Unsupported] = {}    # by id(eqn): a body traced twice
        self.rewritten: set[int] = set()                 # counts once
        self.touches: dict[int, tuple[Any, bool]] = {}   # see _jaxpr_touches
        self._decided: dict[Any, bool] = {}
        self.ragged = ragged        # the variables with per-row lengths
        self.used = used            # packed: the variables some equation or output reads
        self.floors: dict[str, RowFloor] = {}            # see `_note_row_floor`
        self.per_sequence = False   # packed: whether a per-sequence value was read
        self.reads_sequence = False  # packed: whether a rule read each cell's sequence index

    def monotone(self, d) -> bool:
        # Cached per rewrite: dimensions of different symbolic scopes must never be compared.
        if not is_sym(d):
            return True
        return self.decided(d, lambda: monotone(d))

    def decided(self, key, decide: Callable[[], bool]) -> bool:
        """A yes or no about dimensions, ``decide()`` once per rewrite under ``key``."""
        if key not in self._decided:
            self._decided[key] = bool(decide())
        return self._decided[key]

    def touched(self, jaxpr) -> bool:
        return _jaxpr_touches(getattr(jaxpr, "jaxpr", jaxpr), self.touches)

# --------------------------------------------------------------------------------------------
# Mask helpers


def logical_mask(ctx: Ctx, shape, axes, shared=None):
    """True at positions that are logical along every length axis among ``axes``. A length
    ragged along rows is each row's; reading across a rows axis also drops, in every row, the
    positions of its ragged axes beyond that row's length (they do not exist) and the rows
    that are not real (padding rows, or rows whose sequence has ended inside a scan)."""
    mask = None
    axes = tuple(axes)
    checked = set()
    for a in axes:
        for b in (a, *[o for o in range(len(shape)) if o not in axes]):
            if not is_sym(shape[b]) or b in checked:
                continue
            if b != a:
                rows = ctx.rows_of(shape[b])
                if rows is None or str(shape[a]) != rows:
                    continue       # only a rows axis read across drops other axes' tails
            checked.add(b)
            if ctx.all_real(shape[b]):
                continue
            m = iota_along(shape, b) < ctx.length(shape[b], shape, shared)
            mask = m if mask is None else lax.bitwise_and(mask, m)
        if (ctx.alive is not None and is_sym(shape[a])
                and any(r == str(shape[a]) for _, r in ctx.rows.values())):
            m = lax.broadcast_in_dim(ctx.row_mask(str(shape[a])), tuple(shape), (a,))
            mask = m if mask is None else lax.bitwise_and(mask, m)
    return mask


def fill_tail(ctx: Ctx, x, axes, fill, shared=None, known: Known | None = PLAIN):
    """``x`` with every position beyond a logical length along ``axes`` replaced by ``fill``.
    ``known``: the annotation of ``x`` (``ctx.operands[i]`` for an operand; None: unknown,
    as a user's rule leaves it), whose zeroed tails are kept. A value made from lengths alone
    has no such tail for all rows at once (`Ctx.length`), unless ``shared``: its reader zeroes
    the rows' own operand per row."""
    if shared is None and known is not None:
        shared = not known.from_lengths
    zero = isinstance(fill, (bool, int, float, np.generic)) and fill == 0
    axes = frozenset(axes)
    if zero and known is not None and axes <= known.zeroed:
        return x
    return _masked(ctx, x, axes, fill, shared)


def _masked(ctx: Ctx, x, axes, fill, shared):
    mask = ctx.tail_mask(x.shape, axes, shared)
    return x if mask is None else lax.select(mask, x, ctx.filled(x.shape, fill, x.dtype))


def _zeroed_reads(jaxpr) -> dict:
    """Per variable of ``jaxpr``, the length axes that its equations read it across with the
    tail zeroed (each primitive's `Entry.zeroed_reads`: contracted by ``dot_general``, summed
    by ``reduce_sum``): `eval_jaxpr` zeroes them where the value is made, for all its readers
    (see the package docstring)."""
    reads: dict[Any, set[int]] = {}
    for eqn in jaxpr.eqns:
        entry = lookup_rule(eqn.primitive)
        if entry is None or entry.zeroed_reads is None:
            continue
        for i, axes in entry.zeroed_reads(eqn):
            v = eqn.invars[i]
            if axes and isinstance(v, jax.extend.core.Var):
                reads.setdefault(v, set()).update(axes)
    return reads


def _zero_read_tails(ctx: Ctx, reads, v, x, known: Known) -> tuple[Any, Known]:
    """``x`` (the value of ``v``, annotated ``known``) zeroed beyond its lengths along the axes
    its readers need zeroed (`_zeroed_reads`), with its annotation."""
    axes = reads.get(v)
    if (axes is None or not hasattr(x, "shape") or known.per_row or known.per_cell
            or known.per_sequence):
        return x, known
    axes = frozenset(axes)
    if axes <= known.zeroed:
        return x, known
    try:
        out = _masked(ctx, x, axes, 0, not known.from_lengths)
    except NoRule:
        return x, known        # the reader's own rule says why
    return (x, known) if out is x else (out, Known(zeroed=axes))


def _zeroed_through(eqn, operands) -> Known:
    """The annotation of an elementwise equation's output: its operand's zeroed tails, where
    its primitive keeps zeros (`Entry.zeroed_through`: ``neg``, a transpose)."""
    entry = lookup_rule(eqn.primitive)
    if (entry is None or entry.zeroed_through is None or entry.rule is not ELEMENTWISE
            or len(operands) != 1):
        return PLAIN
    zeroed = operands[0].zeroed
    return Known(zeroed=entry.zeroed_through(eqn, zeroed)) if zeroed else PLAIN


def take_clamped(ctx: Ctx, x, idx, axis):
    """``x`` indexed along ``axis`` by the int32 vector ``idx`` (clamped: positions whose index
    falls outside are beyond a logical length, so their value does not matter)."""
    idx = jnp.clip(idx, 0, ctx.physical(x.shape[axis]) - 1)
    return jnp.take(x, idx, axis=axis, mode="clip")


def take_rows(ctx: Ctx, x, idx, axis):
    """``x`` indexed along ``axis`` by ``idx`` of ``x``'s own shape: a different index per row
    (per-row lengths), clamped like `take_clamped`."""
    idx = jnp.clip(idx, 0, ctx.physical(x.shape[axis]) - 1)
    return jnp.take_along_axis(x, idx, axis=axis, mode="clip")


def _broadcast_along(v, shape, axis):
    return lax.broadcast_in_dim(v, tuple(shape), (axis,))


def place_window(ctx: Ctx, x, axis, lo, interior, size, fill):
    """``lax.pad`` along one axis with the *logical* configuration: the result (``size``
    positions) holds ``x[j]`` at ``lo(t) + j * (interior + 1)`` for ``j`` below the logical
    length, and ``fill`` everywhere else. Used where the low padding is a length expression,
    or where the high padding must start at the logical end. Ragged: per row."""
    n, low = ctx.length(x.shape[axis], x.shape), ctx.length(lo, x.shape)
    if is_sym(x.shape[axis]) and dim_bounds(x.shape[axis])[0] < 1:
        # An axis that can be empty (a stride's output at the shortest length: an average
        # pool's cotangent at T = 1) cannot be indexed: one fill cell after it, never valid.
        config = [(0, 0, 0)] * x.ndim
        config[axis] = (0, 1, 0)
        x = lax.pad(x, jnp.asarray(fill, x.dtype), config)
    per_row = bool(jnp.ndim(n) or jnp.ndim(low))
    shape = [1] * x.ndim if per_row else [size]
    if per_row:
        shape[axis] = size
    q = iota_along(shape, axis if per_row else 0) - low
    step = interior + 1
    src = q // step if step > 1 else q
    valid = (q >= 0) & (src < n)
    if step > 1:
        valid = valid & (q % step == 0)
    if per_row:
        taken = take_rows(ctx, x, src, axis)
        return lax.select(jnp.broadcast_to(valid, taken.shape), taken,
                          filled(taken.shape, fill, x.dtype))
    taken = take_clamped(ctx, x, src, axis)
    return lax.select(_broadcast_along(valid, taken.shape, axis), taken,
                      filled(taken.shape, fill, x.dtype))


def windowed(ctx: Ctx, operands, fills, p, dilation_key, known):
    """A windowed read's operands (a window, a convolution, the max-pooling derivatives) whose
    tails become their fills (the padding value), with a length-dependent low padding built
    explicitly; ``known``: their annotations. Returns the operands and the new
    padding/dilation, or None when nothing reads across a length axis."""
    if any(is_sym(w) for w in p["window_dimensions"]):
        raise NoRule("a window whose size is a length")
    padding = list(p["padding"])
    dilation = list(p[dilation_key]) if dilation_key else [1] * len(padding)
    changed = False
    for a, (lo, hi) in enumerate(padding):
        n = operands[0].shape[a]
        if not is_sym(lo):
            if is_sym(n):
                operands = [fill_tail(ctx, x, (a,), f, known=k)
                            for x, f, k in zip(operands, fills, known)]
                changed = True
        else:
            size = (n - 1) * dilation[a] + 1 + lo + hi
            operands = [place_window(ctx, x, a, lo, dilation[a] - 1, size, f)
                        for x, f in zip(operands, fills)]
            padding[a], dilation[a] = (0, 0), 1
            changed = True
    return (operands, tuple(padding), tuple(dilation)) if changed else None


# --------------------------------------------------------------------------------------------
# The interpreter


def _param_has_sym(value) -> bool:
    if isinstance(value, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr, np.ndarray)):
        return False
    if isinstance(value, (tuple, list)):
        return any(_param_has_sym(v) for v in value)
    return export.is_symbolic_dim(value)


def _jaxpr_touches(jaxpr, cache: dict) -> bool:
    """Whether any equation of a program, sub-programs included, touches a length axis.
    ``cache`` is per rewrite, keyed by id: it holds the jaxprs, so ids are not reused."""
    hit = cache.get(id(jaxpr))
    if hit is None:
        touches = any(has_sym(getattr(v.aval, "shape", ()))
                      for v in (*jaxpr.invars, *jaxpr.outvars)) or any(
            eqn_touches(e, cache) for e in jaxpr.eqns)
        cache[id(jaxpr)] = hit = (jaxpr, touches)
    return hit[1]


def eqn_touches(eqn, cache: dict) -> bool:
    """Whether an equation involves a length axis: in an aval, a parameter, or a sub-program
    (a jitted function may use ``x.shape[0]`` inside although its own avals are fixed)."""
    if any(has_sym(getattr(v.aval, "shape", ())) for v in (*eqn.invars, *eqn.outvars)):
        return True
    if any(_param_has_sym(v) for v in eqn.params.values()):
        return True
    return any(_jaxpr_touches(j, cache) for j in sub_jaxprs(eqn.params))


# Index arithmetic on constants, evaluated with NumPy while rewriting so that a rule sees the
# index ``x[:, :1]`` gathers at as the number 0 (JAX's own evaluation would compile each one).
_FOLDED_ELEMENTS = 64


def _folded(eqn, invals) -> list | None:
    """``eqn``'s output as a NumPy array when it is index arithmetic (its `Entry.fold`) on a constant
    (a literal, or folded before) with a small output; None otherwise."""
    entry = lookup_rule(eqn.primitive)
    fold = entry.fold if entry is not None else None
    if (fold is None or len(invals) != 1 or not isinstance(invals[0], (np.ndarray, np.generic))
            or any(_param_has_sym(v) for v in eqn.params.values())):
        return None
    shape = eqn.outvars[0].aval.shape
    if not all(is_int(d) for d in shape) or math.prod(shape) > _FOLDED_ELEMENTS:
        return None
    if eqn.primitive.name == "reshape" and eqn.params.get("dimensions") is not None:
        return None
    return [np.asarray(fold(np.asarray(invals[0]), eqn.params), eqn.outvars[0].aval.dtype)]


def _only_reach_empty(jaxpr) -> set[int]:
    """The ids of the equations whose every result only reaches arrays with no elements
    (`is_empty`): JAX's edge padding slices one row of each axis it leaves unpadded, repeats
    it 0 times and joins the empty result back; what such a value holds reaches no result, so
    it moves no row and needs no rule. An equation with effects, or with a result nothing
    reads (dead code keeps its own verdict), is never one."""
    readers: dict[Any, list] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if isinstance(v, jax.extend.core.Var):
                readers.setdefault(v, []).append(eqn)
    outputs = {v for v in jaxpr.outvars if isinstance(v, jax.extend.core.Var)}
    found: set[int] = set()
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or not all(
                is_empty(v.aval) or (v not in outputs and readers.get(v)
                                     and all(id(r) in found for r in readers[v]))
                for v in eqn.outvars):
            continue
        if all(hasattr(v.aval, "dtype") and not jax.dtypes.issubdtype(v.aval.dtype,
                                                                     jax.dtypes.extended)
               for v in eqn.outvars):
            found.add(id(eqn))
    return found


def _only_from_empty(jaxpr) -> set[int]:
    """The ids of the equations whose results are zero because they are linear (`Entry.linear`)
    in operands that are all arrays with no elements (`is_empty`) or such zeros, and literal
    zeros: the gradient of `_only_reach_empty`'s values -- JAX transposes the slice of one row
    that edge padding repeats 0 times into a sum over no element, padded back onto the rows
    (``pad(0, (B - 1, 0))``), which would otherwise need a rule that moves rows."""
    zero: set = set()
    found: set[int] = set()

    def is_zero(v) -> bool:
        if isinstance(v, jax.extend.core.Literal):
            return np.all(np.asarray(v.val) == 0)
        return v in zero or (hasattr(v.aval, "shape") and is_empty(v.aval))

    for eqn in jaxpr.eqns:
        entry = lookup_rule(eqn.primitive)
        if (entry is not None and entry.linear and not eqn.effects
                and all(is_zero(v) for v in eqn.invars)):
            found.add(id(eqn))
            zero.update(v for v in eqn.outvars if isinstance(v, jax.extend.core.Var))
    return found


def eval_jaxpr(ctx: Ctx, jaxpr, consts, args, known_args=()) -> list:
    """``jaxpr``'s outputs in ``ctx``'s layout; ``known_args``: the annotations of ``args`` by
    position (a call's operands keep what its caller knew of them; missing ones: `PLAIN`).
    The outputs' annotations are left in ``ctx.results``."""
    env: dict[Any, Any] = {}

    def read(v):
        # A literal (a Python scalar in the user's code, e.g. a scan's ``0.0`` carry) becomes
        # a numpy scalar of its aval's dtype: rules read ``.shape`` and ``.dtype`` of inputs.
        if isinstance(v, jax.extend.core.Literal):
            return np.asarray(v.val, v.aval.dtype)
        return env[v]

    def annotation(v) -> Known:
        return known.get(v, PLAIN) if isinstance(v, jax.extend.core.Var) else PLAIN

    reads = _zeroed_reads(jaxpr)
    unread = _only_reach_empty(jaxpr) | _only_from_empty(jaxpr)
    known: dict[Any, Known] = {}      # each variable's annotation, beside its value
    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    known_args = [*known_args, *[PLAIN] * (len(args) - len(known_args))]
    for v, x, k in zip(jaxpr.invars, args, known_args):
        env[v], known[v] = _zero_read_tails(ctx, reads, v, x, k.passed_on())
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        operands = [annotation(v) for v in eqn.invars]
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        ctx.results = None
        with source_info_util.user_context(eqn.source_info.traceback,
                                           name_stack=name_stack), eqn.ctx.manager:
            outvals = _folded(eqn, invals)
            # Its values reach no result, or are zero whatever the layout.
            if outvals is None and id(eqn) in unread:
                outvals = [like_aval(filled(v.aval.shape, 0, v.aval.dtype), v.aval)
                           for v in eqn.outvars]
            if outvals is None:
                outvals = ctx.evaluate(eqn, invals, operands)
        stated = ctx.results or [None] * len(outvals)
        scope = list(zip(invals, operands))
        for v, x, k in zip(eqn.outvars, outvals, stated):
            if not isinstance(v, jax.extend.core.DropVar):
                # A result its rule annotated (a call's) keeps that; anything else may keep
                # its operand's zeroed tail, or be made from lengths or positions alone.
                positions = (k.positions if k is not None else
                             ctx.positions_of(eqn, scope) if len(eqn.outvars) == 1 else None)
                k = k or _zeroed_through(eqn, operands)
                k = dataclasses.replace(k, from_lengths=k.from_lengths or (
                    not (k.per_cell or k.per_row or k.per_sequence)
                    and ctx.from_lengths_of(x, scope)),
                    positions=positions)
                env[v], known[v] = _zero_read_tails(ctx, reads, v, x, k)
    # What this program knows of its results stays so for its caller (a call's results,
    # `Ctx.results`): made from lengths or positions alone, or not packed.
    ctx.results = [None if k == PLAIN and k.positions is None else k.passed_on()
                   for k in map(annotation, jaxpr.outvars)]
    return [read(v) for v in jaxpr.outvars]


def eval_closed(ctx: Ctx, closed, args, known_args=()) -> list:
    if isinstance(closed, jax.extend.core.ClosedJaxpr):
        return eval_jaxpr(ctx, closed.jaxpr, closed.consts, args, known_args)
    return eval_jaxpr(ctx, closed, (), args, known_args)


def evaluate(ctx: Ctx, eqn, invals, operands=()) -> list:
    """The interpreter's step, for every layout: one equation's outputs, ``operands`` its
    operands' annotations by position (``ctx.operands`` while it runs). The layout (the
    context: `Ctx` for padded rows, a packed context for packed ones) answers what differs --
    values it holds in a form of its own (`Ctx.held_outputs`, `Ctx.held_rule`), what it
    refuses whatever the rule (`Ctx.refusal`), its rule for a primitive (`Ctx.rule_for`), and
    what a refused equation gives (`Ctx.refused`, `Ctx.without_rule`)."""
    outer, ctx.operands = ctx.operands, (*operands, *[PLAIN] * (len(invals) - len(operands)))
    try:
        return _evaluate(ctx, eqn, invals)
    finally:
        ctx.operands = outer


def _evaluate(ctx: Ctx, eqn, invals) -> list:
    early = ctx.held_outputs(eqn, invals)
    if early is not None:
        return early
    held = ctx.held_rule(eqn, invals)
    if held is None and not eqn_touches(eqn, ctx.recorder.touches):
        return bind_eqn(eqn, invals)
    why = ctx.refusal(eqn, invals)
    if why is not None:
        return ctx.refused(eqn, invals, why)
    name = eqn.primitive.name
    entry = lookup_rule(eqn.primitive)
    rule = held or ctx.rule_for(eqn, entry)
    if rule is None:
        return ctx.refused(eqn, invals, f"no rule for {name} on a length axis")
    if rule is ELEMENTWISE:
        return bind_eqn(eqn, invals)
    with ctx.applying(eqn, invals):   # the rule's equation, read by `length`
        try:
            out = rule(ctx, eqn, invals)
        except NoRule as e:
            return ctx.without_rule(eqn, invals, e)
        except Exception as e:  # noqa: BLE001 - a rule JAX cannot trace is a verdict, not a crash
            return ctx.refused(eqn, invals, f"the {name} rule failed: {type(e).__name__}: "
                                            f"{str(e).splitlines()[0][:200] if str(e) else ''}")
    if out is None:                     # the rule found nothing to change: plain outputs
        ctx.results = None
        return bind_eqn(eqn, invals)
    if held is not None or entry is None or not entry.structural:
        ctx.recorder.rewritten.add(id(eqn))
    return _as_outputs(ctx, eqn, out)


def _as_outputs(ctx: Ctx, eqn, out) -> list:
    """A rule's outputs as ``eqn``'s results, each with what the rule stated of it."""
    stated = ctx.results or [None] * len(out)
    return [ctx.as_output(x, v.aval, k) for x, v, k in zip(out, eqn.outvars, stated)]


def _moved_axes(eqn) -> list[tuple[Any, tuple[int, ...]]]:
    """``(operand aval, axes)`` for each operand of an equation that selects, reorders, pads,
    joins or accumulates entries along those axes, or scans over them (its primitive's
    `Entry.moves`), as opposed to keeping every entry at its index."""
    entry = lookup_rule(eqn.primitive)
    if entry is None or entry.moves is None or not operand_avals(eqn):
        return []
    return entry.moves(eqn)


def moves_ragged_rows(ctx: Ctx, eqn) -> str | None:
    """Why ``eqn`` moves the rows of a ragged value, None when it does not: a value with a
    rows axis and a length ragged along it holds each row's real length by the row's index
    (the ``lengths_of`` input's), so selecting, reordering, padding or joining its rows
    (``x[:2]``, ``x[::-1]``, ``jnp.roll(x, 1, 0)``, ``x[perm]``) would give the moved rows the
    lengths of the rows whose place they take. Rows without a ragged axis move freely (a
    ``(B,)`` loss per row: its padding was left out already)."""
    if not ctx.rows:
        return None
    rows_names = {by for _, by in ctx.rows.values()}
    for aval, axes in _moved_axes(eqn):
        shape = aval.shape
        for a in axes:
            if not (is_sym(shape[a]) and str(shape[a]) in rows_names):
                continue
            try:
                ragged = any(ctx.rows_of(d) == str(shape[a]) for i, d in enumerate(shape)
                             if i != a)
            except NoRule:
                ragged = True
            if ragged:
                why = lookup_rule(eqn.primitive).moves_rows_why or MOVES_ROWS_WHY
                return why.format(name=eqn.primitive.name, rows=shape[a])
    return None


def _window_starts(eqn, invals) -> list[tuple[int, Any, Any]]:
    """``(axis, start, size)`` of each operand axis a windowed read indexes with a window of
    more than one position (its primitive's `Entry.window`): the start a constant (an int, a
    symbolic dimension) or None (a traced start, which the rules clamp into the row). One
    position (``x[:, k]``) is clamped into each row by the rules: it reads inside any row but
    an empty one, whose value is the gather's fill."""
    entry = lookup_rule(eqn.primitive)
    reads = entry.window(eqn, invals) if entry is not None and entry.window else []
    return [(a, start, size) for a, start, size in reads if not one_position(size)]


def _ragged_variable(ctx: Ctx, *dims) -> str | None:
    """The one ragged variable ``dims`` mention, None when they mention another or several."""
    names = {n for d in dims if d is not None and is_sym(d) for n in dim_vars(d)}
    return names.pop() if len(names) == 1 and names <= ctx.recorder.ragged else None


def _note_row_floor(ctx: Ctx, eqn, invals) -> None:
    """Record (`RowFloor`) the shortest row a window of a ragged length fits: the window
    ``[start, start + size)`` of a row of length ``n(t)`` fits when ``n(t) >= start(t) +
    size(t)`` (a traced start is clamped to ``>= 0``). JAX proved that for every length from
    the variable's declared min up; the lengths below it are checked here (rows shorter than
    the min are accepted: a min is often there for JAX alone, ``x[:, 1:]`` of a scan)."""
    entry = lookup_rule(eqn.primitive)
    if not ctx.recorder.ragged or entry is None or entry.window is None:
        return
    shape = eqn.invars[0].aval.shape
    for axis, start, size in _window_starts(eqn, invals):
        n = shape[axis]
        var = _ragged_variable(ctx, n, start, size) if is_sym(n) else None
        if var is None:
            continue
        lo, _ = dim_bounds(var_dim(var, n.scope))
        short = [t for t in range(int(lo)) if _reads_past(var, t, n, start, size)]
        _raise_floor(ctx, RowFloor(var, max(short, default=-1) + 1, ctx.where(eqn)))


def _raise_floor(ctx: Ctx, floor: RowFloor) -> None:
    if floor.length > getattr(ctx.recorder.floors.get(floor.var), "length", 0):
        ctx.recorder.floors[floor.var] = floor


def value_floor(ctx: Ctx, eqn, d) -> RowFloor | None:
    """The shortest row whose length ``d`` (``x.shape[0]`` of per-row code, as a value) means
    one thing as a number, None when every admitted row does: below the declared min, ``d``
    can be negative (``T - 1`` at a row of 0), and then the jaxpr cannot tell the length of an
    axis (``r[1:]`` has no positions there: ``jnp.mean`` of that row alone divides by 0) from
    arithmetic on one (``r.shape[0] - 1`` is -1). Recorded only where the value becomes a
    float (`_eval_row_varying`): as an index (``r[::-1]`` reads ``T - 1 - iota``) an empty row
    reads nothing either way."""
    var = _ragged_variable(ctx, d)
    if var is None:
        return None
    lo, _ = dim_bounds(var_dim(var, d.scope))
    negative = [t for t in range(int(lo)) if int(evaluate_dim(d, {var: t})) < 0]
    if not negative:
        return None
    floor = max(negative) + 1
    return RowFloor(var, floor, ctx.where(eqn), why=(
        f"uses the length {d} as a number, which is negative for a row shorter than {floor}: "
        f"whether that is an axis with no positions or arithmetic on one is not in the program "
        f"(drop the shorter rows)"))


def _reads_past(var: str, t: int, n, start, size) -> bool:
    """Whether the window ``[start, start + size)`` of an axis of length ``n`` reads past the
    end of a row where ``var`` is ``t``. A size that divides by the length (``jnp.roll``'s
    ``mod(-1, T)``) has no value at a length it divides by zero (JAX's own sizes are >= 1;
    NumPy would warn and call it 0): that window has no positions to read past."""
    with np.errstate(divide="raise", invalid="raise"):
        try:
            at = {name: int(evaluate_dim(d, {var: t}))
                  for name, d in (("n", n), ("start", start), ("size", size)) if d is not None}
        except (FloatingPointError, ZeroDivisionError):
            return False
    return at["size"] > 0 and max(at.get("start", 0), 0) + at["size"] > at["n"]


def window_fits_admitted_rows(ctx: Ctx, n, size, start: int) -> bool:
    """Whether the window ``[start, start + size)`` of a ragged axis of length ``n`` fits every
    row a call admits, so that clamping its start per row changes nothing: JAX's bounds show
    ``n - size - start >= 0`` from the declared min up, and the rows below the min that it
    does not fit are refused (`_note_row_floor`)."""
    if not is_sym(n) or _ragged_variable(ctx, n, size) is None:
        return False
    room = n - size - start
    if not is_sym(room):
        return int(room) >= 0
    return dim_bounds(room)[0] >= 0


def _eval_row_varying(ctx: Ctx, eqn, invals, rows: str | None = None) -> list:
    """An equation reading a per-row value (`Known.per_row`), or reading a value made from
    lengths alone along ``rows``' ragged lengths: run once per row (``jax.vmap`` over the held
    rows axis, the row's own lengths bound), and collapse each result onto its rows axis when
    it has one -- row ``b`` of the result is what row ``b`` computes."""
    entry = lookup_rule(eqn.primitive)
    if rows is None and entry is not None and entry.inline:
        return entry.rule(ctx, eqn, invals)      # a call: its equations meet the value
    # A rule that reads a per-row value itself (an index held per row, a scan's constant),
    # cheaper than running the whole equation once per row; None where it declines.
    held = entry.row_varying if rows is None and entry else None
    out = held(ctx, eqn, invals) if held is not None else None
    if out is not None:
        ctx.recorder.rewritten.add(id(eqn))
        return _as_outputs(ctx, eqn, out)
    held_rows = [k.per_row for k in ctx.operands]
    rows = rows or next(r for r in held_rows if r)
    if eqn.primitive.name == "broadcast_in_dim":
        (x,) = invals
        shape, dims = eqn.params["shape"], tuple(eqn.params["broadcast_dimensions"])
        axes = [a for a in ctx.row_axes(shape, rows) if a not in dims]
        if len(axes) == 1:      # straight onto the rows axis: no per-row copies
            return [lax.broadcast_in_dim(x, tuple(shape), (axes[0], *dims))]
    ragged = {n: v for n, v in ctx.rows.items() if v[1] == rows}

    def one_row(lengths, *xs):
        sizes = {**ctx.sizes, **dict(zip(ragged, lengths))}
        row = Ctx(sizes, ctx.recorder, ctx, ctx.eqn,
                   {n: v for n, v in ctx.rows.items() if n not in ragged})
        row.own_sizes = True
        return tuple(row.evaluate(eqn, list(xs), [PLAIN if k.per_row else k.passed_on()
                                                   for k in ctx.operands]))

    below = next((k.below for k in ctx.operands if k.per_row and k.below), None)
    if below is not None and eqn.primitive.name == "convert_element_type" and jnp.issubdtype(
            eqn.params["new_dtype"], jnp.inexact):
        _raise_floor(ctx, below)
    lengths = [v[0] for v in ragged.values()]
    outs = jax.vmap(one_row, in_axes=(0, *[0 if r else None for r in held_rows]))(
        lengths, *invals)
    results, stated = [], []
    for out, v in zip(outs, eqn.outvars):
        axes = ctx.row_axes(getattr(v.aval, "shape", ()), rows)
        if not axes:            # held per row, the rows in front
            results.append(out)
            stated.append(Known(per_row=rows, below=below))
            continue
        if len(axes) > 1:
            raise NoRule(f"a per-row value meets a value with several {rows} axes")
        diag = jnp.diagonal(out, axis1=0, axis2=axes[0] + 1)   # (..., rows) last
        results.append(like_aval(jnp.moveaxis(diag, -1, axes[0]), v.aval))
        stated.append(None)
    ctx.results = stated
    return results


# --------------------------------------------------------------------------------------------
# The registry: one entry per primitive, polyexec's own rules and the user's alike

# --------------------------------------------------------------------------------------------


def rewrite(closed_jaxpr: jax.extend.core.ClosedJaxpr, sizes_at: Mapping[str, int],
            rows_at: Mapping[str, tuple[int, str]] | None = None) -> Logical:
    """The logical program of a symbolic flat program.

    ``closed_jaxpr`` is the traced program; ``sizes_at`` maps each length variable's name to
    the position of the program input (an int32 scalar) that holds its real size; ``rows_at``
    maps a variable ragged along rows (``T``, per-row lengths from a ``lengths_of`` input) to
    ``(position of the int32 lengths input, rows variable name)``. The rewrite runs once, here (the user's Python does not run again); ``Logical.fn`` replays its result
    and traces under the same symbolic shapes, so it can be exported and compiled per bucket
    like the original.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> (T,) = jax.export.symbolic_shape("T, ", constraints=["T <= 64"])
    >>> avals = [jax.ShapeDtypeStruct((), np.int32), jax.ShapeDtypeStruct((T,), np.float32)]
    >>> program = jax.jit(lambda t, x: (jnp.mean(x),)).trace(*avals).jaxpr
    >>> logical = rewrite(program, {"T": 0})      # T's real size is input 0
    >>> exported = jax.export.export(jax.jit(logical.fn))(*avals)
    >>> padded = np.array([1.0, 2.0, 3.0, np.nan], np.float32)   # real size 3, bucket 4
    >>> float(exported.call(np.int32(3), padded)[0])
    2.0
    """
    jaxpr = closed_jaxpr.jaxpr
    n = len(jaxpr.invars)
    for name, at in sizes_at.items():
        aval = jaxpr.invars[at].aval if is_int(at) and 0 <= at < n else None
        if aval is None or getattr(aval, "shape", None) != () or aval.dtype != np.int32:
            got = f"input {at}: {aval.str_short()}" if aval is not None else repr(at)
            raise OptionError(f"rewrite: sizes_at[{name!r}]: expected the position of an int32 "
                              f"scalar input (0..{n - 1}), received {got}")
    recorder = Recorder(ragged=frozenset(rows_at or ()))
    if not recorder.touched(jaxpr):
        return Logical(fn=replay(closed_jaxpr), unsupported=(), rewritten=0)

    def logical(*args):
        sizes = {name: args[at] for name, at in sizes_at.items()}
        rows = {name: (args[at], by) for name, (at, by) in (rows_at or {}).items()}
        ctx = Ctx(sizes, recorder, rows=rows)
        outs = eval_jaxpr(ctx, jaxpr, closed_jaxpr.consts, args)
        for i, k in enumerate(ctx.results):
            if k is not None and k.per_row:
                # A per-row number with no rows axis to hold it: which row's is meant?
                recorder.unsupported.setdefault(("output", i), Unsupported(
                    "output", f"output {i}", f"a per-row value (a ragged length used as a "
                    f"number) is returned without a {k.per_row} axis to hold it"))
                outs[i] = outs[i][0]
        return tuple(outs)

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
             for v in jaxpr.invars]
    traced = jax.jit(logical).trace(*avals).jaxpr
    return Logical(fn=replay(traced), unsupported=tuple(recorder.unsupported.values()),
                   rewritten=len(recorder.rewritten), floors=tuple(recorder.floors.values()))


def replay(closed):
    def logical_program(*flat):
        return tuple(jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *flat))
    return logical_program

