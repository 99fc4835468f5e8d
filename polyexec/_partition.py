"""Partitioned execution: a function with data-dependent sizes runs as a chain of segments.

MXNet's dynamic-shape executor splits a graph at an op whose output size depends on the data
into three parts — before, the op, after — and runs them one after another, the op deciding its
output shape at run time. Here the partition points are the ``length=K`` arguments of
`px.compact`, `px.nonzero`, `px.loop_until` and `px.partition`, and each part is its own
symbolic program:

* **Segment 0** is the function up to (and including) the first partition point; it returns
  the op's upper-bound buffer and its count.
* **Segment i** takes the original inputs, ``valid_length`` of every variable so far, and the
  values handed over at points ``0 .. i-1`` as new inputs whose cut axis has the symbolic size
  ``K_j``; it runs up to point ``i`` (or, for the last segment, returns the function's outputs).

Each segment is traced by running the user function once (``traces == number of segments``):
points before the segment's own return their injected inputs, the segment's point stops the
function (a private exception caught by the traced wrapper). Each segment is exported once over
symbolic sizes and compiled once per bucket combination it actually runs at — never retraced per
bucket. At run time the executor runs segment 0 at the inputs' bucket, reads the count on the
host (the one synchronisation per partition point), slices the buffer to the smallest bucket of
``K`` that holds it and runs the next segment there.

Values computed before a cut and used after it are *recomputed* in the later segment from the
original inputs (only the partition point's own values cross the cut); code that only fed
earlier partition points is dead in later segments and XLA drops it when compiling.
"""

from __future__ import annotations

import dataclasses
import itertools
import linecache
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.extend.core
import numpy as np
from jax import export

from . import _dynamic, _layout
from ._context import ConcreteSizeRequested, describe_frame, user_frame
from ._errors import LengthOverflowError, PolyexecError, PolymorphismError, SpecError
from ._plan import (_SHAPE_ERRORS, Intermediate, Plan, _about_symbolic_dims, _evaluate,
                    _fmt_shape, _walk, _where, flat_program, input_avals, program_lines,
                    trace_symbolic)
from ._vars import LengthVar, Spec, bucket_sizes, symbolic_dims


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


class Segment(Plan):
    """One program of a `PartitionedPlan`: exported once, compiled per bucket of its variables.

    ``cut`` is the partition point it stops at (None for the last segment); ``inputs_from``
    the earlier points whose values it takes as extra inputs; ``count_names`` the variables it
    defines in-program (bounded mode) and returns counts of, after its outputs.

    ``variables`` are the *live* ones — those some shape of the live program depends on; it is
    compiled once per bucket combination of these alone. ``all_variables`` also holds the dead
    ones (typically the input lengths in a segment that only reads what the cut handed over):
    their inputs are never read, so it is compiled with them pinned at their minimum and fed
    placeholders. Without this, the segment after a filter would compile once per (input
    bucket, kept bucket) pair instead of once per kept bucket.
    """

    def __init__(self, *, index: int, cut: CutPoint | None, inputs_from: Sequence[CutPoint],
                 count_names: Sequence[str] = (), all_variables: Sequence[LengthVar],
                 live_inputs: Sequence[bool], **plan_fields):
        super().__init__(**plan_fields)
        self.index = index
        self.cut = cut
        self.inputs_from = tuple(inputs_from)
        self.count_names = tuple(count_names)
        self.all_variables = tuple(all_variables)
        self.live_inputs = tuple(live_inputs)
        live = {v.name for v in self.variables}
        self.pinned = {v.name: v.min for v in self.all_variables if v.name not in live}
        self._placeholders: dict[tuple, np.ndarray] = {}

    def placeholder(self, shape, dtype) -> np.ndarray:
        """Zeros standing in for an input the segment never reads (cached: made once)."""
        key = (tuple(shape), np.dtype(dtype))
        if key not in self._placeholders:
            self._placeholders[key] = np.zeros(*key)
        return self._placeholders[key]

    @property
    def can_donate(self) -> bool:
        # Every segment but the last is followed by one that reads the same inputs again.
        return self.cut is None

    def bucket_avals(self, bucket: Mapping[str, int]):
        env = {**self.pinned, **{v.name: int(bucket[v.name]) for v in self.variables}}
        return [jax.ShapeDtypeStruct(_evaluate(a.shape, env), a.dtype)
                for a in self.exported.in_avals]

    def __repr__(self) -> str:
        end = f"cut at {self.cut.var.name}" if self.cut else "final"
        return f"<Segment {self.index} of {self.name}: {end}, variables {[v.name for v in self.variables]}>"


class PartitionedPlan(Plan):
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

    def __init__(self, *, segments: Sequence[Segment], dynamic: Sequence[LengthVar], mode: str,
                 **plan_fields):
        super().__init__(**plan_fields)
        self._segments = tuple(segments)
        self.dynamic = tuple(dynamic)
        self.mode = mode
        final = self._segments[-1]
        self.out_tree, self.out_paths = final.out_tree, final.out_paths

    @property
    def segments(self) -> tuple[Segment, ...]:
        return self._segments

    @property
    def all_variables(self) -> tuple[LengthVar, ...]:
        return tuple(self.variables) + tuple(self.dynamic)

    def _env_all(self, sizes: Mapping[str, int]) -> dict[str, int]:
        needed = {v.name: v for s in self.segments for v in s.all_variables}
        optional = {v.name: v for v in self.dynamic}
        unknown = sorted(set(sizes) - set(needed) - set(optional))
        missing = [n for n in needed if n not in sizes]
        if unknown or missing:
            raise SpecError(f"{self.name}: shapes() needs the sizes of {', '.join(needed)} "
                            f"(data-dependent sizes included); unknown: {unknown}, "
                            f"missing: {missing}")
        for name, size in sizes.items():
            var = needed.get(name) or optional[name]
            if not var.min <= size <= var.max:
                raise SpecError(f"{name}={size} is outside [{var.min}, {var.max}] ({var})")
        return {k: int(v) for k, v in sizes.items()}

    def shapes(self, **sizes: int) -> list[Intermediate]:
        """Every intermediate's shape at these sizes — input and data-dependent sizes, e.g.
        ``shapes(T=100, K=7)`` — segment by segment (`Intermediate.segment`), from the symbolic
        programs alone. Each segment lists its inputs (index -1) then its live equations."""
        env = self._env_all(sizes)
        out = []
        for seg in self.segments:
            local = {v.name: env[v.name] for v in seg.all_variables}
            for path, aval in zip(seg.input_paths, seg.exported.in_avals):
                out.append(Intermediate(-1, "input", path, (_evaluate(aval.shape, local),),
                                        seg.index))
            for i, eqn in enumerate(_walk(seg.jaxpr.jaxpr)):
                shapes = tuple(_evaluate(v.aval.shape, local) for v in eqn.outvars)
                out.append(Intermediate(i, eqn.primitive.name, _where(eqn), shapes, seg.index))
        return out

    def output_shapes(self, **sizes: int) -> list[tuple[int, ...]]:
        env = self._env_all(sizes)
        final = self.segments[-1]
        local = {v.name: env[v.name] for v in final.all_variables}
        return [_evaluate(a.shape, local) for a in final.exported.out_avals][:len(final.out_paths)]

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
        lines = [head]
        for seg in self.segments:
            names = ", ".join(v.name for v in seg.variables) or "no length variables"
            dead = [v.name for v in seg.all_variables if v.name in seg.pinned]
            lines.append(f"segment {seg.index}: compiled per bucket of {names}"
                         + ("" if seg.index == 0 else
                            f"; runs at the smallest bucket of {seg.inputs_from[-1].var.name} "
                            f"holding its count")
                         + (f"; does not depend on {', '.join(dead)}" if dead else ""))
            lines.append("  inputs:")
            for path, aval, live in zip(seg.input_paths, seg.exported.in_avals, seg.live_inputs):
                lines.append(f"    {path:<30} {_fmt_shape(aval)}{'' if live else '   (unused)'}")
            lines.append("  program:")
            lines += program_lines(seg.jaxpr, indent="    ")
            if seg.cut is not None:
                lines.append(f"  CUT at {seg.cut.describe()}")
            lines.append("  outputs:")
            for path, aval in zip(seg.out_paths, seg.exported.out_avals):
                lines.append(f"    {path:<30} {_fmt_shape(aval)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"<PartitionedPlan {self.name}: {len(self.segments)} segment(s), variables "
                f"{[v.name for v in self.variables]}, from data {[v.name for v in self.dynamic]}>")

    def save(self, path) -> None:
        raise PolyexecError(f"cannot save plan {self.name}: saving a plan with data-dependent "
                            f"sizes ({len(self.segments)} segments) is not supported; save a "
                            f"function without length= instead")

    def __call__(self, *args):
        raise PolyexecError(f"plan {self.name} has data-dependent sizes: run it through "
                            f"px.bucketed(fn, in_specs, ...) rather than calling the plan")


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
    try:
        from jax._src.interpreters import partial_eval as pe
        jaxpr, used = pe.dce_jaxpr(closed.jaxpr, True, instantiate=False)
    except Exception:  # a private API: without it, every input and variable counts as live
        return closed, [True] * len(closed.jaxpr.invars), set(names)
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


def _register(runner, var: LengthVar) -> None:
    with runner._lock:
        runner.variables[var.name] = var
        runner.bucket_sizes[var.name] = bucket_sizes(var, runner._policies.get(var.name))


def _trace_segment(runner, signature, in_vars, cuts: Sequence[CutPoint], mode: str) -> tuple:
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
    context = _dynamic.Context(mode, [], input_names=frozenset(v.name for v in in_vars))
    cell: list = []
    run = flat_program(_wrap(runner.fn, context), signature, names, None, runner._counter, cell)
    n_base = len(signature.array_avals) + len(signature.poly) + len(names)

    def segment(*flat):
        rest = list(flat[n_base:])
        context.injected = []
        for c in cuts:
            leaves, rest = rest[:len(c.shapes)], rest[len(c.shapes):]
            context.injected.append(_dynamic.Injected(
                c.var.name, jax.tree_util.tree_unflatten(c.treedef, leaves), c.treedef))
        return run(*flat[:n_base])

    segment.__name__ = f"{runner.name}_segment{len(cuts)}"
    avals = input_avals(signature, variables, dims) + injected_avals
    jitted = jax.jit(segment)
    where = f"segment {len(cuts)} of {runner.name} (after {cuts[-1].where})"
    try:
        exported = export.export(jitted)(*avals)
    except ConcreteSizeRequested as e:
        line = linecache.getline(e.filename, e.lineno).strip()
        raise PolymorphismError(
            f"{where}: {e.filename}:{e.lineno}: `{line}`: px.max_length({e.name!r}) needs a "
            f"concrete size; every segment after a data-dependent op must be shape-polymorphic "
            f"(or run with partition=False)") from None
    except _SHAPE_ERRORS as e:
        if not _about_symbolic_dims(e, names):
            raise
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PolymorphismError(
            f"{where}: {describe_frame(user_frame(e))}: {type(e).__name__}: {message}; every "
            f"segment after a data-dependent op must be shape-polymorphic (or run with "
            f"partition=False)") from None
    jaxpr = jitted.trace(*avals).jaxpr
    input_paths = (signature.leaf_paths("array") + signature.leaf_paths("poly")
                   + [f"valid_length({n})" for n in names] + injected_paths)
    return context, dict(exported=exported, jaxpr=jaxpr, variables=variables,
                         input_paths=input_paths)


def _segment(runner, signature, context, index, cuts, *, exported, jaxpr, variables,
             input_paths) -> Segment:
    live_jaxpr, live_inputs, live_names = _liveness(jaxpr, [v.name for v in variables])
    if context.cut is not None:
        out_tree = context.cut.treedef
        out_paths = [f"cut {context.cut.var.name}: values[{i}]"
                     for i in range(len(context.cut.shapes))] + [f"cut {context.cut.var.name}: count"]
        count_names = ()
    else:
        out_tree, out_paths = context.user_tree, list(context.user_paths)
        count_names = tuple(name for name, _ in context.points) if context.counts else ()
        out_paths = out_paths + [f"count of {n}" for n in count_names]
    input_specs = list(signature.array_avals) + [s for s, _ in signature.poly]
    return Segment(index=index, cut=context.cut, inputs_from=cuts, count_names=count_names,
                   all_variables=variables, live_inputs=live_inputs,
                   variables=[v for v in variables if v.name in live_names],
                   name=runner.name, signature=signature, exported=exported,
                   jaxpr=live_jaxpr, reason=None, out_tree=out_tree, out_paths=out_paths,
                   input_paths=input_paths, input_specs=input_specs)


def trace(runner, signature) -> Plan:
    """Trace ``runner.fn``: a plain `Plan` when it defines no data-dependent size, else a
    `PartitionedPlan` (one Python trace per segment)."""
    in_vars = [runner.variables[n] for n in runner._input_names]
    mode = "partition" if runner.partition else "bounded"
    context = _dynamic.Context(mode, [], input_names=frozenset(runner._input_names))
    first = trace_symbolic(_wrap(runner.fn, context), signature, in_vars, runner._counter,
                           runner.name)
    data_named = [n for s in _out_spec_leaves(runner.out_specs) for n in s.var_names
                  if n not in runner._input_names]
    if first.reshaping_is_impossible or not context.points:
        if data_named and first.reshaping_is_impossible:
            raise PolymorphismError(
                f"{runner.name}: out_specs name the data-dependent size(s) {data_named}, which "
                f"need a shape-polymorphic function, but {first.reason}")
        if data_named:
            raise SpecError(
                f"{runner.name}: out_specs name {data_named}, which no input Spec uses and no "
                f"px.compact/nonzero/loop_until/partition(..., length=...) defines")
        return first

    segments = [_segment(runner, signature, context, 0, (), exported=first.exported,
                         jaxpr=first.jaxpr, variables=in_vars, input_paths=first.input_paths)]
    cuts: list[CutPoint] = []
    dynamic = [context.defined[name] for name, _ in context.points] if mode == "bounded" else []
    while context.cut is not None:
        cuts.append(context.cut)
        dynamic.append(context.cut.var)
        context, fields = _trace_segment(runner, signature, in_vars, cuts, mode)
        segments.append(_segment(runner, signature, context, len(cuts), tuple(cuts), **fields))
    for var in dynamic:
        _register(runner, var)
    missing = [n for n in data_named if n not in {v.name for v in dynamic}]
    if missing:
        raise SpecError(f"{runner.name}: out_specs name {missing}, which no input Spec uses and "
                        f"no partition point defines (defined: {[v.name for v in dynamic]})")
    return PartitionedPlan(segments=segments, dynamic=dynamic, mode=mode, name=runner.name,
                           variables=in_vars, signature=signature, exported=None, jaxpr=None,
                           reason=None, out_tree=None, out_paths=(),
                           input_paths=first.input_paths, input_specs=first.input_specs)


def _out_spec_leaves(tree) -> list[Spec]:
    return [s for s in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Spec))
            if isinstance(s, Spec)]


# -- running ------------------------------------------------------------------------------------


def _fit(buffer: np.ndarray, axis: int, size: int, fill) -> np.ndarray:
    """The first ``size`` entries along ``axis``, padded with ``fill`` if the buffer is shorter.
    On the host, like all padding: a device slice would compile per (buffer, bucket) shape."""
    have = buffer.shape[axis]
    if have >= size:
        return buffer[(slice(None),) * axis + (slice(0, size),)]
    widths = [(0, 0)] * buffer.ndim
    widths[axis] = (0, size - have)
    return np.pad(buffer, widths, constant_values=fill)


def run(runner, plan: PartitionedPlan, call: _layout.BoundCall, bucket: Mapping[str, int]):
    """One call: the segments in order, each at its bucket, counts read on the host between."""
    sizes, bucket = dict(call.sizes), dict(bucket)
    base, real, padded = _layout.pad_inputs(call, bucket)
    handed: list[Any] = []
    for seg in plan.segments:
        executable = runner._executable(seg, call, bucket)
        flat = base + [np.int32(sizes[v.name]) for v in seg.all_variables] + handed
        if not all(seg.live_inputs):
            avals = seg.bucket_avals(bucket)
            flat = [x if live or tuple(np.shape(x)) == a.shape else seg.placeholder(a.shape, a.dtype)
                    for x, live, a in zip(flat, seg.live_inputs, avals)]
        outputs = executable(*flat)
        runner._record(runner._key(seg, bucket), calls=1, real_elements=real,
                       padded_elements=padded)
        if seg.cut is None:
            break
        cut = seg.cut
        count = int(outputs[-1])           # the host synchronisation: the op decides its size
        values = [np.asarray(v) for v in outputs[:-1]]
        limit = min(v.shape[a] for v, a in zip(values, cut.axes) if a is not None)
        if not 0 <= count <= limit:
            raise PolyexecError(f"{cut.where}: count {count} is outside [0, {limit}], the size "
                                f"of the values buffer")
        if count > cut.var.max:
            raise LengthOverflowError(f"{cut.where}: data-dependent size {cut.var.name} = {count} "
                                      f"is above {cut.var.name}'s max={cut.var.max} ({cut.var})")
        size = runner._bucket_for(cut.var.name, count)
        sizes[cut.var.name], bucket[cut.var.name] = count, size
        real = padded = 0
        for v, a, fill in zip(values, cut.axes, cut.fills):
            if a is None:
                handed.append(v)
                continue
            handed.append(_fit(v, a, size, fill))
            rest = int(np.prod(v.shape)) // max(v.shape[a], 1)
            real += count * rest
            padded += size * rest
    n_user = len(outputs) - len(seg.count_names)
    for name, count in zip(seg.count_names, outputs[n_user:]):
        sizes[name] = int(count)
    return runner._unflatten(seg, list(outputs[:n_user]), sizes)


def warmup_jobs(runner, plan: PartitionedPlan, combos: Sequence[Mapping[str, int]]):
    """(segment, bucket) pairs to compile: each segment at every given input bucket combined
    with every bucket of its data-dependent variables (or the ones named in ``combos``)."""
    jobs, seen = [], set()
    for seg in plan.segments:
        live = [v.name for v in seg.variables]
        for combo in combos:
            fixed = {n: combo[n] for n in live if n in combo}
            free = [n for n in live if n not in combo]
            for values in itertools.product(*(runner.bucket_sizes[n] for n in free)):
                sizes = {**fixed, **dict(zip(free, values))}
                key = (id(seg), tuple(sorted(sizes.items())))
                if key not in seen:
                    seen.add(key)
                    jobs.append((seg, sizes))
    return jobs
