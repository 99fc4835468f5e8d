"""What a rule may ask of its layout: the interface every layout's evaluation context
implements, declared once.

A rule (``(ctx, eqn, invals) -> outputs``, registered with `_registry.defrule`) is handed the
layout it runs in as ``ctx``, as JAX's batching rules are handed each operand's batch
dimension: the rule says what the primitive does along a length, the layout does what differs
between padded rows (`_core.Ctx`: a tail of padding after each row's real length), ragged rows
(the same context with per-row lengths) and packed rows (`_packed.PackedCtx`: several
sequences a row). `Layout` is what every rule may call; `PackedLayout` adds what only the
packed rules (``layout="pack"``, ``"per_cell"``, ``"per_sequence"``) ask. Nothing else of a
context is a rule's business (tests/test_architecture.py holds the family modules to it).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ._basics import PLAIN


@runtime_checkable
class Layout(Protocol):
    """The evaluation context of one (sub-)program in one layout."""

    sizes: dict[str, Any]     # each length variable's real size (an int32 tracer) by name
    rows: dict[str, Any]      # a ragged variable -> (its per-row lengths, its rows variable)
    alive: Any                # inside a scan over a ragged length: the rows still running
    recorder: Any             # what the rewrite found (`_core.Recorder`)
    # The current equation's operands' annotations (`_basics.Known`) by position, as JAX's
    # batching hands a rule its operands' ``dims``; a rule may state its outputs' in
    # ``results`` (a call's: what its program made from lengths or positions alone).
    operands: tuple
    results: Any

    # -- axes and lengths ---------------------------------------------------------------------

    def rows_of(self, d) -> str | None:
        """The rows variable of the ragged variables ``d`` mentions (None: not ragged)."""

    def row_axes(self, shape, rows: str) -> list[int]:
        """The axes of ``shape`` that are the rows axis ``rows``."""

    def length(self, d, shape=None, shared=None):
        """The logical (real) length of an axis of size ``d`` (of a value of ``shape``): an
        int, or an int32 tracer, per row or per cell where the layout holds several."""

    def exact_extent(self, d):
        """The size of an axis of length ``d`` in the exact-size call ``jax.jit`` would see."""

    def physical(self, d):
        """The bucket size of an axis of length ``d``, as a value."""

    def per_row(self, d, *, as_value: bool = False):
        """``d`` at each row's lengths: an int32 ``(B,)`` vector."""

    def own_length(self, eqn, d, rows: str):
        """``d`` as a number (``x.shape[1]``) in per-row code: each row's own, the current
        equation's one output (its form stated in ``results``: per row, or per sequence of
        packed rows)."""

    def count(self, d):
        """``d`` as a number at the real sizes (a count over ragged rows sums their lengths)."""

    def row_mask(self, rows: str):
        """The real rows of a rows axis, or None when every row is."""

    def rows_vector_shape(self, rows: str):
        """The shape of the per-row lengths of ``rows``."""


    def child(self, eqn, *, alive=None) -> "Layout":
        """The context of a sub-program of ``eqn`` (a scan body, a branch)."""

    def fill_tail(self, x, axes, fill, shared=None, known=PLAIN):
        """``x`` with ``fill`` past the logical length of each of ``axes``; ``known``: its
        annotation (``operands[i]`` for operand ``i``; None: unknown)."""

    # -- the families' operations: what differs between layouts ------------------------------

    def reduce(self, eqn, invals, fills, axes):
        """``eqn`` reducing its operands over ``axes`` (one a length), ``fills`` their
        identities."""

    def accumulate(self, eqn, x, axis: int, monoid, reverse: bool):
        """A cumulative ``eqn`` of ``x`` along the length ``axis``."""

    def reverse(self, x, axis: int):
        """``x`` reversed along the length ``axis`` within each real length."""

    def top_k(self, eqn, x, axis: int):
        """``top_k`` of ``x`` along the length ``axis``."""

    def check_relayout(self, src, dst) -> None:
        """Raise `NoRule` when this layout cannot move elements between ``src``'s and
        ``dst``'s axes (a reshape)."""

    def sort_key(self, shape, axis: int):
        """A leading int32 sort key that keeps every real cell among its own."""

    def window(self, eqn, x, monoid):
        """A window ``eqn`` of ``x`` that reads the identity past each real length."""


@runtime_checkable
class PackedLayout(Layout, Protocol):
    """Packed rows: ``var`` (T) packed along ``rows_name`` (B); per cell of the ``(B, T)``
    grid, ``pos`` (its position in its sequence, -1 in padding) and ``seglen`` (its
    sequence's length). Several ragged variables (an encoder-decoder's S and T) pack each in
    its own grid: ``var``, ``pos`` and ``seglen`` are those of the equation being rewritten,
    and `NoRule` where it meets several; what takes a length ``d`` reads ``d``'s grid."""

    var: str
    rows_name: str
    pos: Any
    seglen: Any

    def var_of(self, d) -> str | None:
        """The packed variable a length is an expression of, None for none."""

    def asking_in(self, var: str):
        """A context in which what takes no length asks in ``var``'s grid."""

    def paired_axes(self, shape) -> list[int]:
        """Inside a scan over one packed length: the axes of another whose cells pair with
        the step's cell (its example's cells only)."""

    def packed_axes(self, shape) -> list[int]:
        """Axes whose length is an expression of the packed variable (T, T - 1)."""

    def one_frame(self, shape) -> tuple[int, int] | None:
        """``(rows axis, packed axis)`` of a value with exactly one of each, else None."""

    def frame_axes(self, shape, what: str, along: int | None = None) -> tuple[int, int]:
        """``(rows axis, packed axis)`` of a value ``what`` reads, or `NoRule` when it mixes
        sequences of a packed row."""

    def cells(self, d):
        """``(pos, seglen)`` of the first ``d`` columns."""

    def sequence_index(self, d):
        """Each cell's sequence's index in the call's batch (-1 where none is)."""

    def in_frame(self, d):
        """The cells inside the frame of an axis of packed length ``d``."""

    def starts(self, d, fill: int | None = None):
        """Per cell in the frame, the column where its sequence starts."""

    def sequence_starts(self):
        """Per cell of a sequence, the column where the sequence starts."""

    def frame(self, shape):
        """The cells of a value of ``shape`` that hold real positions of one sequence."""

    def frame_only(self, x, fill):
        """``x`` with ``fill`` outside its frame."""

    def ends(self, d):
        """Per cell, the column where its sequence's part ends."""

    def at_lengths(self, d, seglen, *, as_value: bool = False):
        """``d`` at each cell's sequence length."""

    def held_per_cell(self, values) -> list:
        """``values``, the current equation's outputs, held per cell (``_basics.Known.per_cell``:
        a value without the rows axis that differs per sequence, the rows axis in front)."""

    def held_per_sequence(self, values, axes) -> list:
        """``values``, the current equation's outputs, held per sequence
        (``_basics.Known.per_sequence``: each sequence's entry at every cell of it), each
        with its logical rows axis in ``axes`` (None: a number per sequence)."""

    def refuse_per_sequence(self, eqn, what: str, outputs=None) -> list:
        """``eqn``'s outputs (those at ``outputs``; None: all) as ``what``, a per-sequence
        value no rule keeps: not packed (``_basics.Known.unpackable``), naming its line."""
