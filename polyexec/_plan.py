"""Stage 5, plan: the traced program as an immutable value — its verdicts, shapes and text.

`build_plan` runs the stages before it (trace, size check, logical rewrite) and returns a
frozen `Plan`; nothing changes a plan afterwards. The slow path (reshaping impossible) asks
`Plan.program_at(bucket)` for a new per-bucket program instead of writing into the plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax

from . import _logical, _serialize
from ._bind import Signature
from ._errors import PolymorphismError, SpecError
from ._spec import LengthVar
from ._trace import (Failed, TraceCounter, Traced, evaluate_shape, export_flat, export_symbolic,
                     input_avals, trace_at, walk, where)


@dataclasses.dataclass(frozen=True)
class Intermediate:
    """One value of the program: which equation made it, where in user code, and its shape."""

    index: int
    primitive: str
    where: str
    shapes: tuple[tuple[int, ...], ...]
    segment: int = 0          # which program of a partitioned plan (px.compact(..., length=K))


class PlanLike(Protocol):
    """What `Plan` and `PartitionedPlan` share: the executor and users need only this."""

    name: str
    variables: tuple[LengthVar, ...]

    @property
    def segments(self) -> tuple[Any, ...]: ...
    def shapes(self, **sizes: int) -> list[Intermediate]: ...
    def describe(self) -> str: ...


def fmt_shape(aval) -> str:
    dims = ",".join(str(d) for d in getattr(aval, "shape", ()))
    dtype = getattr(aval, "dtype", None)
    return f"{dtype.name if dtype is not None else '?'}[{dims}]"


def program_lines(jaxpr, indent: str) -> list[str]:
    """One line per equation of a (symbolic) program: index, primitive, shapes, user line."""
    lines = []
    for i, eqn in enumerate(walk(jaxpr.jaxpr)):
        shapes = " ".join(fmt_shape(v.aval) for v in eqn.outvars)
        lines.append(f"{indent}{i:>4} {eqn.primitive.name:<22} {shapes:<24} {where(eqn)}")
    return lines


def check_sizes_in(variables: Sequence[LengthVar], sizes: Mapping[str, int], what: str,
                   optional: Sequence[LengthVar] = ()) -> dict[str, int]:
    """``sizes`` as ints, exactly one per variable (``optional`` ones may be given too), each
    within its bounds."""
    needed = {v.name: v for v in variables}
    extra = {v.name: v for v in optional}
    unknown = sorted(set(sizes) - set(needed) - set(extra))
    missing = [n for n in needed if n not in sizes]
    if unknown or missing:
        raise SpecError(f"{what} needs exactly the sizes of {', '.join(needed) or 'nothing'}; "
                        f"unknown: {unknown}, missing: {missing}")
    for name, size in sizes.items():
        var = needed.get(name) or extra[name]
        if not var.min <= size <= var.max:
            raise SpecError(f"{name}={size} is outside [{var.min}, {var.max}] ({var})")
    return {k: int(v) for k, v in sizes.items()}


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """A function traced once over symbolic lengths, ready to be compiled per bucket.

    ``jaxpr`` is the size-independent program as traced (None when reshaping is impossible);
    ``exported`` the `jax.export.Exported` every bucket is compiled from — the logical rewrite
    of ``jaxpr`` when ``padding_safe``. Two verdicts, each naming the user's line:
    ``reshaping_is_impossible`` / ``reason`` (no size-independent program: the function is
    retraced per bucket) and ``padding_safe`` / ``padding_reason`` (an operation over a length
    axis has no logical-length rule, so padding could change its result).

    >>> import jax.numpy as jnp, polyexec as px
    >>> T = px.LengthVar("T", min=2, max=64)
    >>> plan = px.trace(lambda x: jnp.cumsum(x[:-1]), px.Spec("T", jnp.float32))
    >>> plan.reshaping_is_impossible, plan.padding_safe
    (False, True)
    >>> plan.shapes(T=10)[-1].shapes
    ((9,),)
    """

    name: str
    variables: tuple[LengthVar, ...]     # whose real sizes the program takes, in input order
    input_paths: tuple[str, ...]
    input_specs: tuple[Any, ...]         # per flat input: Spec, or (shape, dtype) if fixed
    signature: Signature | None = None   # None for a plan loaded from a file
    exported: Any = None
    jaxpr: Any = None
    out_tree: Any = None
    out_paths: tuple[str, ...] = ()
    reason: str | None = None
    padding_reason: str | None = None
    constants: tuple[Any, ...] | None = None
    # Sizes that must be bucket boundaries for the slow path to branch as the exact size does.
    split_sizes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    fn: Callable | None = dataclasses.field(default=None, repr=False)   # for the slow path

    @property
    def reshaping_is_impossible(self) -> bool:
        return self.reason is not None

    @property
    def padding_safe(self) -> bool:
        return self.padding_reason is None

    @property
    def segments(self) -> tuple["Plan", ...]:
        """The programs a call runs one after another: this plan alone (see `PartitionedPlan`)."""
        return (self,)

    @property
    def live_variables(self) -> tuple[LengthVar, ...]:
        return self.variables

    can_donate = True

    def bucket_avals(self, bucket: Mapping[str, int]):
        """The flat program's input avals at one bucket (what each bucket is compiled for)."""
        if self.exported is None:
            return input_avals(self.signature, self.variables, bucket)
        return [jax.ShapeDtypeStruct(evaluate_shape(a.shape, bucket), a.dtype)
                for a in self.exported.in_avals]

    def program_at(self, bucket: Mapping[str, int], counter: TraceCounter) -> tuple[Callable, list]:
        """The program to compile for one bucket: the exported one, or (slow path) the user
        function retraced at the bucket's sizes; the list receives (out_tree, out_paths)."""
        if self.exported is not None:
            return self.exported.call, [self.out_tree, self.out_paths]
        if self.fn is None:
            raise PolymorphismError(self.reason or f"plan {self.name} holds no program")
        return trace_at(self.fn, self.signature, self.variables, bucket, counter)

    def shapes(self, **sizes: int) -> list[Intermediate]:
        """Every intermediate's shape at these sizes, computed from the symbolic program alone
        (no compiling, no running): inputs first (index -1), then each equation's outputs."""
        if self.jaxpr is None:
            raise PolymorphismError(self.reason or "this plan holds no symbolic program")
        env = check_sizes_in(self.variables, sizes, f"{self.name}: shapes()")
        out = [Intermediate(-1, "input", path, (evaluate_shape(v.aval.shape, env),))
               for path, v in zip(self.input_paths, self.jaxpr.jaxpr.invars)]
        for i, eqn in enumerate(walk(self.jaxpr.jaxpr)):
            shapes = tuple(evaluate_shape(v.aval.shape, env) for v in eqn.outvars)
            out.append(Intermediate(i, eqn.primitive.name, where(eqn), shapes))
        return out

    def output_shapes(self, **sizes: int) -> list[tuple[int, ...]]:
        env = check_sizes_in(self.variables, sizes, f"{self.name}: output_shapes()")
        return [evaluate_shape(a.shape, env) for a in self.exported.out_avals]

    def verdict(self) -> str:
        var_text = ", ".join(f"{v.name} in [{v.min}, {v.max}]" for v in self.variables)
        if self.reason:
            return f"RESHAPING IMPOSSIBLE — {self.reason}"
        padding = ("padding-safe: every operation computes over the real lengths"
                   if self.padding_safe else f"NOT PADDING-SAFE — {self.padding_reason}")
        return (f"size-independent, traced once over {var_text or 'no length variables'}; "
                f"{padding}")

    def describe(self) -> str:
        """The program with symbolic shapes, one line per equation, and both verdicts."""
        lines = [f"Plan {self.name}: {self.verdict()}"]
        if self.exported is None:
            return "\n".join(lines)
        lines.append("inputs:")
        for path, aval in zip(self.input_paths, self.exported.in_avals):
            lines.append(f"  {path:<28} {fmt_shape(aval)}")
        if self.jaxpr is not None:
            lines.append("program:")
            lines += program_lines(self.jaxpr, indent="  ")
        lines.append("outputs:")
        for path, aval in zip(self.out_paths, self.exported.out_avals):
            lines.append(f"  out{path:<25} {fmt_shape(aval)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        verdict = "reshaping impossible" if self.reason else "size-independent"
        padding = "" if self.reason or self.padding_safe else ", not padding-safe"
        return (f"<Plan {self.name}: {verdict}{padding}, variables "
                f"{[v.name for v in self.variables]}>")

    def save(self, path) -> None:
        """Write the exported program (and constants, if any) to ``path``; see `Plan.load`."""
        if self.exported is None:
            raise PolymorphismError(f"cannot save plan {self.name}: reshaping is impossible, so "
                                    f"there is no size-independent program ({self.reason})")
        _serialize.save(path, name=self.name, exported=self.exported,
                        variables=self.variables, input_paths=self.input_paths,
                        input_specs=self.input_specs, out_paths=self.out_paths,
                        constants=self.constants or (), padding_reason=self.padding_reason)

    @staticmethod
    def load(path) -> "Plan":
        """Read a plan written by `save`. It runs without the Python code that made it, through
        ``px.bucketed(plan)`` (or `Bucketed.from_plan`): call that with the arrays of its Spec
        inputs (and, unless the plan was saved with its constants, the fixed arrays first, in
        flattened order)."""
        fields = _serialize.load(path)
        out_tree = jax.tree_util.tree_structure(tuple(range(len(fields["exported"].out_avals))))
        return Plan(out_tree=out_tree, **fields)


def logical_export(traced: Traced, names: Sequence[str], masking: bool) -> tuple[Any, str | None]:
    """Stage 4 applied to one traced program: ``(exported, padding_reason)``. The exported
    program is the logical rewrite, or the traced program with the reason it is not one."""
    if not masking:
        return traced.exported, "masking=False: the program runs over the padded sizes as written"
    if not names:
        return traced.exported, None
    try:
        # The real sizes are the program's last inputs, in ``names`` order.
        first = len(traced.jaxpr.jaxpr.invars) - len(names)
        logical = _logical.rewrite(traced.jaxpr, {n: first + i for i, n in enumerate(names)})
        if not logical.unsupported:
            exported, _ = export_flat(logical.fn, traced.avals)
            return exported, None
    except Exception as e:  # noqa: BLE001 - a rule that fails is a verdict, never a crash
        culprit = getattr(e, "equation", None)
        at = f"{where(culprit)}: {culprit.primitive.name}: " if culprit is not None else ""
        return traced.exported, (f"{at}the logical rewrite failed ({type(e).__name__}: "
                                 f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})")
    first = logical.unsupported[0]
    more = len(logical.unsupported) - 1
    return traced.exported, (f"{first.where}: {first.primitive}: {first.detail}"
                             + (f" (and {more} more)" if more else ""))


def build_plan(fn: Callable, signature: Signature, variables: Sequence[LengthVar],
               counter: TraceCounter, *, name: str, masking: bool = True) -> Plan:
    """Trace ``fn`` once and rewrite it to logical lengths: the `Plan`."""
    names = [v.name for v in variables]
    common = dict(name=name, variables=tuple(variables), signature=signature,
                  input_paths=tuple(signature.leaf_paths("array") + signature.leaf_paths("poly")
                                    + [f"valid_length({n})" for n in names]),
                  input_specs=tuple(list(signature.array_avals) + [s for s, _ in signature.poly]),
                  fn=fn)
    traced = export_symbolic(fn, signature, variables, counter)
    if isinstance(traced, Failed):
        return Plan(reason=traced.reason, split_sizes=traced.split_sizes,
                    padding_reason="reshaping is impossible: each bucket runs the function as "
                                   "retraced at the bucket's sizes", **common)
    exported, padding_reason = logical_export(traced, names, masking)
    return Plan(exported=exported, jaxpr=traced.jaxpr, out_tree=traced.out_tree,
                out_paths=traced.out_paths, padding_reason=padding_reason, **common)
