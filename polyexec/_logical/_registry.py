"""The rule registry: one entry per primitive, its rule in every layout and its facts.

Like JAX's ``batching.primitive_batchers``: the family modules (`_pointwise`, `_reductions`,
`_structure`, `_indexing`, `_contractions`, `_control`, `_random`) register each primitive's
rules next to their definitions with `defrule`; the interpreter (`_core`) asks `lookup_rule`.
`register_rule` is the same registry's public door (``px.register_rule``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from .._errors import OptionError
from .._jax_internals import definitely_equal_shape

class NoRule(Exception):
    """Raised by a rule that cannot make this equation logical; the message says why."""


ELEMENTWISE = "elementwise"

MOVES_ROWS_WHY = ("{name} selects, reorders or joins the rows ({rows}) of a value ragged along "
                  "them: each row's real length belongs to its index, so a moved row would "
                  "take the length of the row whose place it takes")


@dataclasses.dataclass(frozen=True)
class Entry:
    """All the rewrite knows of one primitive: its rule in each layout, and what it moves or
    reads along an axis, which the interpreter asks before any rule runs (JAX's batching keeps
    one table of rules; its per-primitive facts are the rules' own). A rule takes ``(ctx, eqn,
    invals)`` and returns the outputs, None when nothing needs to change, or raises `NoRule`."""

    rule: Callable | Literal["elementwise"] | None = None   # padded (and ragged) rows
    structural: bool = False   # only recurses into sub-programs: their equations count, not it
    origin: str = "polyexec's own"   # who registered the rule, for the refusal to replace it
    packed: Callable | None = None         # packed rows; None: `_packed`'s generic handling
    per_sequence: Callable | None = None   # packed rows, an input held per sequence
    per_cell: Callable | None = None       # packed rows, an input held per cell (no rows axis)
    # ``eqn -> [(operand aval, axes)]``: the axes it selects, reorders, pads, joins, accumulates
    # or scans along (`moves_ragged_rows`), as opposed to keeping each entry at its index.
    moves: Callable | None = None
    # Why moving the rows of a ragged value this way is flagged (`moves_ragged_rows`), with
    # ``{name}`` and ``{rows}``; None: `MOVES_ROWS_WHY`.
    moves_rows_why: str | None = None
    # ``(eqn, invals) -> [(axis, start, size)]``: the windows it reads (`_note_row_floor`).
    window: Callable | None = None
    # ``eqn -> [(operand index, axes)]``: the length axes it reads an operand across with the
    # tail zeroed (a contraction, a sum), zeroed once where the operand is made.
    zeroed_reads: Callable | None = None
    # ``(eqn, axes) -> axes``: an elementwise primitive of one operand that keeps its zeros
    # (``neg``; ``transpose``, which moves them to other axes): the output's zeroed tails
    # (`_basics.Known.zeroed`) from the operand's, so a reader does not mask them again (the
    # transposes of a backward pass read across the rows with their tails zeroed).
    zeroed_through: Callable | None = None
    # ``(eqn, i, axis, shape) -> bool``: whether it combines or moves the entries of operand
    # ``i`` (of ``shape``) along ``axis``. In packed rows a value held per sequence runs
    # through it once per column when it does not act on the value's rows axis (`_sequences`);
    # None: never per column, unless elementwise.
    acts_on: Callable | None = None
    # A call (jit, custom_vjp, ...): a per-row value flows through its equations as through
    # any others, rather than running it once per row (`_core._eval_row_varying`).
    inline: bool = False
    # ``(ctx, eqn, invals) -> outputs | None``: its rule for an operand held per row
    # (`Known.per_row`), cheaper than running the equation once per row; None where it declines.
    row_varying: Callable | None = None
    # ``(x: np.ndarray, params) -> np.ndarray``: index arithmetic on a small constant, folded
    # while rewriting (`_core._folded`).
    fold: Callable | None = None
    # Linear: zero operands give a zero result (`_core._only_from_empty`).
    linear: bool = False
    # Per-position maths a packed row recomputes from each cell's position (`_packed`'s
    # positions recipe: masks made from positions are compared per cell).
    positional: bool = False
    # A scan's carry passes through it unchanged in kind, one value in, one out (`_control`'s
    # test that a carry accumulates).
    carries: bool = False
    # ``(eqn, row_axes) -> bool``: whether it adds entries up across a rows axis (``row_axes``
    # gives a shape's): a sum over the rows, a weight's gradient ``x.T @ g``, an embedding's
    # rows added into its table. A scan carry that grows by one is order-free over packed
    # rows (`_control`'s test that a carry accumulates).
    sums_rows: Callable | None = None


# Keyed by primitive name (polyexec's rules, and the user's given a name) or by the primitive
# object itself (the user's given one: two primitives may share a name, as JAX's own
# registries distinguish them by object). Filled at import, then only by `register_rule`.
_REGISTRY: dict[Any, Entry] = {}
_REGISTRY_LOCK = threading.Lock()


def _register(key, rule, *, structural: bool, origin: str, override: bool) -> None:
    """The padded rule of ``key``; what else the entry holds (other layouts' rules, the
    primitive's facts) stays."""
    with _REGISTRY_LOCK:
        # A primitive object's rule would shadow one registered under its name: refused alike.
        existing = _REGISTRY.get(key) if isinstance(key, str) else lookup_rule(key)
        if existing is not None and existing.rule is not None and not override:
            name = key if isinstance(key, str) else key.name
            raise OptionError(
                f"register_rule: primitive {name!r} already has a rule ({existing.origin}); "
                f"pass override=True to replace it")
        _REGISTRY[key] = dataclasses.replace(existing or Entry(), rule=rule,
                                             structural=structural, origin=origin)


_SLOTS = {"pad": "rule", "pack": "packed", "per_sequence": "per_sequence", "per_cell": "per_cell"}


Layout = Literal["pad", "pack", "per_sequence", "per_cell"]
PAD_AND_PACK: tuple[Layout, ...] = ("pad", "pack")    # a rule that asks its layout (`Ctx.reduce`)


def defrule(*names: str, layout: Layout | tuple[Layout, ...] = "pad", structural: bool = False,
            moves: Callable | None = None, moves_rows_why: str | None = None,
            window: Callable | None = None, zeroed_reads: Callable | None = None,
            acts_on: Callable | None = None, inline: bool = False,
            row_varying: Callable | None = None, fold: Callable | None = None,
            linear: bool = False, positional: bool = False, carries: bool = False):
    """Register polyexec's rule for the primitives ``names`` (a decorator), like JAX's
    ``batching.primitive_batchers[p] = rule``: ``@defrule("rev")`` over the definition, or
    ``defrule(*names)(ELEMENTWISE)`` for pass-through primitives. ``layout``: the padded rule
    (``"pad"``, also ragged rows), the packed one (``"pack"``), or the one for an input held
    per sequence (``"per_sequence"``) or per cell (``"per_cell"``) in packed rows, each in the
    same entry; a tuple of them for a rule written once for those layouts, which asks its
    layout what differs (a family's: `Ctx.reduce`). ``structural``:
    the rule only recurses into the equation's programs (scan, cond, calls), so it is not
    counted as a rewrite itself. ``moves``, ``moves_rows_why``, ``window``, ``zeroed_reads``,
    ``acts_on``, ``inline``, ``row_varying``, ``fold``, ``linear``, ``positional``,
    ``carries``: the primitive's facts (`Entry`), stated beside its padded rule (`deffacts`
    states them for primitives registered together). Registering a slot twice is a bug,
    refused at import."""
    layouts = (layout,) if isinstance(layout, str) else layout
    facts = _facts(moves=moves, moves_rows_why=moves_rows_why, window=window,
                   zeroed_reads=zeroed_reads, acts_on=acts_on, inline=inline,
                   row_varying=row_varying, fold=fold, linear=linear, positional=positional,
                   carries=carries)

    def register(rule):
        for name in names:
            with _REGISTRY_LOCK:
                entry = _REGISTRY.get(name) or Entry()
                for one in layouts:
                    slot = _SLOTS[one]
                    if getattr(entry, slot) is not None:
                        raise OptionError(f"defrule: {name!r} already has a {one} rule")
                    entry = dataclasses.replace(
                        entry, **{slot: rule}, **({"structural": structural, **facts}
                                                  if slot == "rule" else {}))
                _REGISTRY[name] = entry
        return rule
    return register


def _facts(**given) -> dict:
    """The facts given (not None, not False)."""
    return {k: v for k, v in given.items() if v is not None and v is not False}


def deffacts(*names: str, row_varying: Callable | None = None, fold: Callable | None = None,
             linear: bool = False, positional: bool = False, carries: bool = False,
             zeroed_through: Callable | None = None, sums_rows: Callable | None = None) -> None:
    """State facts of primitives whose padded rule is already registered (a family registered
    in one `defrule` call, each with facts of its own), in the module that registered it:
    ``deffacts("add", "sub", linear=True)``; or facts written after the rule (a rule for a
    per-row operand that the padded rule's module defines below it); ``zeroed_through`` and
    ``sums_rows`` only here. Stating a fact twice is a bug, refused."""
    facts = _facts(row_varying=row_varying, fold=fold, linear=linear, positional=positional,
                   carries=carries, zeroed_through=zeroed_through, sums_rows=sums_rows)
    with _REGISTRY_LOCK:
        for name in names:
            entry = _REGISTRY.get(name)
            if entry is None or entry.rule is None:
                raise OptionError(f"deffacts: {name!r} has no padded rule to state facts of")
            twice = [k for k in facts if getattr(entry, k) not in (None, False)]
            if twice:
                raise OptionError(f"deffacts: {name!r} already states {twice}")
            _REGISTRY[name] = dataclasses.replace(entry, **facts)


def lookup_rule(primitive) -> Entry | None:
    entry = _REGISTRY.get(primitive)
    return entry if entry is not None else _REGISTRY.get(primitive.name)


def padded_rule(eqn) -> Callable:
    """The padded layout's rule of ``eqn``'s primitive: another layout's rule that reduces to
    it on some axes calls it through the table, as JAX's batching rules call each other."""
    return lookup_rule(eqn.primitive).rule


class RuleContext:
    """What a rule given to `register_rule` may ask while it rewrites one equation.

    Inside a rule, arrays carry the program's symbolic shapes: a *length axis* is one whose
    size is a symbolic dimension (``T``, ``2*T - 1``); its real, pre-padding extent is
    `length`. Positions beyond it hold padding (possibly NaN or inf).
    """

    __slots__ = ("_ctx",)

    def __init__(self, ctx: Any):      # the layout's context (`_core.Ctx`)
        self._ctx = ctx

    def length(self, dim):
        """The logical (real) length of a dimension: ``dim`` itself when it is a constant,
        else an int32 scalar computed from the real sizes (``x.shape[0]`` of a ``(T,)`` array
        -> the real ``t``)."""
        return self._ctx.length(dim)

    def fill_tail(self, x, axes, value):
        """``x`` with every position beyond the logical length of any of ``axes`` replaced by
        ``value`` (axes of constant size are left alone). A ``select``, never a multiply, so
        NaN or inf padding cannot leak: fill with the operation's identity (0 for a sum, -inf
        for a max) and the operation then reads only the real elements."""
        # Which operand ``x`` is, the rule does not say: a value of the shape of one made from
        # lengths alone is refused for all rows at once (`Ctx.length`), never zeroed wrongly.
        return self._ctx.fill_tail(x, tuple(axes), value, shared=None, known=None)


def _public(rule: Callable, name: str) -> Callable:
    """A user's rule, called with the public `RuleContext`; its result checked against the
    equation's outputs, so a wrong rule becomes a verdict naming the line, not a bad program."""
    def run(ctx, eqn, invals):
        out = rule(RuleContext(ctx), eqn, list(invals))
        if out is None:
            return None
        if not eqn.primitive.multiple_results and hasattr(out, "shape"):
            out = [out]
        out = list(out)
        if len(out) != len(eqn.outvars):
            raise NoRule(f"the rule registered for {name} returned {len(out)} outputs, "
                          f"expected {len(eqn.outvars)}")
        for i, (x, v) in enumerate(zip(out, eqn.outvars)):
            want = tuple(getattr(v.aval, "shape", ()))
            if not definitely_equal_shape(tuple(jnp.shape(x)), want):
                raise NoRule(f"the rule registered for {name} returned output {i} of shape "
                              f"{tuple(jnp.shape(x))}, expected {want}")
        return out
    return run


def register_rule(primitive, rule, *, override: bool = False) -> None:
    """Give the logical rewrite a rule for a primitive it does not know (a custom kernel, a
    Pallas call), so code using it stays exact at every bucket instead of being flagged.

    ``primitive``: a ``jax.extend.core.Primitive`` (this primitive only), or its name (any
    primitive of that name). ``rule``:

    - ``"elementwise"``: output position i reads input position i along every length axis
      (per-position maths, layout that keeps positions), so the equation runs unchanged;
    - a callable ``rule(ctx, eqn, invals)`` for the rest: ``ctx`` a `RuleContext`
      (``ctx.length(dim)``, ``ctx.fill_tail(x, axes, value)``), ``eqn`` the
      ``jax.extend.core.JaxprEqn`` (``eqn.primitive``, ``eqn.params``), ``invals`` its input
      arrays (padded; symbolic shapes). It returns the equation's outputs -- a list, one per
      output, or the array itself for a single-output primitive -- whose positions within
      the logical lengths must equal the exact-size computation; or None when nothing needs
      to change. An exception it raises becomes the plan's verdict (``padding_safe`` False,
      naming the line), never a crash. It runs once, while the plan is made.

    A primitive that already has a rule (polyexec's or an earlier registration) is refused
    unless ``override=True``.

    Packed rows (``layout="pack"``) use ``"elementwise"`` as it is. A callable rule is the
    padded layout's: it cannot know which sequence a packed cell belongs to, so there the
    equation is flagged ("... has no rule for packed rows", naming the line) and
    ``layout="auto"`` runs padded rows, where the rule holds.

    A row sum over the last axis, made exact by filling the padding with 0 first:

    >>> import jax, jax.numpy as jnp, numpy as np, polyexec as px
    >>> from jax.interpreters import mlir
    >>> row_sum_p = jax.extend.core.Primitive("doc_row_sum")
    >>> impl = lambda x: jnp.sum(x, axis=-1)
    >>> _ = row_sum_p.def_impl(impl)
    >>> _ = row_sum_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape[:-1], x.dtype))
    >>> mlir.register_lowering(row_sum_p, mlir.lower_fun(impl, multiple_results=False))
    >>> T = px.LengthVar("T", max=64)
    >>> def row_sums(x):            # x: (3, T)
    ...     return row_sum_p.bind(x)
    >>> f = px.bucketed(row_sums, in_specs=(px.Spec("3 T", jnp.float32),))
    >>> f.plan.padding_safe         # the padding would be summed: flagged
    False
    >>> px.register_rule(row_sum_p, lambda ctx, eqn, invals:
    ...     [row_sum_p.bind(ctx.fill_tail(invals[0], [invals[0].ndim - 1], 0.0))])
    >>> g = px.bucketed(row_sums, in_specs=(px.Spec("3 T", jnp.float32),))
    >>> g.plan.padding_safe
    True
    >>> g(np.ones((3, 5), np.float32)).tolist()  # runs padded to a bucket, sums the 5 real
    [5.0, 5.0, 5.0]
    """
    if isinstance(primitive, jax.extend.core.Primitive):
        key, name = primitive, primitive.name
    elif isinstance(primitive, str) and primitive:
        key, name = primitive, primitive
    else:
        raise OptionError(f"register_rule: primitive: expected a jax.extend.core.Primitive or "
                          f"a primitive's name, received {primitive!r}")
    if isinstance(rule, str) and rule == ELEMENTWISE:
        value: Callable | str = ELEMENTWISE
    elif callable(rule) and not isinstance(rule, str):
        value = _public(rule, name)
    else:
        raise OptionError(f"register_rule: rule: expected one of 'elementwise' or a callable "
                          f"rule(ctx, eqn, invals), received {rule!r}")
    if not isinstance(override, bool):
        raise OptionError(f"register_rule: override: expected True or False, received "
                          f"{override!r}")
    _register(key, value, structural=False, origin="registered by register_rule",
              override=override)
