"""Stage 5b, segments: a function with data-dependent sizes is planned as a chain of programs.

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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core
import numpy as np
from jax import export

from . import _dynamic
from ._bind import Signature, bind, example_args
from ._errors import PolyexecError, PolymorphismError, SpecError
from ._plan import (Intermediate, Plan, build_plan, check_sizes_in, fmt_shape, logical_export,
                    program_lines)
from ._spec import LengthVar, Spec, bucket_sizes, call_variables, spec_leaves, symbolic_dims
from ._trace import (Failed, TraceCounter, concrete_jaxpr, evaluate_shape, export_program,
                     flat_program, input_avals, size_dependence, walk, where)

try:  # dead-code elimination of a segment's program; a private API (see _liveness)
    from jax._src.interpreters.partial_eval import dce_jaxpr
except ImportError:
    dce_jaxpr = None


@dataclasses.dataclass(frozen=True)
class CutPoint:
    """Where a segment ends: the partition point that defines ``var``.

    ``shapes`` are the handed-over values' shapes in the cutting segment (the cut axis has the
    upper bound there); the next segments receive them with ``var`` along ``axes``."""

    index: int
    var: LengthVar
    where: str
    treedef: Any
    axes: tuple[int | None, ...]
    fills: tuple[Any, ...]
    shapes: tuple[tuple[Any, ...], ...]
    dtypes: tuple[np.dtype, ...]

    def describe(self) -> str:
        return f"{self.where}: defines {self.var.name} in [{self.var.min}, {self.var.max}] = count"


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


@functools.lru_cache(maxsize=64)
def _zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return np.zeros(shape, dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class Segment:
    """One program of a `PartitionedPlan`: exported once, compiled per bucket of its live
    variables.

    ``cut`` is the partition point it stops at (None for the last segment); ``inputs_from``
    the earlier points whose values it takes as extra inputs; ``count_names`` the variables it
    defines in-program (bounded mode) and returns counts of, after its outputs.

    ``variables`` are those whose real sizes the program takes; ``live_variables`` those some
    shape of the live program depends on: it is compiled once per bucket combination of these
    alone. The dead ones (typically the input lengths in a segment that only reads what the cut
    handed over) are pinned at their minimum and their inputs fed placeholders. Without this,
    the segment after a filter would compile once per (input bucket, kept bucket) pair instead
    of once per kept bucket.
    """

    index: int
    name: str
    variables: tuple[LengthVar, ...]
    live_variables: tuple[LengthVar, ...]
    exported: Any
    jaxpr: Any
    input_paths: tuple[str, ...]
    live_inputs: tuple[bool, ...]
    out_tree: Any
    out_paths: tuple[str, ...]
    padding_reason: str | None
    cut: CutPoint | None = None
    inputs_from: tuple[CutPoint, ...] = ()
    count_names: tuple[str, ...] = ()

    @property
    def pinned(self) -> dict[str, int]:
        live = {v.name for v in self.live_variables}
        return {v.name: v.min for v in self.variables if v.name not in live}

    @property
    def can_donate(self) -> bool:
        # Every segment but the last is followed by one that reads the same inputs again.
        return self.cut is None

    def bucket_avals(self, bucket: Mapping[str, int]):
        env = {**self.pinned, **{v.name: int(bucket[v.name]) for v in self.live_variables}}
        return [jax.ShapeDtypeStruct(evaluate_shape(a.shape, env), a.dtype)
                for a in self.exported.in_avals]

    def program_at(self, bucket: Mapping[str, int], counter: TraceCounter):
        return self.exported.call, [self.out_tree, self.out_paths]

    def feed(self, flat: Sequence[Any], bucket: Mapping[str, int]) -> list[Any]:
        """``flat`` with zeros standing in for the inputs this segment never reads (so a dead
        input's bucket does not make it compile again)."""
        if all(self.live_inputs):
            return list(flat)
        avals = self.bucket_avals(bucket)
        return [x if live or tuple(np.shape(x)) == a.shape else _zeros(a.shape, np.dtype(a.dtype))
                for x, live, a in zip(flat, self.live_inputs, avals)]

    def __repr__(self) -> str:
        end = f"cut at {self.cut.var.name}" if self.cut else "final"
        return (f"<Segment {self.index} of {self.name}: {end}, variables "
                f"{[v.name for v in self.live_variables]}>")


@dataclasses.dataclass(frozen=True, eq=False)
class PartitionedPlan:
    """The plan of a function with data-dependent sizes: `segments`, run one after another.

    ``variables`` are the input length variables, ``dynamic`` the ones defined by data
    (``length=K``). With ``partition=False`` (bounded mode) there is a single segment that
    defines them in-program and runs everything at the upper bound.

    >>> import jax.numpy as jnp, polyexec as px
    >>> T = px.LengthVar("T", max=256)
    >>> K = px.LengthVar("K", max=256)
    >>> def f(x):                                       # x: (T, 4)
    ...     kept, n = px.compact(x, x[:, 0] > 0, length=K)
    ...     return jnp.tanh(kept @ jnp.ones((4, 8)))    # (K, 8)
    >>> plan = px.trace(f, px.Spec("T 4", jnp.float32))
    >>> [s.index for s in plan.segments], [v.name for v in plan.dynamic]
    ([0, 1], ['K'])
    >>> plan.shapes(T=100, K=7)[-1].shapes
    ((7, 8),)
    """

    name: str
    variables: tuple[LengthVar, ...]
    dynamic: tuple[LengthVar, ...]
    mode: str
    segments: tuple[Segment, ...]
    signature: Signature
    input_paths: tuple[str, ...]
    input_specs: tuple[Any, ...]

    reason = None
    reshaping_is_impossible = False

    @property
    def out_tree(self):
        return self.segments[-1].out_tree

    @property
    def out_paths(self) -> tuple[str, ...]:
        return self.segments[-1].out_paths

    @property
    def padding_reason(self) -> str | None:
        return next((s.padding_reason for s in self.segments if s.padding_reason), None)

    @property
    def padding_safe(self) -> bool:
        return self.padding_reason is None

    @property
    def all_variables(self) -> tuple[LengthVar, ...]:
        return tuple(self.variables) + tuple(self.dynamic)

    def _env_all(self, sizes: Mapping[str, int]) -> dict[str, int]:
        needed = list({v.name: v for s in self.segments for v in s.variables}.values())
        return check_sizes_in(needed, sizes, f"{self.name}: shapes()", optional=self.dynamic)

    def shapes(self, **sizes: int) -> list[Intermediate]:
        """Every intermediate's shape at these sizes — input and data-dependent sizes, e.g.
        ``shapes(T=100, K=7)`` — segment by segment (`Intermediate.segment`), from the symbolic
        programs alone. Each segment lists its inputs (index -1) then its live equations."""
        env = self._env_all(sizes)
        out = []
        for seg in self.segments:
            local = {v.name: env[v.name] for v in seg.variables}
            for path, aval in zip(seg.input_paths, seg.exported.in_avals):
                out.append(Intermediate(-1, "input", path, (evaluate_shape(aval.shape, local),),
                                        seg.index))
            for i, eqn in enumerate(walk(seg.jaxpr.jaxpr)):
                shapes = tuple(evaluate_shape(v.aval.shape, local) for v in eqn.outvars)
                out.append(Intermediate(i, eqn.primitive.name, where(eqn), shapes, seg.index))
        return out

    def output_shapes(self, **sizes: int) -> list[tuple[int, ...]]:
        env = self._env_all(sizes)
        final = self.segments[-1]
        local = {v.name: env[v.name] for v in final.variables}
        return [evaluate_shape(a.shape, local) for a in final.exported.out_avals][:len(final.out_paths)]

    def describe(self) -> str:
        """Each segment with its inputs, live program and outputs in symbolic shapes, and the
        partition point (user line, defined variable) where it is cut."""
        inputs = ", ".join(f"{v.name} in [{v.min}, {v.max}]" for v in self.variables)
        data = ", ".join(f"{v.name} in [{v.min}, {v.max}]" for v in self.dynamic)
        if self.mode == "bounded":
            head = (f"Plan {self.name}: bounded (partition=False), one program traced once over "
                    f"{inputs or 'no length variables'}; data-dependent {data} defined in-program, "
                    f"computed at the upper bound")
        else:
            head = (f"Plan {self.name}: partitioned into {len(self.segments)} segments at "
                    f"{len(self.segments) - 1} data-dependent op(s), each traced once over "
                    f"symbolic sizes ({inputs or 'no input lengths'}; from data: {data})")
        lines = [head + ("; padding-safe" if self.padding_safe else
                         f"; NOT PADDING-SAFE — {self.padding_reason}")]
        for seg in self.segments:
            names = ", ".join(v.name for v in seg.live_variables) or "no length variables"
            dead = list(seg.pinned)
            lines.append(f"segment {seg.index}: compiled per bucket of {names}"
                         + ("" if seg.index == 0 else
                            f"; runs at the smallest bucket of {seg.inputs_from[-1].var.name} "
                            f"holding its count")
                         + (f"; does not depend on {', '.join(dead)}" if dead else ""))
            lines.append("  inputs:")
            for path, aval, live in zip(seg.input_paths, seg.exported.in_avals, seg.live_inputs):
                lines.append(f"    {path:<30} {fmt_shape(aval)}{'' if live else '   (unused)'}")
            lines.append("  program:")
            lines += program_lines(seg.jaxpr, indent="    ")
            if seg.cut is not None:
                lines.append(f"  CUT at {seg.cut.describe()}")
            lines.append("  outputs:")
            for path, aval in zip(seg.out_paths, seg.exported.out_avals):
                lines.append(f"    {path:<30} {fmt_shape(aval)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"<PartitionedPlan {self.name}: {len(self.segments)} segment(s), variables "
                f"{[v.name for v in self.variables]}, from data {[v.name for v in self.dynamic]}>")

    def save(self, path) -> None:
        raise PolyexecError(f"cannot save plan {self.name}: saving a plan with data-dependent "
                            f"sizes ({len(self.segments)} segments) is not supported; save a "
                            f"function without length= instead")


# -- tracing ------------------------------------------------------------------------------------


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
    if dce_jaxpr is None:  # without the private API every input and variable counts as live
        return closed, [True] * len(closed.jaxpr.invars), set(names)
    jaxpr, used = dce_jaxpr(closed.jaxpr, True, instantiate=False)
    dims: list = []
    _collect_dims(jaxpr, dims)
    text = " ".join(str(d) for d in dims)
    live = {n for n in names if re.search(rf"\b{re.escape(n)}\b", text)}
    return jax.extend.core.ClosedJaxpr(jaxpr, closed.consts), list(used), live


def _rescope(shape, axis, k_dim, scope):
    """A cut value's shape in a later segment's symbolic scope, with ``K`` along the cut axis."""
    out = []
    for a, d in enumerate(shape):
        if a == axis:
            out.append(k_dim)
        elif export.is_symbolic_dim(d):
            out.append(export.symbolic_shape(str(d), scope=scope)[0])
        else:
            out.append(int(d))
    return tuple(out)




def _trace_segment(fn, signature: Signature, in_vars: Sequence[LengthVar],
                   cuts: Sequence[CutPoint], context: _dynamic.Context, counter: TraceCounter,
                   name: str, masking: bool) -> tuple[_dynamic.Context, dict]:
    """Segment ``len(cuts)``: the function re-run with the values handed over at ``cuts``
    injected as new inputs of symbolic size ``K`` along the cut axis."""
    variables = list(in_vars) + [c.var for c in cuts]
    names = [v.name for v in variables]
    dims = symbolic_dims(variables)
    scope = dims[names[-1]].scope
    injected_avals, injected_paths = [], []
    for c in cuts:
        for leaf, (shape, dtype, axis) in enumerate(zip(c.shapes, c.dtypes, c.axes)):
            k_dim = dims[c.var.name] if axis is not None else None
            injected_avals.append(jax.ShapeDtypeStruct(_rescope(shape, axis, k_dim, scope), dtype))
            injected_paths.append(f"cut {c.var.name}: values[{leaf}]")
    cell: list = []
    run = flat_program(_wrap(fn, context), signature, names, None, counter, cell)
    n_inputs = len(signature.array_avals) + len(signature.poly)
    n_injected = len(injected_avals)

    # Inputs: [arrays, Spec'd arrays, injected values, real sizes]: sizes last, as in every
    # program (the logical rewrite reads them there).
    def segment(*flat):
        rest = list(flat[n_inputs:n_inputs + n_injected])
        context.injected = []
        for c in cuts:
            leaves, rest = rest[:len(c.shapes)], rest[len(c.shapes):]
            context.injected.append(_dynamic.Injected(
                c.var.name, jax.tree_util.tree_unflatten(c.treedef, leaves), c.treedef))
        return run(*flat[:n_inputs], *flat[n_inputs + n_injected:])

    segment.__name__ = f"{name}_segment{len(cuts)}"
    base = input_avals(signature, variables, dims)
    avals = base[:n_inputs] + injected_avals + base[n_inputs:]
    traced = export_program(segment, avals, names, cell)
    if isinstance(traced, Failed):
        raise PolymorphismError(
            f"segment {len(cuts)} of {name} (after {cuts[-1].where}): {traced.reason}; every "
            f"segment after a data-dependent op must be shape-polymorphic (or run with "
            f"partition=False)")
    exported, padding_reason = logical_export(traced, names, masking)
    input_paths = (signature.leaf_paths("array") + signature.leaf_paths("poly") + injected_paths
                   + [f"valid_length({n})" for n in names])
    return context, dict(exported=exported, jaxpr=traced.jaxpr, variables=variables,
                         input_paths=input_paths, padding_reason=padding_reason)


def _segment(context: _dynamic.Context, index: int, cuts: tuple[CutPoint, ...], name: str, *,
             exported, jaxpr, variables, input_paths, padding_reason) -> Segment:
    live_jaxpr, live_inputs, live_names = _liveness(jaxpr, [v.name for v in variables])
    if context.cut is not None:
        out_tree = context.cut.treedef
        out_paths = [f"cut {context.cut.var.name}: values[{i}]"
                     for i in range(len(context.cut.shapes))] + [f"cut {context.cut.var.name}: count"]
        count_names = ()
    else:
        out_tree, out_paths = context.user_tree, list(context.user_paths)
        count_names = tuple(n for n, _ in context.points) if context.counts else ()
        out_paths = out_paths + [f"count of {n}" for n in count_names]
    return Segment(index=index, name=name, variables=tuple(variables),
                   live_variables=tuple(v for v in variables if v.name in live_names),
                   exported=exported, jaxpr=live_jaxpr, input_paths=tuple(input_paths),
                   live_inputs=tuple(live_inputs), out_tree=out_tree, out_paths=tuple(out_paths),
                   padding_reason=padding_reason, cut=context.cut, inputs_from=cuts,
                   count_names=count_names)


def plan_function(fn, signature: Signature, variables: Mapping[str, LengthVar],
                  input_names: Sequence[str], out_specs: Any, counter: TraceCounter, *,
                  name: str, partition: bool = True, masking: bool = True,
                  check_sizes: bool = False,
                  bucket_sizes: Mapping[str, Sequence[int]] | None = None) -> Plan | PartitionedPlan:
    """Trace ``fn``: a `Plan` when it defines no data-dependent size, else a `PartitionedPlan`
    (one Python trace per segment). Pure: nothing but ``counter`` is written."""
    in_vars = [variables[n] for n in input_names]
    mode = "partition" if partition else "bounded"
    context = _dynamic.Context(mode, [], input_names=frozenset(input_names), variables=variables)
    first = build_plan(_wrap(fn, context), signature, in_vars, counter, name=name,
                       masking=masking)
    data_named = [n for s in spec_leaves(out_specs) for n in s.var_names if n not in input_names]
    if first.reshaping_is_impossible or not context.points:
        if data_named and first.reshaping_is_impossible:
            raise PolymorphismError(
                f"{name}: out_specs name the data-dependent size(s) {data_named}, which "
                f"need a shape-polymorphic function, but {first.reason}")
        if data_named:
            raise SpecError(
                f"{name}: out_specs name {data_named}, which no input Spec uses and no "
                f"px.compact/nonzero/loop_until/partition(..., length=...) defines")
        first = dataclasses.replace(first, fn=fn)
        if check_sizes and not first.reshaping_is_impossible:
            reason = size_dependence(fn, signature, in_vars, first.exported.out_avals,
                                     first.out_paths, counter, bucket_sizes)
            if reason is not None:
                first = dataclasses.replace(first, reason=reason, exported=None, jaxpr=None,
                                            out_tree=None, out_paths=(),
                                            padding_reason="reshaping is impossible")
        return first

    segments = [_segment(context, 0, (), name, exported=first.exported, jaxpr=first.jaxpr,
                         variables=in_vars, input_paths=first.input_paths,
                         padding_reason=first.padding_reason)]
    cuts: list[CutPoint] = []
    dynamic = [context.defined[n] for n, _ in context.points] if mode == "bounded" else []
    while context.cut is not None:
        cuts.append(context.cut)
        dynamic.append(context.cut.var)
        context = _dynamic.Context(mode, [], input_names=frozenset(input_names),
                                   variables=variables)
        context, fields = _trace_segment(fn, signature, in_vars, cuts, context, counter, name,
                                         masking)
        segments.append(_segment(context, len(cuts), tuple(cuts), name, **fields))
    missing = [n for n in data_named if n not in {v.name for v in dynamic}]
    if missing:
        raise SpecError(f"{name}: out_specs name {missing}, which no input Spec uses and "
                        f"no partition point defines (defined: {[v.name for v in dynamic]})")
    return PartitionedPlan(name=name, variables=tuple(in_vars), dynamic=tuple(dynamic), mode=mode,
                           segments=tuple(segments), signature=signature,
                           input_paths=first.input_paths, input_specs=first.input_specs)



def trace(fn: Callable, *args_or_specs: Any, buckets: Mapping[Any, Any] | None = None,
          check_sizes: bool = True, masking: bool = True,
          variables: Sequence[LengthVar] = ()) -> Plan | PartitionedPlan:
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
        _raise_if_bug(fn, call.signature, plan.variables, sizes, plan.reason)
        return plan
    return dataclasses.replace(plan, constants=tuple(call.arrays)) if isinstance(plan, Plan) else plan


def _raise_if_bug(fn, signature, variables, sizes, reason: str) -> None:
    """A genuine bug fails at every concrete size: raise it rather than call it
    non-polymorphic. Code written for the maximum (`x + jnp.zeros(1024)`, a reshape to a literal
    size) fails at the smallest bucket but works at the largest: that is the non-polymorphic
    case, so try both before deciding. A reshape that divides only for some sizes fails at both
    and is still no bug: JAX says so ("divide evenly"), and the plan's reason names its line."""
    names = [v.name for v in variables]
    smallest = {n: sizes[n][0] for n in names}
    largest = {n: sizes[n][-1] for n in names}
    first = None
    for sizes_at in [smallest] if smallest == largest else [smallest, largest]:
        try:
            concrete_jaxpr(fn, signature, variables, sizes_at, TraceCounter())
            return
        except Exception as e:  # noqa: BLE001 - whatever it is, it is re-raised below
            first = first or e
    if "divide evenly" in reason or "divisible" in reason:
        return
    raise first
