"""Stage 6, planner: trace a function into its `Plan` -- one program, or a chain of them.

A function without data-dependent sizes is one segment: traced once over symbolic lengths
(`_trace`), rewritten to logical lengths (`_logical`). A function with data-dependent sizes is
planned as a chain of programs.

MXNet's dynamic-shape executor splits a graph at an op whose output size depends on the data
into three parts — before, the op, after — and runs them one after another, the op deciding its
output shape at run time. Here the partition points are the ``length=K`` arguments of
`px.compact`, `px.nonzero`, `px.loop_until` and `px.partition`, and each part is its own
symbolic program:

* **Segment 0** is the function up to (and including) the first partition point; it returns
  the op's upper-bound buffer and its count.
* **Segment i** takes the original inputs, the values handed over at points ``0 .. i-1`` as
  new inputs whose cut axis has the symbolic size ``K_j``, and ``valid_length`` of every
  variable so far (last, as in every program); it runs up to point ``i`` (or, for the last
  segment, returns the function's outputs).

Each segment is traced by running the user function once (``traces == number of segments``):
points before the segment's own return their injected inputs, the segment's point stops the
function (a private exception caught by the traced wrapper). Each segment is exported once over
symbolic sizes and compiled once per bucket combination it actually runs at — never retraced per
bucket. Each is rewritten to logical lengths like any plan. At run time the executor runs
segment 0 at the inputs' bucket, reads the count on the
host (the one synchronisation per partition point), slices the buffer to the smallest bucket of
``K`` that holds it and runs the next segment there.

Values computed before a cut and used after it are *recomputed* in the later segment from the
original inputs (only the partition point's own values cross the cut); code that only fed
earlier partition points is dead in later segments and XLA drops it when compiling.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core
import numpy as np
from jax import export

from . import _dynamic, _logical
from ._bind import Signature, bind, example_args
from ._convention import Convention
from ._errors import OptionError, PolymorphismError, SpecError
from ._jax_internals import dce_jaxpr
from ._plan import CutPoint, Plan, Program, Segment, Verdict
from ._recover import below_traced, recover, recoverable
from ._spec import LengthVar, Spec, bucket_sizes, call_variables, spec_leaves
from ._trace import (RAISE_AT_MOST, Failed, RaisedMin, TraceCounter, Traced, concrete_jaxpr,
                     export_flat, fmt_sizes, size_dependence, trace_symbolic, where)


def _wrap(fn, context: _dynamic.Context):
    """``fn`` as traced for one segment: stops at the segment's partition point and returns
    what crosses the cut; in bounded mode returns ``(outputs, counts)``."""

    def wrapped(*args):
        context.points.clear()
        context.counts.clear()
        context.defined.clear()
        context.cut = None
        context.user_tree = None
        with _dynamic.active(context):
            try:
                out = fn(*args)
            except _dynamic.Cut as cut:
                leaves, treedef = jax.tree_util.tree_flatten(cut.values)
                context.cut = CutPoint(cut.index, cut.var, cut.where, treedef, cut.axes, cut.fills,
                                       tuple(tuple(x.shape) for x in leaves),
                                       tuple(np.dtype(x.dtype) for x in leaves))
                return tuple(leaves) + (cut.count,)
        keyed, context.user_tree = jax.tree_util.tree_flatten_with_path(out)
        context.user_paths = [jax.tree_util.keystr(k) for k, _ in keyed]
        if context.counts:
            return out, tuple(context.counts[name] for name, _ in context.points)
        return out

    wrapped.__name__ = getattr(fn, "__name__", "fn")
    wrapped.__wrapped__ = fn
    return wrapped


def logical_export(traced: Traced, convention: Convention, masking: bool, *,
                   lazy: bool = False) -> tuple[Any, str | None, tuple[_logical.RowFloor, ...]]:
    """Stage 4 applied to one traced program: ``(program, padding_reason, row_floors)``. The
    `Program` is the logical rewrite, or the traced program with the reason it is not one (or
    `Failed`, when that program cannot be lowered over symbolic sizes); ``row_floors`` are the
    shortest ragged rows the logical program reads right (`_logical.RowFloor`).

    ``lazy``: the rewrite runs now (it decides the verdict) but its export waits for the first
    padded call -- for a plan whose calls may all run packed. The rewrite has traced the
    logical program already, so what waits is its lowering; should that fail, the padded call
    raises naming the cause (it cannot fall back: the verdict has been given)."""
    if not masking:
        return (Program(traced.exported), "masking=False: the program runs over the padded "
                                          "sizes as written", ())
    if not convention.variables:
        return Program(traced.exported), None, ()
    try:
        logical = _logical.rewrite(traced.jaxpr, convention.sizes_at, convention.rows_at)
        if not logical.unsupported:
            if lazy:
                return Program(build=lambda: _export_late(logical.fn, traced.avals)), None, \
                    logical.floors
            return Program(export_flat(logical.fn, traced.avals)), None, logical.floors
    except Exception as e:  # noqa: BLE001 - a rule that fails is a verdict, never a crash
        culprit = getattr(e, "equation", None)
        at = f"{where(culprit)}: {culprit.primitive.name}: " if culprit is not None else ""
        return Program(traced.exported), (
            f"{at}the logical rewrite failed ({type(e).__name__}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})"), ()
    return Program(traced.exported), _unsupported_reason(logical), logical.floors


def _export_late(fn: Callable, avals: Sequence[Any]) -> Any:
    try:
        return export_flat(fn, avals)
    except Exception as e:  # noqa: BLE001 - named, never a silent fallback
        raise PolymorphismError(f"the padded program could not be exported for a padded call "
                                f"({type(e).__name__}: {e}); run with layout='pack' or "
                                f"masking=False") from e


def packed_export(traced: Traced, convention: Convention) -> Program:
    """The packed `Program` (``layout="pack"``) of one traced program, or one whose reason
    names the user's line where packed rows cannot keep a result."""
    names = {v.name for v in convention.variables}
    rows_at = convention.rows_at
    if rows_at and names - set(rows_at) - {by for _, by in rows_at.values()}:
        return Program(reason=f"length variables other than the packed one and its rows "
                              f"({', '.join(sorted(names))})")
    try:
        logical = _logical.rewrite_packed(traced.jaxpr, convention.sizes_at, rows_at)
        if not logical.unsupported:
            return Program(export_flat(logical.fn, logical.avals),
                           empty_cells=logical.per_sequence,
                           reads_sequence=logical.reads_sequence, rooms=logical.rooms)
    except Exception as e:  # noqa: BLE001 - a rule that fails is a verdict, never a crash
        return Program(reason=f"the packed rewrite failed ({type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})")
    return Program(reason=_unsupported_reason(logical))


def _unsupported_reason(logical: _logical.Logical) -> str:
    """The first equation no rule made logical, naming the user's line, and how many more."""
    first = logical.unsupported[0]
    more = len(logical.unsupported) - 1
    return f"{first.where}: {first.primitive}: {first.detail}" + (
        f" (and {more} more)" if more else "")


def _collect_dims(obj, out: list) -> None:
    """Every symbolic dimension in a jaxpr: avals of all variables, and equation parameters
    (``broadcast_in_dim`` shapes, ``dim_as_value``, sub-programs), recursively."""
    if export.is_symbolic_dim(obj):
        out.append(obj)
    elif isinstance(obj, jax.extend.core.ClosedJaxpr):
        _collect_dims(obj.jaxpr, out)
    elif isinstance(obj, jax.extend.core.Jaxpr):
        for v in list(obj.constvars) + list(obj.invars) + list(obj.outvars):
            _collect_dims(getattr(getattr(v, "aval", None), "shape", ()), out)
        for eqn in obj.eqns:
            for v in list(eqn.invars) + list(eqn.outvars):
                _collect_dims(getattr(getattr(v, "aval", None), "shape", ()), out)
            _collect_dims(eqn.params, out)
    elif isinstance(obj, dict):
        for value in obj.values():
            _collect_dims(value, out)
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            _collect_dims(value, out)
    elif isinstance(getattr(obj, "shape", None), tuple):
        _collect_dims(obj.shape, out)


def _liveness(closed, names: Sequence[str]):
    """``(live jaxpr, used inputs, live variable names)``. The live jaxpr drops code no output
    depends on (XLA drops it too when compiling): a later segment still traces the code that
    fed earlier partition points, but only as dead code. A variable is live when a symbolic
    dimension anywhere in the live program mentions it."""
    pruned = dce_jaxpr(closed.jaxpr)
    if pruned is None:  # without the private API every input and variable counts as live
        return closed, [True] * len(closed.jaxpr.invars), set(names)
    jaxpr, used = pruned
    dims: list = []
    _collect_dims(jaxpr, dims)
    text = " ".join(str(d) for d in dims)
    live = {n for n in names if re.search(rf"\b{re.escape(n)}\b", text)}
    return jax.extend.core.ClosedJaxpr(jaxpr, closed.consts), list(used), live


def _trace_segment(fn, signature: Signature, in_vars: Sequence[LengthVar],
                   cuts: tuple[CutPoint, ...], context: _dynamic.Context,
                   counter: TraceCounter, raised: Sequence[RaisedMin] = ()
                   ) -> tuple[Convention, Traced | Failed]:
    """Segment ``len(cuts)``: the function run with the values handed over at ``cuts``
    injected as new inputs (of symbolic size ``K`` along each cut axis)."""
    convention = Convention.of(signature, list(in_vars) + [c.var for c in cuts],
                               [h for c in cuts for h in c.handed()])

    def inject(values: list) -> None:
        context.injected = []
        for c in cuts:
            leaves, values = values[:len(c.shapes)], values[len(c.shapes):]
            context.injected.append(_dynamic.Injected(
                c.var.name, jax.tree_util.tree_unflatten(c.treedef, leaves), c.treedef))

    return convention, trace_symbolic(_wrap(fn, context), convention, counter,
                                      inject if cuts else None, raised)


def _lowered(traced: Traced | Failed) -> Traced | Failed:
    """``traced``, or why its program cannot be lowered over symbolic sizes."""
    if isinstance(traced, Traced) and isinstance(traced.exported, Failed):
        return traced.exported
    return traced


def _timed(seconds: dict[str, float], stage: str, fn: Callable, *args):
    """``fn(*args)``, its wall seconds added to ``seconds[stage]`` (`Plan.seconds`)."""
    start = time.perf_counter()
    try:
        return fn(*args)
    finally:
        seconds[stage] = seconds.get(stage, 0.0) + time.perf_counter() - start


def _segment(context: _dynamic.Context, index: int, cuts: tuple[CutPoint, ...],
             convention: Convention, traced: Traced, masking: bool,
             seconds: dict[str, float]) -> Segment:
    """A segment of a partitioned (or bounded) plan: its logical program, what it hands on,
    and which of its inputs and variables the live program uses."""
    program, padding_reason, floors = _timed(seconds, "rewrite", logical_export, traced,
                                             convention, masking)
    variables = convention.variables
    live_jaxpr, live_inputs, live_names = _liveness(traced.jaxpr, [v.name for v in variables])
    if context.cut is not None:
        out_tree = context.cut.treedef
        out_paths = [path for path, _, _ in context.cut.handed()] + [f"cut {context.cut.var.name}: count"]
        count_names = ()
    else:
        out_tree, out_paths = context.user_tree, list(context.user_paths)
        count_names = tuple(n for n, _ in context.points) if context.counts else ()
        out_paths = out_paths + [f"count of {n}" for n in count_names]
    return Segment(index=index, convention=convention, programs={"pad": program}, jaxpr=live_jaxpr,
                   out_tree=out_tree, out_paths=tuple(out_paths), padding_reason=padding_reason,
                   live_variables=tuple(v for v in variables if v.name in live_names),
                   live_inputs=tuple(live_inputs), cut=context.cut, inputs_from=cuts,
                   count_names=count_names, row_floors=(*traced.floors, *floors),
                   callbacks=traced.callbacks)


def _single(fn, name: str, convention: Convention, traced: Traced | Failed,
            masking: bool, pack: bool, seconds: dict[str, float]) -> Plan:
    """The plan of a function without data-dependent sizes: one segment, every input live."""
    in_vars = convention.variables
    everything = dict(live_variables=tuple(in_vars), live_inputs=(True,) * len(convention.slots))
    if isinstance(traced, Failed):
        segment = Segment(0, convention, programs={}, jaxpr=None, out_tree=None, out_paths=(),
                          padding_reason=None, **everything)
        return Plan(name, tuple(in_vars), (segment,), fn=fn, seconds=seconds, verdict=Verdict(
            traced.reason, "reshaping is impossible: each bucket runs the function as retraced "
                           "at the bucket's sizes", traced.split_sizes,
            raise_min=traced.raise_min))
    # A plan that may pack exports its padded program when a call first runs padded.
    pad, padding_reason, floors = _timed(seconds, "rewrite", functools.partial(
        logical_export, lazy=pack), traced, convention, masking)
    if isinstance(pad.exported if pad.built else None, Failed):
        return _single(fn, name, convention, pad.exported, masking, pack, seconds)
    programs = {"pad": pad}
    if pack:
        programs["pack"] = (_timed(seconds, "packed rewrite", packed_export, traced, convention)
                            if masking and padding_reason is None else Program(
            reason=f"the pad layout is not exact either: {padding_reason}"))
        if programs["pack"].reason is not None and not pad.built:
            # Every call runs padded: exported now, a program JAX lowers only from a raised
            # min (``cumsum(diff(x))``: 'T - 1' >= '1') takes the pad layout's path to it.
            try:
                pad.exported
            except PolymorphismError:
                if not isinstance(traced.exported, Failed):
                    raise
                return _single(fn, name, convention, traced.exported, masking, pack, seconds)
    segment = Segment(0, convention, programs, traced.jaxpr, traced.out_tree, traced.out_paths,
                      padding_reason, **everything, row_floors=(*traced.floors, *floors),
                      callbacks=traced.callbacks)
    return Plan(name, tuple(in_vars), (segment,), Verdict(padding=padding_reason), fn=fn,
                seconds=seconds)


def plan_function(fn, signature: Signature, variables: Mapping[str, LengthVar],
                  input_names: Sequence[str], out_specs: Any, counter: TraceCounter, *,
                  name: str, partition: bool = True, masking: bool = True,
                  check_sizes: bool = False,
                  bucket_sizes: Mapping[str, Sequence[int]] | None = None,
                  pack: bool = False) -> Plan:
    """Trace ``fn`` into its `Plan`: one segment when it defines no data-dependent size, else
    one segment per partition point plus one (one Python trace each). Pure: nothing but
    ``counter`` is written.

    A function that JAX's own shape rules cannot trace at a variable's declared min
    (``logits[:, :-1]`` with ``x[:, 1:]`` at ``T >= 1``: ``'T - 1' >= '1'``) is traced again
    with that min raised as far as the rule needs (`RaisedMin`, at most `RAISE_AT_MOST`): one
    more Python trace, once, and a plan whose buckets start there. A call's shorter ragged rows
    run as rows below a declared min do (the rewrite reads them at their own length; a fixed
    window refuses the rows it would read past); an unragged size below it is refused by name
    (`Plan.raised_mins`). Where the raise is larger, or the raised trace fails too, the plan
    stays reshaping-impossible and its reason says what the min would have to be."""
    plan_at = functools.partial(_plan_at, fn, signature, input_names=input_names,
                                out_specs=out_specs, counter=counter, name=name,
                                partition=partition, masking=masking, check_sizes=check_sizes,
                                pack=pack)
    first = plan = plan_at(variables, bucket_sizes=bucket_sizes)
    raised: dict[str, RaisedMin] = {}
    while plan.reshaping_is_impossible and plan.verdict.raise_min is not None:
        need = dataclasses.replace(plan.verdict.raise_min,
                                   declared=variables[plan.verdict.raise_min.var].min)
        if need.min - need.declared > RAISE_AT_MOST or (
                need.var in raised and raised[need.var].min >= need.min):
            break
        raised[need.var] = need
        var = variables[need.var]
        at = {**variables, need.var: LengthVar(var.name, min=need.min, max=var.max,
                                               buckets=var.buckets)}
        plan = plan_at(at, bucket_sizes=bucket_sizes and {
            n: [s for s in sizes if s >= at[n].min] or [at[n].max]
            for n, sizes in bucket_sizes.items()}, raised=tuple(raised.values()))
    if not raised:
        return _suggest_min(first)
    if not plan.reshaping_is_impossible:
        return dataclasses.replace(plan, verdict=dataclasses.replace(
            plan.verdict, raised=tuple(raised.values())))
    # Raised, it fails otherwise: the plan at the declared min stands, saying what was tried.
    tried = ", ".join(f"{r.var} >= {r.min}" for r in raised.values())
    return dataclasses.replace(first, verdict=dataclasses.replace(
        first.verdict, raise_min=None,
        reshaping=f"{first.reason.rstrip('.')}; traced again at {tried}, where JAX decides "
                  f"that, it fails: {_suggest_min(plan).reason}"))


def _suggest_min(plan: Plan) -> Plan:
    """``plan``, its reason saying which min would let JAX decide the failing comparison,
    where polyexec does not raise it itself (more than `RAISE_AT_MOST` above the declared)."""
    need = plan.verdict.raise_min
    if need is None:
        return plan
    return dataclasses.replace(plan, verdict=dataclasses.replace(
        plan.verdict, reshaping=f"{plan.reason.rstrip('.')}; it holds from {need.var} = "
                                f"{need.min} up: declare px.LengthVar({need.var!r}, "
                                f"min={need.min}, ...) (polyexec raises a min by at most {RAISE_AT_MOST} itself)"))


def _plan_at(fn, signature: Signature, variables: Mapping[str, LengthVar], *,
             input_names: Sequence[str], out_specs: Any, counter: TraceCounter, name: str,
             partition: bool, masking: bool, check_sizes: bool,
             bucket_sizes: Mapping[str, Sequence[int]] | None, pack: bool,
             raised: Sequence[RaisedMin] = ()) -> Plan:
    """`plan_function` at the given variables' bounds (``raised``: those above the declared)."""
    in_vars = [variables[n] for n in input_names]
    mode = "partition" if partition else "bounded"

    def new_context():
        return _dynamic.Context(mode, [], input_names=frozenset(input_names), variables=variables)

    context, seconds = new_context(), {}
    convention, traced = _timed(seconds, "trace", _trace_segment, fn, signature, in_vars, (),
                                context, counter, raised)
    data_named = [n for s in spec_leaves(out_specs) for n in s.var_names if n not in input_names]
    if context.points:
        # A partitioned plan judges each segment as written, before rewriting it: after a cut,
        # a program that cannot be lowered is an error, not a fallback.
        traced = _lowered(traced)
    failed = isinstance(traced, Failed)
    if failed and not context.points and recoverable(traced):
        # JAX could not trace it over symbolic sizes: concrete traces with the length axes
        # recovered may still make it one program (`_recover`); a function that reaches a
        # partition point there is left as it is.
        probe = new_context()
        recovery = _timed(seconds, "recover", recover, _wrap(fn, probe), convention, counter,
                          traced)
        if not probe.points:
            unrecovered, traced = traced, recovery.traced
            failed = isinstance(traced, Failed)
    if failed or not context.points:
        if data_named and failed:
            raise PolymorphismError(
                f"{name}: out_specs name the data-dependent size(s) {data_named}, which "
                f"need a shape-polymorphic function, but {traced.reason}")
        if data_named:
            raise SpecError(
                f"{name}: out_specs name {data_named}, which no input Spec uses and no "
                f"px.compact/nonzero/loop_until/partition(..., length=...) defines")
        plan = _single(fn, name, convention, traced, masking, pack, seconds)
        if not failed and traced.recovered and masking and plan.padding_reason is not None:
            # Recovered, but the rewrite cannot keep padding out of it: the verdict that names
            # the failure (and the form that traces once) says more than the rewrite's.
            traced = dataclasses.replace(unrecovered, reason=(
                f"{unrecovered.reason} [recovered from the traces at "
                f"{'; '.join(fmt_sizes(s) for s in traced.recovered)}, but not padding-safe: "
                f"{plan.padding_reason}]"))
            plan = _single(fn, name, convention, traced, masking, pack, seconds)
        elif not failed and traced.recovered:
            below = below_traced(convention, traced.recovered,
                                 unrecovered.reason.split(": ")[0])
            plan = dataclasses.replace(plan, verdict=dataclasses.replace(
                plan.verdict, raised=(*plan.verdict.raised, *below)))
        if check_sizes and not plan.reshaping_is_impossible and not traced.recovered:
            # (A recovered program was compared at three sizes already.)
            # The traced program's output shapes are the logical one's (a rewrite changes no
            # shape), and reading them exports nothing.
            reason = _timed(seconds, "size check", size_dependence, fn, convention,
                            traced.jaxpr.out_avals, plan.out_paths, counter, bucket_sizes)
            if reason is not None:
                plan = _single(fn, name, convention, Failed(reason), masking, pack, seconds)
        return plan

    segments = [_segment(context, 0, (), convention, traced, masking, seconds)]
    cuts: list[CutPoint] = []
    dynamic = [context.defined[n] for n, _ in context.points] if mode == "bounded" else []
    while context.cut is not None:
        cuts.append(context.cut)
        dynamic.append(context.cut.var)
        context = new_context()
        convention, traced = _timed(seconds, "trace", _trace_segment, fn, signature, in_vars,
                                    tuple(cuts), context, counter, raised)
        traced = _lowered(traced)
        if isinstance(traced, Failed):
            raise PolymorphismError(
                f"segment {len(cuts)} of {name} (after {cuts[-1].where}): {traced.reason}; every "
                f"segment after a data-dependent op must be shape-polymorphic (or run with "
                f"partition=False)")
        segments.append(_segment(context, len(cuts), tuple(cuts), convention, traced, masking,
                                 seconds))
    missing = [n for n in data_named if n not in {v.name for v in dynamic}]
    if missing:
        raise SpecError(f"{name}: out_specs name {missing}, which no input Spec uses and "
                        f"no partition point defines (defined: {[v.name for v in dynamic]})")
    padding = next((s.padding_reason for s in segments if s.padding_reason), None)
    return Plan(name, tuple(in_vars), tuple(segments), Verdict(padding=padding), mode=mode,
                dynamic=tuple(dynamic), fn=fn, seconds=seconds)


def trace(fn: Callable, *args_or_specs: Any, buckets: Mapping[Any, Any] | None = None,
          check_sizes: bool = True, masking: bool = True,
          variables: Sequence[LengthVar] = ()) -> Plan:
    """Trace ``fn`` once over symbolic lengths and return its plan, without compiling.

    Each argument is either a `Spec` (a length-polymorphic array) or a concrete value (a model,
    a constant: its arrays keep their shapes and are stored with the plan by `Plan.save`). With
    ``check_sizes`` the plan is also traced at two concrete sizes and compared, catching code
    that branches on a size (``if x.shape[1] > 1000``) although the symbolic trace passed.

    >>> import jax.numpy as jnp, polyexec as px
    >>> T = px.LengthVar("T", min=2, max=512)
    >>> def bad(x):
    ...     return x * jnp.arange(512)[: x.shape[0]]
    >>> plan = px.trace(bad, px.Spec("T", jnp.float32))
    >>> plan.reshaping_is_impossible
    True
    """
    if not callable(fn):
        raise OptionError(f"trace: fn: expected a callable, received {type(fn).__name__} {fn!r}")
    name = getattr(fn, "__name__", type(fn).__name__)
    in_specs = tuple(a if isinstance(a, Spec) else None for a in args_or_specs)
    resolved = call_variables(in_specs, None, buckets, variables, f"trace({name})")
    sizes = {n: bucket_sizes(v, resolved.policies.get(n)) for n, v in resolved.variables.items()}
    fixed = [a for a in args_or_specs if not isinstance(a, Spec)]
    call = bind(example_args(in_specs, resolved.variables, fixed, f"trace({name})"), in_specs,
                resolved.variables)
    plan = plan_function(fn, call.signature, resolved.variables, resolved.inputs, None,
                         TraceCounter(), name=name, masking=masking, check_sizes=check_sizes,
                         bucket_sizes=sizes)
    if plan.reshaping_is_impossible:
        _raise_if_bug(fn, plan.segments[0].convention, sizes, plan.reason)
        return plan
    return dataclasses.replace(plan, constants=tuple(call.arrays)) if plan.mode == "single" else plan


def _raise_if_bug(fn, convention: Convention, sizes, reason: str) -> None:
    """A genuine bug fails at every concrete size: raise it rather than call it
    non-polymorphic. Code written for the maximum (`x + jnp.zeros(1024)`, a reshape to a literal
    size) fails at the smallest bucket but works at the largest: that is the non-polymorphic
    case, so try both before deciding. A reshape that divides only for some sizes fails at both
    and is still no bug: JAX says so ("divide evenly"), and the plan's reason names its line."""
    names = [v.name for v in convention.variables]
    smallest = {n: sizes[n][0] for n in names}
    largest = {n: sizes[n][-1] for n in names}
    first = None
    for sizes_at in [smallest] if smallest == largest else [smallest, largest]:
        try:
            concrete_jaxpr(fn, convention, sizes_at, TraceCounter())
            return
        except Exception as e:  # noqa: BLE001 - whatever it is, it is re-raised below
            first = first or e
    if "divide evenly" in reason or "divisible" in reason:
        return
    raise first
