"""Stage 3, trace: run the user's function once over symbolic lengths and export its program.

Pure functions, no executor: `trace_symbolic` returns the `Traced` program or the reason it
cannot be size-independent (naming the user's line); `trace_at` is the slow path, one trace at
concrete bucket sizes. Both go through `flat_program`, the user function as a function of the
flat arrays its `Convention` orders.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import linecache
import operator
import os
import re
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax import export

from ._context import (ConcreteSizeRequested, binding, describe_frame, equation_line,
                       is_jax_internal, is_library, user_frame)
from ._convention import Convention
from ._errors import PolyexecError
from ._forms import symbolic_trace
from ._logical import RowFloor
from ._jax_internals import (DIM_EQ_CODE, DIM_NE_CODE, DIM_ORDER_CODES, InconclusiveDimension,
                             UnexpectedDimVar, dim_bounds, dim_vars, evaluate_dim,
                             undecided_comparison)
from ._spec import symbolic_dims

# Errors JAX raises when a symbolic dimension meets code that needs a concrete one:
# `int(T)`/`range(T)` (TypeError), `if T > 10` (InconclusiveDimensionOperation), broadcasting
# against a literal maximum (TypeError/ValueError), indexing with one (IndexError), an op that
# jax.export cannot lower over a symbolic size (NotImplementedError: FFT), an eager op under
# `jax.ensure_compile_time_eval` given a symbolic size (UnexpectedDimVar: equinox's RoPE cache),
# a method a symbolic size lacks (AttributeError: jnp.linalg.matrix_rank's ``max(M, N).astype``).
# jax.export and jax core each define an InconclusiveDimensionOperation (unrelated classes):
# `int(T)` raises the first, a reshape to a literal size (`x.reshape(-1, 16)`) the second.
SHAPE_ERRORS = (InconclusiveDimension,
                jax.errors.InconclusiveDimensionOperation,
                jax.errors.ConcretizationTypeError, TypeError, ValueError, IndexError,
                AttributeError, NotImplementedError, UnexpectedDimVar)


class TraceCounter:
    """How many times Python ran the user function (thread-safe)."""

    def __init__(self):
        self.count = 0
        self._lock = threading.Lock()

    def bump(self):
        with self._lock:
            self.count += 1


@dataclasses.dataclass(frozen=True, eq=False)
class Traced:
    """One traced program: its symbolic jaxpr and output structure. ``exported``, the program
    as written lowered by `jax.export`, is made on first use: a plan whose logical rewrite
    exports never needs it (lowering a GRU train step takes 0.4 s of a 0.9 s trace)."""

    jaxpr: Any
    out_tree: Any
    out_paths: tuple[str, ...]
    avals: tuple[Any, ...]       # the symbolic input avals: their scope is the program's
    lower: Callable[[], Any] = dataclasses.field(repr=False)
    # Ragged rows the trace's branches rule out (`_logical.RowFloor`, `_record_branch_floor`).
    floors: tuple[Any, ...] = ()
    # jax.debug.print / jax.debug.callback taken out of the program (`HostCallbacks`), or None.
    callbacks: "HostCallbacks | None" = None
    # The concrete sizes the program was recovered from (`_recover`), empty for a symbolic trace.
    recovered: tuple[Mapping[str, int], ...] = ()

    @functools.cached_property
    def exported(self) -> Any:
        """The `jax.export.Exported` program, or `Failed` naming why it cannot be lowered over
        symbolic sizes (``jnp.fft`` over a symbolic length)."""
        return self.lower()


def flat_program(fn: Callable, convention: Convention, bucket: Mapping[str, int] | None,
                 counter: TraceCounter, out_cell: list,
                 inject: Callable[[list], None] | None = None):
    """``fn`` as a function of its convention's flat arrays. Values handed across a cut go to
    ``inject`` (the partition context) before ``fn`` runs. Each trace writes
    ``(out_tree, out_paths)`` into ``out_cell``."""

    def run(*flat):
        counter.bump()
        parts = convention.split(flat)
        if inject is not None:
            inject(parts.handed)
        args = convention.signature.unflatten(parts.arrays, parts.poly)
        with binding(parts.sizes, bucket):
            out = fn(*args)
        arrays, out_tree = _static_outputs_apart(out)
        keyed = jax.tree_util.tree_flatten_with_path(arrays)[0]
        leaves = [jnp.asarray(leaf) if _is_number(leaf) else leaf for _, leaf in keyed]
        out_cell[:] = [out_tree, tuple(jax.tree_util.keystr(k) for k, _ in keyed)]
        return tuple(leaves)

    run.__name__ = getattr(fn, "__name__", "fn")
    return run


def _is_number(leaf) -> bool:
    """A Python or NumPy number, or ``x.shape[0]``: an output value, as jax.jit returns it."""
    return isinstance(leaf, (int, float, complex, np.generic)) or export.is_symbolic_dim(leaf)


def _is_array(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray)) or hasattr(leaf, "aval")


class _StaticOutputs:
    """An output whose leaves are not all arrays or numbers (a model holding its activation
    function, returned by a train step): the arrays are the program's outputs, and the other
    leaves are static -- returned as the trace made them, the same at every bucket (equinox's
    filter semantics, as for the arguments). Its treedef (`_static_outputs_apart`) puts them
    back when the outputs are unflattened."""

    def __init__(self, arrays, static):
        self.arrays, self.static = arrays, static


class _Identity:
    """Aux data compared by identity: static leaves need not be hashable."""

    def __init__(self, value):
        self.value = value


jax.tree_util.register_pytree_node(
    _StaticOutputs, lambda w: ((w.arrays,), _Identity(w.static)),
    lambda aux, children: jax.tree_util.tree_map(
        lambda a, s: s if a is None else a, children[0], aux.value, is_leaf=lambda x: x is None))


def _static_outputs_apart(out) -> tuple[Any, Any]:
    """``(arrays, out_tree)``: the output's arrays and numbers (None elsewhere), and the
    treedef whose unflatten gives the user's output back from them. A static leaf is a
    function or a string; anything else could hide a traced value, and is refused by path."""
    keyed = jax.tree_util.tree_flatten_with_path(out)[0]
    for keypath, leaf in keyed:
        if not (_is_array(leaf) or _is_number(leaf) or callable(leaf)
                or isinstance(leaf, (str, bytes))):
            raise PolyexecError(f"output out{jax.tree_util.keystr(keypath)}: expected an array, "
                                f"a number, or a static function or string, received "
                                f"{type(leaf).__name__}")
    if all(_is_array(x) or _is_number(x) for _, x in keyed):
        return out, jax.tree_util.tree_structure(out)
    arrays = jax.tree_util.tree_map(lambda x: x if _is_array(x) or _is_number(x) else None, out)
    static = jax.tree_util.tree_map(lambda x: None if _is_array(x) or _is_number(x) else x, out)
    return arrays, jax.tree_util.tree_structure(_StaticOutputs(arrays, static))


def array_outputs(out_tree):
    """The structure of an output's arrays alone (static leaves as None): what ``out_specs``
    describe."""
    if out_tree.node_data() is not None and out_tree.node_data()[0] is _StaticOutputs:
        return out_tree.children()[0]
    return out_tree


# -- reading a jaxpr --------------------------------------------------------------------------


def where(eqn) -> str:
    """``file:line: `code``` of the user line that made an equation (`equation_line`)."""
    return equation_line(eqn) or "<unknown>"


def sub_jaxprs(eqn) -> Iterator[Any]:
    for value in eqn.params.values():
        for item in (value if isinstance(value, (tuple, list)) else (value,)):
            if isinstance(item, jax.extend.core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jax.extend.core.Jaxpr):
                yield item


def walk(jaxpr) -> Iterator[Any]:
    """Every equation, depth first, sub-programs (scan bodies, branches) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn):
            yield from walk(sub)


def evaluate_shape(shape, env: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(int(evaluate_dim(d, env)) for d in shape)


# -- undecidable size comparisons ---------------------------------------------------------------

# JAX answers a symbolic `==` it cannot decide with False (`__eq__` may not raise: hashing uses
# it), so `if x.shape[0] == 20:` silently takes the `else` branch for every size. While
# polyexec traces, a profile function on the tracing thread alone (`sys.setprofile` is
# per-thread) sees each `_DimExpr.__eq__` return; undecided comparisons made by user code are
# recorded and the plan becomes reshaping-impossible with the line named. Nothing of JAX is
# replaced: other threads, and JAX's own comparisons (its caches compare keys holding
# dimensions), never see or make a verdict.

@dataclasses.dataclass(frozen=True)
class Comparison:
    where: str
    text: str              # e.g. "T == 20"
    name: str | None       # the variable, when one variable is compared with a constant
    constant: int | None
    # Set when the comparison was decided only because the trace raised a variable's min
    # (`RaisedMin`): it answers otherwise for the shorter rows the call still admits.
    raised: "RaisedMin | None" = None


def _undecided(diff) -> bool:
    for decided in (lambda: diff >= 1, lambda: diff <= -1):
        try:
            if decided():
                return False
        except InconclusiveDimension:
            pass
    return True


def _comparing_frame(frame):
    """The frame that made the comparison: past `!=` (JAX's `__ne__` calls `__eq__`) and past
    generated dunder methods (a dataclass key's `__eq__`, file ``<string>``), whose caller is
    the one comparing."""
    caller = frame.f_back
    if caller is not None and caller.f_code is DIM_NE_CODE:
        caller = caller.f_back
    while (caller is not None and caller.f_code.co_filename.startswith("<")
           and caller.f_code.co_name.startswith("__") and caller.f_code.co_name.endswith("__")):
        caller = caller.f_back
    return caller


def _branching_frame(frame):
    """The user's frame whose branch a comparison of symbolic dimensions decides (a library's
    branch counts at the user's call into it), or None for JAX's own comparisons (caches,
    shape rules), which are not the user's branch."""
    caller = _comparing_frame(frame)
    if caller is None or is_jax_internal(caller.f_code.co_filename):
        return None
    return _users_call(caller)


def _users_call(caller):
    """The user's frame that called into ``caller``'s library (equinox's branch on a size, at
    the user's call into it), ``caller`` itself when it is the user's."""
    while caller is not None and is_library(caller.f_code.co_filename):
        caller = caller.f_back
    return caller


def _compared(frame):
    """``(self, other)`` of a symbolic dimension's comparison method, None when ``other`` is
    neither an integer nor a dimension of the same scope."""
    self, other = frame.f_locals.get("self"), frame.f_locals.get("other")
    if export.is_symbolic_dim(other):
        return (self, other) if self.scope is other.scope else None
    return (self, other) if isinstance(other, (int, np.integer)) else None


def _line_of(caller) -> str:
    line = linecache.getline(caller.f_code.co_filename, caller.f_lineno).strip()
    return f"{caller.f_code.co_filename}:{caller.f_lineno}" + (f": `{line}`" if line else "")


def _record_comparison(frame, records: list) -> None:
    caller = _branching_frame(frame)
    compared = _compared(frame) if caller is not None else None
    if compared is None:
        return
    self, other = compared
    diff = self - other
    if not export.is_symbolic_dim(diff) or not _undecided(diff):
        return
    single = re.fullmatch(r"[A-Za-z_]\w*", str(self)) and isinstance(other, (int, np.integer))
    records.append(Comparison(_line_of(caller), f"{self} == {other}", str(self) if single else None,
                              int(other) if single else None))


_OPERATORS = {"==": operator.eq, ">=": operator.ge, "<=": operator.le, ">": operator.gt,
              "<": operator.lt}


def _answered_otherwise(self, other, op: str, answer: bool, var: str, sizes) -> list[int]:
    """The ``sizes`` of ``var`` at which ``self op other`` is not ``answer``."""
    return [t for t in sizes if _OPERATORS[op](int(evaluate_dim(self, {var: t})),
                                               int(evaluate_dim(other, {var: t}))) != answer]


def _record_raise_decided(frame, op: str, answer: bool, records: list,
                          raised: Sequence["RaisedMin"]) -> None:
    """Record a comparison of the user's code that JAX decided (``answer``) only because the
    trace raised a variable's min: ``if x.shape[1] == 1`` answers False at ``T >= 2``, yet a
    row of length 1, which the call still admits, would take the other branch."""
    caller = _branching_frame(frame)
    compared = _compared(frame) if caller is not None else None
    if compared is None:
        return
    self, other = compared
    names = dim_vars(self - other)
    for r in raised:
        if r.var not in names:
            continue
        # Another variable in the comparison: its answer for the short rows is unknown.
        if len(names) > 1 or _answered_otherwise(self, other, op, answer, r.var,
                                                 range(r.declared, r.min)):
            records.append(Comparison(_line_of(caller), f"{self} {op} {other}", None, None, r))
            return


def _is_jnp(filename: str) -> bool:
    """``jax.numpy``'s own code: a size comparison there is the function's meaning
    (``jnp.linspace``'s ``num > 1``), where lax's and core's are shape rules and caches."""
    return f"{os.sep}jax{os.sep}_src{os.sep}numpy{os.sep}" in os.path.abspath(filename)


def _record_branch_floor(frame, op: str, answer: bool, floors: list,
                         below: Mapping[str, int]) -> None:
    """A ragged row below its variable's declared min (``below``: var -> min) is admitted
    (the min is often there for JAX alone), but the trace assumed the min: a branch of the
    user's code, a library's or jnp's that the min decided (``if n > 1``; ``jnp.linspace``'s
    ``num > 1`` at T >= 2) would go the other way for such a row, its result silently another.
    Record the shortest row that takes the traced branch (`_logical.RowFloor`)."""
    caller = _comparing_frame(frame)
    if caller is None:
        return
    jnp_code = _is_jnp(caller.f_code.co_filename)
    if is_jax_internal(caller.f_code.co_filename) and (not jnp_code or op == "=="):
        return      # jnp's == are broadcasting's size-1 and emptiness checks, the same either way
    compared = _compared(frame)
    if compared is None:
        return
    self, other = compared
    names = dim_vars(self - other)
    if len(names) != 1 or next(iter(names)) not in below:
        return
    (var,) = names
    # jnp's ``size < 1`` guards keep an empty array off an error path (a max of nothing); an
    # empty row has no cell either way, and its results are the rewrite's.
    other_way = _answered_otherwise(self, other, op, answer, var,
                                    range(1 if jnp_code else 0, below[var]))
    if not other_way:
        return
    caller = _users_call(caller)    # the user's call into jnp or the library
    floor = max(other_way) + 1
    floors.append(RowFloor(var, floor, _line_of(caller) if caller is not None else "<unknown>",
                           why=(f"branches on `{self} {op} {other}`, which the declared min of "
                                f"{var} decides ({answer}); a row shorter than {floor} would "
                                f"take the other branch (drop or pad shorter rows)")))


@contextlib.contextmanager
def _comparisons_recorded(records: list, raised: Sequence["RaisedMin"] = (),
                          floors: list | None = None,
                          below: Mapping[str, int] | None = None) -> Iterator[None]:
    previous = sys.getprofile()
    if previous is not None and not callable(previous):
        # A C-level profiler (cProfile) cannot be chained from Python: leave it in charge.
        # Comparisons then go unrecorded; the two-size check (check_sizes) still applies.
        yield
        return

    def profile(frame, event, arg):
        if event == "return" and isinstance(arg, bool):
            if frame.f_code is DIM_EQ_CODE:
                if arg is False:
                    _record_comparison(frame, records)
                if raised:
                    _record_raise_decided(frame, "==", arg, records, raised)
                if below:
                    _record_branch_floor(frame, "==", arg, floors, below)
            elif frame.f_code in DIM_ORDER_CODES:
                if raised:
                    _record_raise_decided(frame, DIM_ORDER_CODES[frame.f_code], arg, records,
                                          raised)
                if below:
                    _record_branch_floor(frame, DIM_ORDER_CODES[frame.f_code], arg, floors,
                                         below)
        if previous is not None:
            previous(frame, event, arg)

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(previous)


# -- the symbolic trace -------------------------------------------------------------------------


# The most a variable's min is raised for a shape rule of JAX's (`RaisedMin`): a slice's
# constant offset (`x[:, 1:]`, `x[:, 2:]`) needs a few positions; a larger size compared with
# (RoPE's cache of 64) is a bucket boundary, not a short row.
RAISE_AT_MOST = 8


@dataclasses.dataclass(frozen=True)
class RaisedMin:
    """A length variable traced at a higher min than declared: JAX's own shape rule for the
    user's line ``where`` cannot decide ``comparison`` at the declared min (``x[:, 1:]`` at
    ``T >= 1``: ``'T - 1' >= '1'``), and does from ``min`` up. The program then runs at buckets
    of at least ``min``; a call's ragged rows shorter than that are read as the rewrite reads
    rows below a declared min (a fixed window refusing the rows it would read past,
    `_logical.RowFloor`), and an unragged size below ``min`` is refused by name."""

    var: str
    declared: int
    min: int
    where: str
    comparison: str
    # Why sizes below ``min`` are not run, where it is not JAX's comparison: a program
    # recovered from concrete traces (`_recover`) was never traced below them.
    why: str = ""

    def explain(self) -> str:
        return self.why or f"needs it (JAX cannot decide {self.comparison} below it)"

    def describe(self) -> str:
        return (f"{self.var} traced at {self.var} >= {self.min} (declared min={self.declared}): "
                f"{self.where} {self.explain()}")


@dataclasses.dataclass(frozen=True)
class Failed:
    """Why a function cannot be traced once for all sizes. ``split_sizes``: sizes that must be
    bucket boundaries for the per-bucket fallback to take the branches the exact sizes take
    (from undecidable ``T == c`` comparisons). ``raise_min``: the min that lets JAX decide the
    comparison that failed, where only a shape rule of JAX's own made it (not a branch of the
    user's code)."""

    reason: str
    split_sizes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    raise_min: RaisedMin | None = None
    # Whether concrete traces may stand in for the symbolic one (`_recover`): not for a size
    # asked for (`px.max_length`), a debug callback, nor a branch of the user's own code.
    recoverable: bool = True


def trace_symbolic(fn: Callable, convention: Convention, counter: TraceCounter,
                   inject: Callable[[list], None] | None = None,
                   raised: Sequence[RaisedMin] = ()) -> Traced | Failed:
    """The one symbolic trace of ``fn`` over its convention's inputs; see `trace_program`.
    ``raised``: the variables whose min the convention holds raised above the declared one."""
    cell: list = []
    run = flat_program(fn, convention, None, counter, cell, inject)
    variables = convention.variables
    avals = convention.avals(symbolic_dims(variables))
    # Handed values have no concrete stand-in: a failure there is judged by its message alone.
    concrete = None if convention.count("handed") else {v.name: v.max for v in variables}
    # Ragged rows may be shorter than their variable's min (`_record_branch_floor`).
    below = {v.name: v.min for v in variables if v.name in convention.rows_at and v.min > 0}
    return trace_program(run, avals, [v.name for v in variables], cell, concrete,
                         bounds={v.name: (v.min, v.max) for v in variables}, raised=raised,
                         below=below)


def trace_program(run: Callable, avals: Sequence[Any], names: Sequence[str], cell: list,
                  concrete: Mapping[str, int] | None = None, *,
                  bounds: Mapping[str, tuple[int, int]] | None = None,
                  raised: Sequence[RaisedMin] = (),
                  below: Mapping[str, int] | None = None) -> Traced | Failed:
    """Trace a flat program over symbolic avals (its lowering waits for `Traced.exported`). A
    failure that needs a concrete size, or a size comparison JAX cannot decide, gives `Failed`
    with the user's line -- tracing, or lowering when it comes; any other exception is a bug in
    the function and propagates. ``cell`` receives (out_tree, out_paths).

    Some failures do not say they are about sizes (NumPy's ``table[:x.shape[0]]`` raises a
    plain TypeError): with ``concrete`` sizes, an error that a trace at those sizes does not
    raise counts as a polymorphism failure too.

    ``bounds`` (per variable, its ``(min, max)``): a comparison that only a shape rule of
    JAX's could not decide gets the min that decides it (`Failed.raise_min`). ``raised``: the
    mins the trace runs at that are raised above the declared ones; a comparison of the user's
    code that only the raise decides is a failure, naming the line."""
    jitted = jax.jit(run)
    comparisons: list[Comparison] = []
    floors: list = []
    failure = functools.partial(_shape_failure, jitted=jitted, run=run, avals=avals, names=names,
                                concrete=concrete, bounds=bounds or {})
    try:
        with _comparisons_recorded(comparisons, raised, floors, below), symbolic_trace():
            jaxpr = jitted.trace(*avals).jaxpr
    except ConcreteSizeRequested as e:
        line = linecache.getline(e.filename, e.lineno).strip()
        return Failed(f"{e.filename}:{e.lineno}: `{line}`: px.max_length({e.name!r}) needs the "
                      f"concrete bucket size", recoverable=False)
    except SHAPE_ERRORS as e:
        return failure(e)
    decided = next((c for c in comparisons if c.raised is not None), None)
    if decided is not None:
        r = decided.raised
        return Failed(f"{decided.where}: `{decided.text}` is decided only at {r.var} >= {r.min}, "
                      f"where polyexec traces because {r.where} needs it, and a row shorter "
                      f"than {r.min} (declared min={r.declared}) would take the other branch",
                      recoverable=False)
    if comparisons:
        first = comparisons[0]
        splits: dict[str, set[int]] = {}
        for c in comparisons:
            if c.name is not None:
                splits.setdefault(c.name, set()).update({c.constant - 1, c.constant})
        return Failed(f"{first.where}: `{first.text}` cannot be decided for every size (JAX's "
                      f"symbolic == answers False), so the branch depends on the size",
                      {n: tuple(sorted(s)) for n, s in splits.items()})

    callbacks = None
    nested = next((e for top in jaxpr.jaxpr.eqns for sub in sub_jaxprs(top)
                   for e in walk(sub) if e.primitive.name in DEBUG_CALLBACKS), None)
    if nested is not None:
        # Inside a loop, a branch or an inner jit, a call cannot become an output of the
        # program (it may run any number of times): the export would refuse it.
        return Failed(f"{where(nested)}: jax.debug.print/jax.debug.callback inside a "
                      f"sub-program (a loop, a branch, an inner jit or a checkpoint): only "
                      f"calls at the function's top level run in a bucketed program (their "
                      f"values read back on the host); move the call out of it",
                      recoverable=False)
    if any(e.primitive.name in DEBUG_CALLBACKS for e in jaxpr.jaxpr.eqns):
        hoisted = hoist_callbacks(jaxpr)
        if isinstance(hoisted, Failed):
            return hoisted
        jaxpr, callbacks = hoisted
        # The program without them (their operands as outputs): no Python re-run either.
        jitted = jax.jit(jax.extend.core.jaxpr_as_fun(jaxpr))

    def lower():
        # jit cached the trace above: lowering reads its jaxpr without running Python again.
        try:
            return export.export(jitted)(*avals)
        except SHAPE_ERRORS as e:
            return failure(e)

    return Traced(jaxpr, cell[0], cell[1], tuple(avals), lower, tuple(floors), callbacks)


# -- host callbacks -------------------------------------------------------------------------------

# jax.debug.print's and jax.debug.callback's primitives.
DEBUG_CALLBACKS = frozenset({"debug_print", "debug_callback"})


@dataclasses.dataclass(frozen=True)
class HostCallbacks:
    """The ``jax.debug.print`` / ``jax.debug.callback`` calls of a program, taken out of it.

    `jax.export` refuses a program that calls back into Python ("serialization of
    host_callbacks is not yet implemented"), and it cannot be asked to keep one: the
    executable is compiled with the Python functions it calls. So the program is exported
    without them, each callback's operands becoming extra outputs after its own (from
    ``start`` on), and `run` calls each one on the host with those values once the program has
    run, in program order -- as JAX's own ``debug_callback`` does, on the values the exact
    call computes (the rewrite keeps padding out of them). Only values of fixed shape are
    taken out (a loss, a sum); one with a length axis is a `Failed` naming the line. A plan
    holding callbacks runs and compiles as any other; `Plan.save` refuses it by name.
    """

    start: int
    # Per call: (primitive, params, operands: ("out", k) an extra output or ("lit", value),
    # the user's line).
    calls: tuple[tuple[Any, Mapping[str, Any], tuple[tuple[str, Any], ...], str], ...]

    @property
    def outputs(self) -> int:
        return sum(1 for *_, ops, _ in self.calls for kind, _ in ops if kind == "out")

    def describe(self) -> str:
        return ", ".join(where for *_, where in self.calls)

    def run(self, outputs: Sequence[Any]) -> list[Any]:
        """``outputs`` without the callbacks' values, after calling each callback on them."""
        values = list(outputs[self.start:self.start + self.outputs])
        for primitive, params, operands, _ in self.calls:
            args = [values[k] if kind == "out" else k for kind, k in operands]
            primitive.bind(*args, **params)      # eager: JAX's own impl calls the callback
        return list(outputs[:self.start]) + list(outputs[self.start + self.outputs:])


def hoist_callbacks(closed) -> "tuple[Any, HostCallbacks] | Failed":
    """``closed`` (a ClosedJaxpr) without its top-level ``debug_print``/``debug_callback``
    equations, their
    operands appended to its outputs, and the `HostCallbacks` that calls them; `Failed` when
    one prints a value with a length axis (the extra output would carry its padding)."""
    jaxpr = closed.jaxpr
    kept, extra, calls = [], [], []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in DEBUG_CALLBACKS:
            kept.append(eqn)
            continue
        operands = []
        for v in eqn.invars:
            if isinstance(v, jax.extend.core.Literal):
                operands.append(("lit", v.val))
                continue
            if any(export.is_symbolic_dim(d) for d in v.aval.shape):
                return Failed(f"{where(eqn)}: jax.debug.print/jax.debug.callback of a value of "
                              f"shape {tuple(str(d) for d in v.aval.shape)}, which has a length "
                              f"axis: a bucketed program runs on padded arrays, so only values "
                              f"of fixed shape are called back (print a reduction, e.g. its sum "
                              f"or its shape)")
            operands.append(("out", len(extra)))
            extra.append(v)
        calls.append((eqn.primitive, dict(eqn.params), tuple(operands), where(eqn)))
    effects = frozenset().union(*(e.effects for e in kept)) if kept else frozenset()
    debug_info = jaxpr.debug_info
    if debug_info is not None and isinstance(debug_info.result_paths, tuple):
        debug_info = debug_info._replace(result_paths=(
            *debug_info.result_paths, *(f"[debug callback {i}]" for i in range(len(extra)))))
    new = jax.extend.core.Jaxpr(jaxpr.constvars, jaxpr.invars, [*jaxpr.outvars, *extra], kept,
                                effects, debug_info)
    return (jax.extend.core.ClosedJaxpr(new, closed.consts),
            HostCallbacks(len(jaxpr.outvars), tuple(calls)))


def _shape_failure(error: BaseException, *, jitted, run: Callable, avals: Sequence[Any],
                   names: Sequence[str], concrete: Mapping[str, int] | None,
                   bounds: Mapping[str, tuple[int, int]]) -> Failed:
    """`Failed` for a shape error raised tracing or lowering ``run``; re-raises an ordinary bug
    (one that names no symbolic size and that a trace at ``concrete`` sizes raises too)."""
    if not (about_symbolic_dims(error, names) or _traces_at(run, avals, concrete)):
        raise error
    raise_min = _min_deciding(error, bounds)
    if raise_min is not None:
        return Failed(failure_reason(error), raise_min=raise_min)
    if _users_branch(error):
        return Failed(failure_reason(error), recoverable=False)
    if user_frame(error) is None:
        # Raised while lowering (jax.export cannot lower FFT over a symbolic length): the
        # trace itself succeeded, so the equation the message names gives the line.
        culprit = _equation_named_in(jitted, avals, str(error))
        if culprit is not None:
            eqn, line = culprit
            return Failed(f"{line}: {eqn.primitive.name}: "
                          f"{type(error).__name__}: {str(error).strip().splitlines()[0]}")
    return Failed(failure_reason(error))


def _users_branch(error: BaseException) -> bool:
    """Whether ``error`` is an undecidable comparison made by the user's own code (an ``if``
    on a length): a program that branches so is reshaping-impossible, never recovered from
    concrete traces (`_recover`). A library's comparison (equinox's RoPE cache) may be."""
    for raised in _raised_from(error):
        found = undecided_comparison(raised) if isinstance(raised, InconclusiveDimension) else None
        if found is not None:
            caller = found[1]
            return caller is not None and not is_library(caller.f_code.co_filename)
    return False


def _min_deciding(error: BaseException, bounds: Mapping[str, tuple[int, int]]
                  ) -> RaisedMin | None:
    """The `RaisedMin` that lets JAX decide the comparison ``error`` reports, when a shape
    rule of JAX's own made it about one variable and a min (at most 64 above the current one)
    gives it one answer for every size up to the max (``'T - 1' >= '1'``: ``T >= 2``). None for a comparison in the user's or a library's code: that is a branch,
    and a raised min would decide it for the shorter rows too."""
    # JAX may re-raise the comparison as its own message (jnp.pad's reflect and symmetric
    # modes: a ValueError raised from it): the comparison is the cause's.
    cause = next((e for e in _raised_from(error) if isinstance(e, InconclusiveDimension)), None)
    found = undecided_comparison(cause) if cause is not None else None
    if found is None:
        return _min_resolving_max_min(error, bounds)
    diff, caller = found
    if caller is None or not is_jax_internal(caller.f_code.co_filename):
        return None
    names = dim_vars(diff)
    if len(names) != 1 or next(iter(names)) not in bounds:
        return None
    (name,) = names
    lo, hi = bounds[name]
    holds = lambda t: int(evaluate_dim(diff, {name: t})) >= 0  # noqa: E731
    for raised in range(lo + 1, min(lo + 64, hi) + 1):
        # One answer from here up (the sizes near the new min, where a slice's offset changes
        # it, and the max) is what JAX's bounds then decide.
        if len({holds(t) for t in [*range(raised, min(raised + 64, hi) + 1), hi]}) == 1:
            if not _decided_from(diff, name, raised):
                return None     # true from there, but JAX cannot show it (``mod(1, T) > 0``)
            message = str(cause).strip().splitlines()[0]
            comparison = re.search(r"comparison (.*) is inconclusive", message)
            return RaisedMin(name, lo, raised, describe_frame(user_frame(error)),
                             comparison[1] if comparison else f"{diff} >= 0")
    return None


def _max_min_forms(message: str) -> list[str]:
    """The sizes in an error's message that JAX wrote with ``max``/``min`` (``r[:-2]`` at
    ``T >= 1`` is ``max(0, T - 2)`` long, ``r[2:]`` is ``- min(T, 2) + T``): the entries,
    split at top-level commas, of each parenthesised shape that holds one."""
    forms = []
    for shape in re.findall(r"\(((?:[^()]|\([^()]*\))*)\)", message):
        depth, entry = 0, ""
        for ch in shape + ",":
            depth += (ch == "(") - (ch == ")")
            if ch == "," and depth == 0:
                if re.search(r"\b(max|min)\(", entry):
                    forms.append(entry.strip())
                entry = ""
            else:
                entry += ch
    return forms


def _min_resolving_max_min(error: BaseException, bounds: Mapping[str, tuple[int, int]]
                           ) -> RaisedMin | None:
    """A shape rule of JAX's that fails on sizes it wrote with ``max``/``min`` of one variable
    (``jnp.stack([r[:-2], r[1:-1], r[2:]])`` at ``T >= 1``: ``max(0, T - 2)`` against
    ``- min(T, 2) + T``, unequal as expressions, equal as sizes): the least min, at most
    `RAISE_AT_MOST` above the declared one, from which each form is a plain expression (``T -
    2`` from ``T >= 2``). None where the error names none, or the frame raising it is not
    JAX's (a comparison of the user's code is a branch)."""
    frames = list(_raising_frames(error))
    if not frames or not is_jax_internal(frames[-1].f_code.co_filename):
        return None
    forms = _max_min_forms(str(error).strip().splitlines()[0] if str(error).strip() else "")
    names = {n for n in bounds if any(re.search(rf"\b{re.escape(n)}\b", f) for f in forms)}
    if not forms or len(names) != 1:
        return None
    (name,) = names
    lo, hi = bounds[name]

    def plain_from(least: int, form: str) -> bool:
        try:
            (d,) = export.symbolic_shape(form, constraints=(f"{name} >= {least}",))
        except Exception:  # noqa: BLE001 - another variable, or not a size JAX parses
            return False
        return not re.search(r"\b(max|min)\(", str(d))

    for raised in range(lo + 1, min(lo + RAISE_AT_MOST, hi) + 1):
        if all(plain_from(raised, f) for f in forms):
            return RaisedMin(name, lo, raised, describe_frame(user_frame(error)),
                             f"that {' and '.join(dict.fromkeys(forms))} are equal")
    return None


def _decided_from(diff, name: str, least: int) -> bool:
    """Whether JAX's own bounds decide ``diff >= 0`` once ``name >= least``: they bound
    ``T - 2`` from a min, never ``mod(1, T)`` (jnp.pad's wrap), where a raised min would only
    fail again. Read in a scope of its own holding that constraint."""
    try:
        (d,) = export.symbolic_shape(str(diff), constraints=(f"{name} >= {least}",))
    except Exception:  # noqa: BLE001 - not expressible as a constraint: let the trace tell
        return True
    if not export.is_symbolic_dim(d):
        return True
    lo, hi = dim_bounds(d)
    return lo >= 0 or hi < 0


def _traces_at(run: Callable, avals: Sequence[Any], sizes: Mapping[str, int] | None) -> bool:
    if sizes is None:
        return False
    concrete = [jax.ShapeDtypeStruct(evaluate_shape(a.shape, sizes), a.dtype) for a in avals]
    try:
        jax.eval_shape(run, *concrete)
    except Exception:  # noqa: BLE001 - it fails at a concrete size too: the original error stands
        return False
    return True


def _equation_named_in(jitted, avals, message: str) -> tuple[Any, str] | None:
    """The equation whose primitive the message names, and its user line: its own, or that of
    the innermost enclosing call (``jnp.fft.rfft`` is itself jitted: the ``fft`` inside it was
    made by JAX's code, the call to it by the user's)."""
    try:
        jaxpr = jitted.trace(*avals).jaxpr
    except Exception:  # noqa: BLE001 - only a better line is at stake
        return None
    text = message.lower()

    def search(program, outer: str):
        for eqn in program.eqns:
            line = where(eqn)
            line = outer if line == "<unknown>" else line
            if re.search(rf"\b{eqn.primitive.name}\b", text):
                return eqn, line
            for sub in sub_jaxprs(eqn):
                found = search(sub, line)
                if found is not None:
                    return found
        return None

    return search(jaxpr.jaxpr, "<unknown>")


def failure_reason(error: BaseException) -> str:
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    cause = known_cause(error)
    return (f"{describe_frame(user_frame(error))}: {type(error).__name__}: {message}"
            + (f" -- {cause}" if cause else ""))


# Failures inside JAX or a library whose message says nothing a user can act on: what
# happened, and the form of the same computation that traces once and runs exact.

_CONV_PADDING = "padding argument to conv_general_dilated should be"

# ... and by a phrase of JAX's own message (each form checked exact, values and gradients, in
# tests/test_ragged.py).
_FORMS_THAT_WORK = {
    "differentiation does not work for lax.while_loop or lax.fori_loop": (
        "a fori_loop over a length is a while_loop to JAX (its trip count is symbolic), which "
        "has no reverse-mode derivative; write it as a scan over the positions, "
        "`lax.scan(lambda h, t: (body(t, h), None), h0, jnp.arange(x.shape[1]))[0]`, which "
        "polyexec runs over each row's real length"),
    "associative scan over axis of non-constant size": (
        "JAX's associative_scan needs a constant length; polyexec runs it over a symbolic "
        "one except with a combine that splits ties between equal cells (lax.max, lax.min: "
        "the gradients of lax.cummax and lax.cummin), whose gradient follows JAX's own order "
        "of combines at the exact length; lax.cummax and lax.cummin without gradients, and "
        "lax.scan over the positions (m = jnp.maximum(m, x_t)) with gradients, each run over "
        "each row's real length"),
}


def known_cause(error: BaseException) -> str | None:
    """Why a known idiom cannot be traced over a symbolic length, and the form that can, or
    None. A layer is recognised by the ``self`` of its call among the raising frames, so its
    cause is named whichever error the state of its cache makes JAX raise."""
    if any(_is_equinox_rope(frame.f_locals.get("self")) for frame in _raising_frames(error)):
        return ("equinox's RotaryPositionalEmbedding reads its cos/sin table at a concrete "
                "length (a process-wide cache, filled, compared with the length and sliced "
                "under jax.ensure_compile_time_eval), which JAX cannot do over a symbolic "
                "length, whatever the cache holds; each bucket is retraced. The form that "
                "traces once and is exact padded and packed: the angles from the positions, "
                "`jnp.arange(x.shape[0])[:, None] * freqs` with `freqs = theta ** "
                "(-jnp.arange(0, d, 2) / d)`, then `x * tile(cos) + rotate_half(x) * "
                "tile(sin)` as the layer computes")
    if isinstance(error, ValueError) and str(error).startswith(_CONV_PADDING):
        # JAX filters its own frames (the transpose and batching rules) out of the traceback.
        return ("JAX's rule for this convolution (its gradient, or jax.vmap of it) gives "
                "conv_general_dilated a padding that depends on the length (a stride, SAME "
                "with a stride, or a VALID window longer than the shortest length), and "
                "conv_general_dilated takes integer padding only (polyexec accepts it in "
                "`jax.lax.conv_general_dilated` while it traces; this one was bound before "
                "polyexec was imported, e.g. `from jax.lax import conv_general_dilated` or a "
                "library's default argument). The form that traces once "
                "and is exact: the stride-1 convolution with explicit padding, then a strided "
                "slice, `lax.conv_general_dilated(x, w, (1,), [(lo, hi)])[:, ::s]` (equal to "
                "stride s with that padding); a VALID convolution of stride 1 traces with the "
                "length's min at least the window's size - 1")
    for frame in _raising_frames(error):
        form = _numpy_form(frame)
        if form is not None:
            return form
    return next((form for phrase, form in _FORMS_THAT_WORK.items() if phrase in str(error)), None)


# Padding of each mode of jnp.convolve/correlate for a kernel of k taps (JAX's own, `_conv`):
# as numbers for a known k, else as the expressions.
_CONV_MODE_PADDING = {"full": lambda k: (k - 1, k - 1), "same": lambda k: (k // 2, k - k // 2 - 1),
                      "valid": lambda k: (0, 0)}
_CONV_MODE_TEXT = {"full": ("k - 1", "k - 1"), "same": ("k // 2", "k - k // 2 - 1"),
                   "valid": ("0", "0")}


def _numpy_form(frame) -> str | None:
    """The cause and the form that works for a jnp function that JAX cannot trace over a
    symbolic length, recognised by its frame among the raising ones (by the function's name
    and its arguments, as JAX names them), or None."""
    name, local = frame.f_code.co_name, frame.f_locals
    if name == "_conv" and local.get("op") in ("convolve", "correlate") \
            and local.get("mode") in _CONV_MODE_PADDING:
        op, mode = local["op"], local["mode"]
        taps = (getattr(local.get("y"), "shape", None) or (None,))[0]
        known = isinstance(taps, int)
        k = str(taps) if known else "k"
        lo, hi = _CONV_MODE_PADDING[mode](taps) if known else _CONV_MODE_TEXT[mode]
        kernel = "v[::-1]" if op == "convolve" else "jnp.conj(v)"
        return (f"jnp.{op} compares the lengths of its operands (which one is longer), which "
                f"JAX cannot do over a symbolic length; the form that traces once and is exact, "
                f"values and gradients (mode={mode!r}, a kernel v of {k} taps): "
                f"`lax.conv_general_dilated(a[None, None], {kernel}[None, None], (1,), "
                f"[({lo}, {hi})])[0, 0]` (jax.vmap it over the rows, or give a (B, 1, T) batch)"
                + (f"; its gradient is a convolution padded by min(T, {k} - 1), which JAX sees "
                   f"as {k} - 1 only where the length's min is at least that: declare "
                   f"px.LengthVar('T', min={taps - 1 if known else 'k - 1'}, ...)"
                   if mode in ("full", "valid") else ""))
    if name == "_pad_wrap":
        return ("jnp.pad's 'wrap' mode divides its widths by the length (divmod(width, T)), "
                "which JAX cannot do over a symbolic length; the form that traces once and is "
                "exact, each row wrapped at its own end (widths lo, hi up to the length): "
                "`jnp.concatenate([x[:, -lo:], x, x[:, :hi]], axis=1)` along axis 1")
    return None


def _raised_from(error: BaseException) -> Iterator[BaseException]:
    """An error, then the errors it was raised from (or while handling), innermost last."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _raising_frames(error: BaseException) -> Iterator[Any]:
    """The frames of an error's traceback and of the errors it was raised from."""
    for raised in _raised_from(error):
        tb = raised.__traceback__
        while tb is not None:
            yield tb.tb_frame
            tb = tb.tb_next


def _is_equinox_rope(layer) -> bool:
    kind = type(layer)
    return kind.__name__ == "RotaryPositionalEmbedding" and kind.__module__.startswith("equinox")


def about_symbolic_dims(error: BaseException, names: Sequence[str]) -> bool:
    if isinstance(error, SHAPE_ERRORS[:3]):
        return True
    # A symbolic dim meeting Python code (`[0.0] * T` -> _DimExpr.__rmul__) can fail with a
    # message that names neither the dim nor symbolic shapes; the raising frames still show it.
    if any(f.filename.endswith(("shape_poly.py",)) and f"{os.sep}export{os.sep}" in f.filename
           for f in traceback.extract_tb(error.__traceback__)):
        return True
    text = str(error)
    return ("_DimExpr" in text or "symbolic" in text.lower() or "polymorphism" in text.lower()
            or any(re.search(rf"\b{re.escape(n)}\b", text) for n in names))


def export_flat(run: Callable, avals: Sequence[Any]) -> Any:
    """The `jax.export.Exported` of an already-flat program (the logical rewrite of a traced
    one)."""
    return export.export(jax.jit(run))(*avals)


# -- concrete traces ----------------------------------------------------------------------------


def trace_at(fn: Callable, convention: Convention, sizes: Mapping[str, int],
             counter: TraceCounter) -> tuple[Callable, list]:
    """The slow path's program at concrete sizes: ``(flat program, out cell)``; the cell holds
    ``(out_tree, out_paths)`` once the program has been traced."""
    cell: list = []
    return flat_program(fn, convention, dict(sizes), counter, cell), cell


def concrete_jaxpr(fn, convention: Convention, sizes: Mapping[str, int], counter: TraceCounter):
    run, cell = trace_at(fn, convention, sizes, counter)
    jaxpr = jax.jit(run).trace(*convention.avals(sizes)).jaxpr
    return jaxpr, cell


def size_dependence(fn: Callable, convention: Convention, out_avals: Sequence[Any],
                    out_paths: Sequence[str], counter: TraceCounter,
                    bucket_sizes: Mapping[str, Sequence[int]]) -> str | None:
    """Trace at two concrete sizes and compare: the outputs must have the shapes the symbolic
    program predicts, and the two programs must be the same sequence of operations. Returns
    the reason when they differ: code that branches on a size (``if T > 1000``) although the
    symbolic trace passed."""
    variables = convention.variables
    names = [v.name for v in variables]
    # Not the very smallest bucket: JAX special-cases dims of size 1 (a `T - 1` axis at T=2
    # turns take_along_axis's gather into a reshape), which would flag every `x[:, :-1]` model.
    floor = {v.name: max(4, v.min + 3) for v in variables}
    small = {n: next((s for s in bucket_sizes[n] if s >= floor[n]), bucket_sizes[n][-1])
             for n in names}
    large = {n: bucket_sizes[n][-1] for n in names}
    programs = []
    for sizes in (small, large):
        jaxpr, _ = concrete_jaxpr(fn, convention, sizes, counter)
        predicted = [evaluate_shape(a.shape, sizes) for a in out_avals]
        for path, shape, var in zip(out_paths, predicted, jaxpr.jaxpr.outvars):
            actual = tuple(var.aval.shape)
            if actual != shape:
                producer = next((e for e in walk(jaxpr.jaxpr) if var in e.outvars), None)
                at = where(producer) if producer is not None else "<unknown>"
                return (f"{at}: output out{path} has shape {actual} at {fmt_sizes(sizes)}, but "
                        f"the symbolic program predicts {shape}")
        programs.append(list(walk(jaxpr.jaxpr)))
    for a, b in itertools.zip_longest(*programs):
        if a is None or b is None or a.primitive != b.primitive:
            culprit = b if b is not None else a
            return (f"{where(culprit)}: the program at {fmt_sizes(large)} differs from the one at "
                    f"{fmt_sizes(small)} ({a.primitive if a else 'nothing'} vs "
                    f"{b.primitive if b else 'nothing'}): the code branches on a size")
    return None


def fmt_sizes(sizes: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items())
