"""One symbolic trace per function: the `Plan`, its polymorphism verdict and its shapes."""

from __future__ import annotations

import dataclasses
import itertools
import linecache
import os
import re
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core
import numpy as np
from jax import export
from jax._src import source_info_util

from ._context import ConcreteSizeRequested, binding, describe_frame, user_frame
from ._errors import PolyexecError, PolymorphismError, SpecError
from ._layout import Signature
from ._vars import LengthVar, Spec, symbolic_dims

# Errors JAX raises when a symbolic dimension meets code that needs a concrete one:
# `int(T)`/`range(T)` (TypeError), `if T > 10` (InconclusiveDimensionOperation), broadcasting
# against a literal maximum (TypeError/ValueError), indexing with one (IndexError).
# jax.export and jax core each define an InconclusiveDimensionOperation (unrelated classes):
# `int(T)` raises the first, a reshape to a literal size (`x.reshape(-1, 16)`) the second.
_SHAPE_ERRORS = (export.symbolic_shape.__globals__["InconclusiveDimensionOperation"],
                 jax.errors.InconclusiveDimensionOperation,
                 jax.errors.ConcretizationTypeError, TypeError, ValueError, IndexError)


@dataclasses.dataclass(frozen=True)
class Intermediate:
    """One value of the program: which equation made it, where in user code, and its shape."""

    index: int
    primitive: str
    where: str
    shapes: tuple[tuple[int, ...], ...]
    segment: int = 0          # which program of a partitioned plan (px.compact(..., length=K))


class _TraceCounter:
    def __init__(self):
        self.count = 0
        self._lock = threading.Lock()

    def bump(self):
        with self._lock:
            self.count += 1


def flat_program(fn: Callable, signature: Signature, var_names: Sequence[str],
                 bucket: Mapping[str, int] | None, counter: _TraceCounter, out_tree_cell: list):
    """``fn`` as a function of flat arrays: [array leaves..., poly leaves..., real sizes...]."""
    n_arrays = len(signature.array_avals)
    n_poly = len(signature.poly)

    def run(*flat):
        counter.bump()
        arrays, poly, valid = flat[:n_arrays], flat[n_arrays:n_arrays + n_poly], flat[n_arrays + n_poly:]
        sources = {"array": iter(arrays), "poly": iter(poly), "static": iter(signature.statics)}
        leaves = [next(sources[kind]) for kind in signature.kinds]
        args = jax.tree_util.tree_unflatten(signature.treedef, leaves)
        with binding(dict(zip(var_names, valid)), bucket):
            out = fn(*args)
        keyed, out_tree = jax.tree_util.tree_flatten_with_path(out)
        for keypath, leaf in keyed:
            if not isinstance(leaf, (jax.Array, np.ndarray)) and not hasattr(leaf, "aval"):
                raise PolyexecError(f"output out{jax.tree_util.keystr(keypath)} is a "
                                    f"{type(leaf).__name__}, not an array")
        out_tree_cell[:] = [out_tree, [jax.tree_util.keystr(k) for k, _ in keyed]]
        return tuple(leaf for _, leaf in keyed)

    run.__name__ = getattr(fn, "__name__", "fn")
    return run


def input_avals(signature: Signature, variables: Sequence[LengthVar], sizes: Mapping[str, Any]):
    """Avals of the flat program's inputs; ``sizes`` maps names to ints or symbolic dims."""
    avals = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in signature.array_avals]
    for spec, dtype in signature.poly:
        shape = tuple(sizes[d] if isinstance(d, str) else d for d in spec.dims)
        avals.append(jax.ShapeDtypeStruct(shape, dtype))
    avals += [jax.ShapeDtypeStruct((), np.int32) for _ in variables]
    return avals


def _where(eqn) -> str:
    frame = source_info_util.user_frame(eqn.source_info.traceback)
    if frame is None:
        return "<unknown>"
    line = linecache.getline(frame.file_name, frame.start_line).strip()
    return f"{frame.file_name}:{frame.start_line}" + (f": `{line}`" if line else "")


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for item in (value if isinstance(value, (tuple, list)) else (value,)):
            if isinstance(item, jax.extend.core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jax.extend.core.Jaxpr):
                yield item


def _walk(jaxpr):
    """Every equation, depth first, sub-programs (scan bodies, branches) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _sub_jaxprs(eqn):
            yield from _walk(sub)


def _evaluate(shape, env: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(int(d._evaluate(env)) if export.is_symbolic_dim(d) else int(d) for d in shape)


def program_lines(jaxpr, indent: str) -> list[str]:
    """One line per equation of a (symbolic) program: index, primitive, shapes, user line."""
    lines = []
    for i, eqn in enumerate(_walk(jaxpr.jaxpr)):
        shapes = " ".join(_fmt_shape(v.aval) for v in eqn.outvars)
        lines.append(f"{indent}{i:>4} {eqn.primitive.name:<22} {shapes:<24} {_where(eqn)}")
    return lines


def _fmt_shape(aval) -> str:
    dims = ",".join(str(d) for d in getattr(aval, "shape", ()))
    dtype = getattr(aval, "dtype", None)
    return f"{dtype.name if dtype is not None else '?'}[{dims}]"


class Plan:
    """A function traced once over symbolic lengths, ready to be compiled per bucket.

    ``jaxpr`` is the size-independent program (None when reshaping is impossible);
    ``exported`` the `jax.export.Exported` every bucket is compiled from;
    ``reshaping_is_impossible`` / ``reason`` the polymorphism verdict, naming the user's line.

    >>> import jax.numpy as jnp, polyexec as px
    >>> T = px.LengthVar("T", min=2, max=64)
    >>> plan = px.trace(lambda x: jnp.cumsum(x[:-1]), px.Spec("T", jnp.float32))
    >>> plan.reshaping_is_impossible
    False
    >>> plan.shapes(T=10)[-1].shapes
    ((9,),)
    """

    def __init__(self, *, name: str, variables: Sequence[LengthVar], signature: Signature | None,
                 exported: Any, jaxpr: Any, reason: str | None, out_tree: Any,
                 out_paths: Sequence[str], input_paths: Sequence[str], input_specs: Sequence[Any],
                 constants: Sequence[Any] | None = None):
        self.name = name
        self.variables = tuple(variables)
        self.signature = signature
        self.exported = exported
        self.jaxpr = jaxpr
        self.reason = reason
        self.out_tree = out_tree
        self.out_paths = tuple(out_paths)
        self.input_paths = tuple(input_paths)
        self.input_specs = tuple(input_specs)   # per flat input: Spec, or (shape, dtype) if fixed
        self.constants = None if constants is None else tuple(constants)

    @property
    def reshaping_is_impossible(self) -> bool:
        return self.reason is not None

    @property
    def segments(self) -> tuple["Plan", ...]:
        """The programs a call runs one after another: this plan alone, unless the function
        defines a data-dependent size (see `PartitionedPlan`)."""
        return (self,)

    # Partition segments other than the last are followed by one that re-reads the inputs.
    can_donate = True

    def bucket_avals(self, bucket: Mapping[str, int]):
        """The flat program's input avals at one bucket (what each bucket is compiled for)."""
        return input_avals(self.signature, self.variables, bucket)

    def _env(self, sizes: Mapping[str, int]) -> dict[str, int]:
        names = [v.name for v in self.variables]
        unknown = sorted(set(sizes) - set(names))
        missing = [n for n in names if n not in sizes]
        if unknown or missing:
            raise SpecError(f"{self.name}: shapes() needs exactly the sizes of {', '.join(names)}; "
                            f"unknown: {unknown}, missing: {missing}")
        for var in self.variables:
            size = sizes[var.name]
            if not var.min <= size <= var.max:
                raise SpecError(f"{var.name}={size} is outside [{var.min}, {var.max}] ({var})")
        return {k: int(v) for k, v in sizes.items()}

    def shapes(self, **sizes: int) -> list[Intermediate]:
        """Every intermediate's shape at these sizes, computed from the symbolic program alone
        (no compiling, no running): inputs first (index -1), then each equation's outputs."""
        if self.jaxpr is None:
            raise PolymorphismError(self.reason or "this plan holds no symbolic program")
        env = self._env(sizes)
        out = [Intermediate(-1, "input", path, (_evaluate(v.aval.shape, env),))
               for path, v in zip(self.input_paths, self.jaxpr.jaxpr.invars)]
        for i, eqn in enumerate(_walk(self.jaxpr.jaxpr)):
            shapes = tuple(_evaluate(v.aval.shape, env) for v in eqn.outvars)
            out.append(Intermediate(i, eqn.primitive.name, _where(eqn), shapes))
        return out

    def output_shapes(self, **sizes: int) -> list[tuple[int, ...]]:
        env = self._env(sizes)
        return [_evaluate(a.shape, env) for a in self.exported.out_avals]

    def describe(self) -> str:
        """The program with symbolic shapes, one line per equation, and the verdict."""
        var_text = ", ".join(f"{v.name} in [{v.min}, {v.max}]" for v in self.variables)
        lines = [f"Plan {self.name}: " + (
            f"RESHAPING IMPOSSIBLE — {self.reason}" if self.reason else
            f"size-independent, traced once over {var_text or 'no length variables'}")]
        if self.exported is None:
            return "\n".join(lines)
        lines.append("inputs:")
        for path, aval in zip(self.input_paths, self.exported.in_avals):
            lines.append(f"  {path:<28} {_fmt_shape(aval)}")
        if self.jaxpr is not None:
            lines.append("program:")
            lines += program_lines(self.jaxpr, indent="  ")
        lines.append("outputs:")
        for path, aval in zip(self.out_paths, self.exported.out_avals):
            lines.append(f"  out{path:<25} {_fmt_shape(aval)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        verdict = "reshaping impossible" if self.reason else "size-independent"
        return f"<Plan {self.name}: {verdict}, variables {[v.name for v in self.variables]}>"

    def save(self, path) -> None:
        """Write the exported program (and constants, if any) to ``path``; see `Plan.load`."""
        from ._serialize import save_plan
        save_plan(self, path)

    @staticmethod
    def load(path) -> "Plan":
        """Read a plan written by `save`. The loaded plan runs without the Python code that
        made it: call it with the arrays of its Spec inputs (and, unless the plan was saved with
        its constants, the fixed arrays first, in flattened order)."""
        from ._serialize import load_plan
        return load_plan(path)

    def __call__(self, *args):
        if getattr(self, "_runner", None) is None:
            from ._executor import bucketed
            self._runner = bucketed(self)
        return self._runner(*args)


def trace_symbolic(fn, signature: Signature, variables: Sequence[LengthVar], counter: _TraceCounter,
                   name: str) -> Plan:
    """The one symbolic trace. A failure that needs a concrete size gives a reshaping-impossible
    plan whose reason names the user's line."""
    names = [v.name for v in variables]
    cell: list = []
    run = flat_program(fn, signature, names, None, counter, cell)
    avals = input_avals(signature, variables, symbolic_dims(variables))
    input_paths = (signature.leaf_paths("array") + signature.leaf_paths("poly")
                   + [f"valid_length({n})" for n in names])
    input_specs = list(signature.array_avals) + [s for s, _ in signature.poly]
    common = dict(name=name, variables=variables, signature=signature,
                  input_paths=input_paths, input_specs=input_specs)
    jitted = jax.jit(run)
    try:
        exported = export.export(jitted)(*avals)
    except ConcreteSizeRequested as e:
        line = linecache.getline(e.filename, e.lineno).strip()
        reason = (f"{e.filename}:{e.lineno}: `{line}`: px.max_length({e.name!r}) needs the "
                  f"concrete bucket size")
        return Plan(exported=None, jaxpr=None, reason=reason, out_tree=None, out_paths=(), **common)
    except _SHAPE_ERRORS as e:
        if not _about_symbolic_dims(e, names):
            raise  # an ordinary bug in the function, not a polymorphism problem
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        reason = f"{describe_frame(user_frame(e))}: {type(e).__name__}: {message}"
        return Plan(exported=None, jaxpr=None, reason=reason, out_tree=None, out_paths=(), **common)
    # jit caches the trace above, so this reads the jaxpr without running Python again.
    jaxpr = jitted.trace(*avals).jaxpr
    return Plan(exported=exported, jaxpr=jaxpr, reason=None, out_tree=cell[0], out_paths=cell[1],
                **common)


def _about_symbolic_dims(error: BaseException, names: Sequence[str]) -> bool:
    if isinstance(error, _SHAPE_ERRORS[:3]):
        return True
    # A symbolic dim meeting Python code (`[0.0] * T` -> _DimExpr.__rmul__) can fail with a
    # message that names neither the dim nor symbolic shapes; the raising frames still show it.
    if any(f.filename.endswith(("shape_poly.py",)) and f"{os.sep}export{os.sep}" in f.filename
           for f in traceback.extract_tb(error.__traceback__)):
        return True
    text = str(error)
    return ("_DimExpr" in text or "symbolic" in text.lower()
            or any(re.search(rf"\b{re.escape(n)}\b", text) for n in names))


def check_size_independence(plan: Plan, fn, counter: _TraceCounter,
                            bucket_sizes: Mapping[str, Sequence[int]]) -> Plan:
    """Trace at two concrete sizes and compare: the outputs must have the shapes the symbolic
    program predicts, and the two programs must be the same sequence of operations. Catches code
    that branches on a size without asking for it symbolically (``if T == 1024``)."""
    if plan.reason is not None:
        return plan
    names = [v.name for v in plan.variables]
    # Not the very smallest bucket: JAX special-cases dims of size 1 (a `T - 1` axis at T=2
    # turns take_along_axis's gather into a reshape), which would flag every `x[:, :-1]` model.
    floor = {v.name: max(4, v.min + 3) for v in plan.variables}
    small = {n: next((s for s in bucket_sizes[n] if s >= floor[n]), bucket_sizes[n][-1])
             for n in names}
    large = {n: bucket_sizes[n][-1] for n in names}
    programs = []
    for sizes in (small, large):
        cell: list = []
        run = flat_program(fn, plan.signature, names, sizes, counter, cell)
        jaxpr = jax.jit(run).trace(*input_avals(plan.signature, plan.variables, sizes)).jaxpr
        for path, predicted, var in zip(plan.out_paths, plan.output_shapes(**sizes), jaxpr.jaxpr.outvars):
            actual = tuple(var.aval.shape)
            if actual != predicted:
                producer = next((e for e in _walk(jaxpr.jaxpr) if var in e.outvars), None)
                where = _where(producer) if producer is not None else "<unknown>"
                reason = (f"{where}: output out{path} has shape {actual} at "
                          f"{_fmt_sizes(sizes)}, but the symbolic program predicts {predicted}")
                return _impossible(plan, reason)
        programs.append(list(_walk(jaxpr.jaxpr)))
    for a, b in itertools.zip_longest(*programs):
        if a is None or b is None or a.primitive != b.primitive:
            culprit = b if b is not None else a
            reason = (f"{_where(culprit)}: the program at {_fmt_sizes(large)} differs from the one at "
                      f"{_fmt_sizes(small)} ({a.primitive if a else 'nothing'} vs "
                      f"{b.primitive if b else 'nothing'}): the code branches on a size")
            return _impossible(plan, reason)
    return plan


def _fmt_sizes(sizes: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items())


def _impossible(plan: Plan, reason: str) -> Plan:
    return Plan(name=plan.name, variables=plan.variables, signature=plan.signature, exported=None,
                jaxpr=None, reason=reason, out_tree=None, out_paths=(),
                input_paths=plan.input_paths, input_specs=plan.input_specs)
