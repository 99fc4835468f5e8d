"""Stage 5, plan: a traced function as an immutable value -- its programs, verdicts and text.

A `Plan` is a chain of `Segment`s run one after another: one segment for a plain function;
several when a data-dependent op cuts it (`px.compact(..., length=K)`, see `_planner`). Each
segment is one symbolic program with its own `Convention`. A plan whose function could not be
traced size-independently keeps the function and its one segment has no program: each bucket
retraces it. A plan read from a file is the same type without the function. Nothing changes a
plan once made.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import numpy as np

from . import _serialize
from ._convention import Convention
from ._errors import PolyexecError, PolymorphismError, SpecError
from ._spec import LengthVar
from ._trace import RaisedMin, TraceCounter, evaluate_shape, trace_at, walk, where


@dataclasses.dataclass(frozen=True)
class Intermediate:
    """One value of the program: which equation made it, where in user code, and its shape."""

    index: int
    primitive: str
    where: str
    shapes: tuple[tuple[int, ...], ...]
    segment: int = 0          # which program of a partitioned plan (px.compact(..., length=K))


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a plan can guarantee, each failure naming the user's line.

    ``reshaping``: why there is no size-independent program (each bucket retraces the
    function), None when there is one; ``padding``: why padding may change a result (an
    operation over a length axis without a logical-length rule), None when it cannot;
    ``split_sizes``: sizes that must be bucket boundaries for the per-bucket retrace to branch
    as the exact size does (from undecidable ``T == c`` comparisons)."""

    reshaping: str | None = None
    padding: str | None = None
    split_sizes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    # A reshaping-impossible plan: the min that lets JAX decide the comparison that failed.
    raise_min: RaisedMin | None = None
    # A size-independent plan: the variables traced at a min above the declared one.
    raised: tuple[RaisedMin, ...] = ()

    def text(self, variables: Sequence[LengthVar]) -> str:
        if self.reshaping:
            return f"RESHAPING IMPOSSIBLE — {self.reshaping}"
        var_text = ", ".join(f"{v.name} in [{v.min}, {v.max}]" for v in variables)
        if self.raised:
            var_text += f" ({'; '.join(r.describe() for r in self.raised)})"
        padding = ("padding-safe: every operation computes over the real lengths"
                   if self.padding is None else f"NOT PADDING-SAFE — {self.padding}")
        return (f"size-independent, traced once over {var_text or 'no length variables'}; "
                f"{padding}")


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

    def handed(self) -> list[tuple[str, tuple[Any, ...], np.dtype]]:
        """(path, dims, dtype) of each value as a later segment's input: ``var`` on the cut axis."""
        return [(f"cut {self.var.name}: values[{i}]",
                 tuple(self.var.name if a == axis else d for a, d in enumerate(shape)), dtype)
                for i, (shape, dtype, axis) in enumerate(zip(self.shapes, self.dtypes, self.axes))]

    def describe(self) -> str:
        return f"{self.where}: defines {self.var.name} in [{self.var.min}, {self.var.max}] = count"


class Program:
    """One segment's program in one layout: its `jax.export.Exported`, or the reason (naming
    the user's line) the layout cannot keep the segment's results.

    A program given as ``build`` is exported when first asked for, once, whichever thread asks:
    a plan that may pack holds both layouts' programs, and a call that runs packed never needs
    the padded one (exporting it cost 0.4 s of the bench's GRU plan, measured at commit d689d85).
    ``empty_cells``: the packed program reads a per-sequence value, so a sequence of length 0
    takes a cell too, where its per-sequence values are held. ``reads_sequence``: the packed
    program takes each cell's sequence index after ``pos`` and ``seglen`` (a random draw
    along the rows folds it in). ``rooms``: per packed variable, the cells the packed program
    needs after each sequence (a value of length ``T + 2``, ``jnp.pad`` by one each side,
    needs 2): each sequence of length n takes ``n + room`` cells of a row, the last one's room
    past the row's ``T`` columns (its layout inputs are ``(rows, T + room)``). `cells` says
    how many cells each sequence takes; everything that plans packed rows from lengths reads
    it.
    """

    def __init__(self, exported: Any = None, *, reason: str | None = None,
                 empty_cells: bool = False, reads_sequence: bool = False,
                 rooms: Mapping[str, int] | None = None,
                 build: Callable[[], Any] | None = None):
        self.reason = reason
        self.empty_cells = empty_cells
        self.reads_sequence = reads_sequence
        self.rooms = dict(rooms or {})
        self._exported = exported
        self._build = build
        self._lock = threading.Lock()

    @property
    def exported(self) -> Any:
        if self._build is not None:
            with self._lock:
                if self._build is not None:
                    self._exported, self._build = self._build(), None
        return self._exported

    @property
    def room(self) -> int:
        """The room of the packed variable (the largest, where several pack)."""
        return max(self.rooms.values(), default=0)

    def room_of(self, var: str | None) -> int:
        """The room after each sequence of ``var`` (None: `room`)."""
        return self.rooms.get(var, self.room)

    def cells(self, lengths: np.ndarray, var: str | None = None) -> np.ndarray:
        """The cells each sequence of ``lengths`` (of ``var``) takes in a packed row: its own,
        the room after it, and one for a sequence of length 0 where per-sequence values are
        held.

        >>> Program(rooms={"T": 2}).cells(np.array([3, 0])).tolist()
        [5, 2]
        >>> Program(empty_cells=True).cells(np.array([3, 0])).tolist()
        [3, 1]
        """
        cells = np.asarray(lengths) + self.room_of(var)
        return np.maximum(cells, 1) if self.empty_cells else cells

    @property
    def built(self) -> bool:
        """Whether the program has been exported (a plan builds what its calls run)."""
        return self._build is None


NO_PACKING = Program(reason="only the pad layout was asked for")


@dataclasses.dataclass(frozen=True, eq=False)
class Segment:
    """One program of a plan: exported once, compiled once per bucket of its live variables.

    ``cut`` is the partition point it stops at (None for the last segment); ``inputs_from``
    the earlier points whose values it takes as extra inputs; ``count_names`` the variables it
    defines in-program (``partition=False``) and returns counts of, after its outputs.
    ``programs`` holds its `Program` per layout (``"pad"``, and ``"pack"`` where packing was
    asked for); ``exported`` (the padded one) and ``jaxpr`` are None when reshaping is
    impossible (the program is retraced per bucket).

    ``live_variables`` are those some shape of the live program depends on: it is compiled
    once per bucket combination of these alone. The dead ones (typically the input lengths in
    a segment that only reads what a cut handed over) are pinned at their minimum and their
    inputs fed placeholders. Without this, the segment after a filter would compile once per
    (input bucket, kept bucket) pair instead of once per kept bucket.
    """

    index: int
    convention: Convention
    programs: Mapping[str, Program]
    jaxpr: Any
    out_tree: Any
    out_paths: tuple[str, ...]
    padding_reason: str | None
    live_variables: tuple[LengthVar, ...]
    live_inputs: tuple[bool, ...]
    cut: CutPoint | None = None
    inputs_from: tuple[CutPoint, ...] = ()
    count_names: tuple[str, ...] = ()
    # The shortest ragged rows the program reads right (`_logical.RowFloor`): a shorter row is
    # refused before anything runs.
    row_floors: tuple[Any, ...] = ()
    # jax.debug.print / jax.debug.callback taken out of the program (`_trace.HostCallbacks`):
    # the executor calls them after each run; None when there are none.
    callbacks: Any = None

    @property
    def exported(self) -> Any:
        """The padded program (`jax.export.Exported`), None when reshaping is impossible."""
        program = self.programs.get("pad")
        return None if program is None else program.exported

    def program(self, layout: str) -> Program:
        """This segment's `Program` in ``layout`` (one that says why where there is none)."""
        return self.programs.get(layout, NO_PACKING)

    @property
    def variables(self) -> tuple[LengthVar, ...]:
        return self.convention.variables

    @property
    def input_paths(self) -> tuple[str, ...]:
        return self.convention.paths

    @property
    def pinned(self) -> dict[str, int]:
        live = {v.name for v in self.live_variables}
        return {v.name: v.min for v in self.variables if v.name not in live}

    @property
    def can_donate(self) -> bool:
        # Every segment but the last is followed by one that reads the same inputs again.
        return self.cut is None

    def bucket_avals(self, bucket: Mapping[str, int]) -> list[jax.ShapeDtypeStruct]:
        """The program's input avals at one bucket (what each bucket is compiled for)."""
        env = {**self.pinned, **{v.name: int(bucket[v.name]) for v in self.live_variables}}
        if self.exported is None:
            return self.convention.avals(env)
        return [jax.ShapeDtypeStruct(evaluate_shape(a.shape, env), a.dtype)
                for a in self.exported.in_avals]

    def feed(self, flat: Sequence[Any], bucket: Mapping[str, int]) -> list[Any]:
        """``flat`` with zeros standing in for the inputs this segment never reads (so a dead
        input's bucket does not make it compile again)."""
        if all(self.live_inputs):
            return list(flat)
        avals = self.bucket_avals(bucket)
        return [x if live or tuple(np.shape(x)) == a.shape else np.zeros(a.shape, a.dtype)
                for x, live, a in zip(flat, self.live_inputs, avals)]

    def shapes(self, env: Mapping[str, int]) -> list[Intermediate]:
        local = {v.name: env[v.name] for v in self.variables}
        avals = self.exported.in_avals if self.exported is not None else [
            v.aval for v in self.jaxpr.jaxpr.invars]
        out = [Intermediate(-1, "input", path, (evaluate_shape(aval.shape, local),), self.index)
               for path, aval in zip(self.input_paths, avals)]
        for i, eqn in enumerate(walk(self.jaxpr.jaxpr)):
            out.append(Intermediate(i, eqn.primitive.name, where(eqn),
                                    tuple(evaluate_shape(v.aval.shape, local) for v in eqn.outvars),
                                    self.index))
        return out

    def describe(self, indent: str) -> list[str]:
        lines = [f"{indent}inputs:"]
        for path, aval, live in zip(self.input_paths, self.exported.in_avals, self.live_inputs):
            lines.append(f"{indent}  {path:<30} {fmt_shape(aval)}{'' if live else '   (unused)'}")
        if self.jaxpr is not None:
            lines.append(f"{indent}program:")
            for i, eqn in enumerate(walk(self.jaxpr.jaxpr)):
                shapes = " ".join(fmt_shape(v.aval) for v in eqn.outvars)
                lines.append(f"{indent}  {i:>4} {eqn.primitive.name:<22} {shapes:<24} {where(eqn)}")
        if self.cut is not None:
            lines.append(f"{indent}CUT at {self.cut.describe()}")
        lines.append(f"{indent}outputs:")
        for path, aval in zip(self.out_paths, self.exported.out_avals):
            lines.append(f"{indent}  {'out' + path if self.cut is None else path:<30} "
                         f"{fmt_shape(aval)}")
        return lines

    def __repr__(self) -> str:
        end = f"cut at {self.cut.var.name}" if self.cut else "final"
        return (f"<Segment {self.index}: {end}, variables "
                f"{[v.name for v in self.live_variables]}>")


def fmt_shape(aval) -> str:
    dims = ",".join(str(d) for d in getattr(aval, "shape", ()))
    dtype = getattr(aval, "dtype", None)
    return f"{dtype.name if dtype is not None else '?'}[{dims}]"


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


Mode = Literal["single", "partition", "bounded"]


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """A function traced once over symbolic lengths, ready to be compiled per bucket.

    ``segments`` are the programs a call runs one after another: one for a plain function,
    several when a data-dependent op (``px.compact(..., length=K)``) cuts it (``dynamic`` are
    the variables such ops define; ``mode`` says how: ``"partition"`` re-buckets after each
    cut, ``"bounded"`` (``partition=False``) runs one program at the upper bound). ``jaxpr`` is
    the size-independent program as traced and ``exported`` the `jax.export.Exported` every
    bucket is compiled from -- the logical rewrite of ``jaxpr`` when ``padding_safe`` (the
    first segment's; None when reshaping is impossible). The `Verdict` says what the plan can
    guarantee: ``reshaping_is_impossible`` / ``reason`` (no size-independent program: the
    function is retraced per bucket) and ``padding_safe`` / ``padding_reason``, each naming the
    user's line.

    >>> import jax.numpy as jnp, polyexec as px
    >>> T = px.LengthVar("T", min=2, max=64)
    >>> plan = px.trace(lambda x: jnp.cumsum(x[:-1]), px.Spec("T", jnp.float32))
    >>> plan.reshaping_is_impossible, plan.padding_safe, len(plan.segments)
    (False, True, 1)
    >>> plan.shapes(T=10)[-1].shapes
    ((9,),)
    """

    name: str
    variables: tuple[LengthVar, ...]          # bound by the inputs' shapes, in input order
    segments: tuple[Segment, ...]
    verdict: Verdict
    mode: Mode = "single"
    dynamic: tuple[LengthVar, ...] = ()       # defined by data-dependent ops
    constants: tuple[Any, ...] | None = None  # the non-Spec arrays px.trace saw (Plan.save)
    fn: Callable | None = dataclasses.field(default=None, repr=False)   # None: loaded
    # Wall seconds of making the plan, per stage: "trace" (the user's function, once per
    # segment, exported), "rewrite" (the padding-exact program), "packed rewrite", "size check".
    # Compiles come later, per bucket (`Stats.compile_seconds`); a loaded plan has none.
    seconds: Mapping[str, float] = dataclasses.field(default_factory=dict, repr=False)

    # -- the verdict ----------------------------------------------------------------------------

    reason = property(lambda self: self.verdict.reshaping)
    reshaping_is_impossible = property(lambda self: self.verdict.reshaping is not None)
    padding_reason = property(lambda self: self.verdict.padding)
    padding_safe = property(lambda self: self.verdict.padding is None)
    split_sizes = property(lambda self: self.verdict.split_sizes)

    @functools.cached_property   # read on every call (the executor checks the sizes)
    def raised_mins(self) -> dict[str, RaisedMin]:
        """Per length variable traced at a min above the declared one (`_trace.RaisedMin`: the
        user's line whose JAX shape rule needs it): its buckets start there; a call's ragged
        rows below it run at their own lengths, an unragged size below it is refused."""
        return {r.var: r for r in self.verdict.raised}

    @property
    def packing_reason(self) -> str | None:
        """Why ``layout="pack"`` cannot run this plan (naming the user's line), None when it
        can: several sequences then share each physical row with the same results."""
        if self.reshaping_is_impossible:
            return f"reshaping is impossible: {self.reason}"
        if self.mode != "single":
            # A cut hands values whose count the host reads between segments: a packed row
            # would hand on several sequences' values at once, and no packed hand-over exists.
            return "a plan with data-dependent sizes runs one sequence per row"
        return self.segments[0].program("pack").reason

    can_pack = property(lambda self: self.packing_reason is None)

    @property
    def packing_room(self) -> int:
        """The cells a packed row leaves after each sequence for this plan's program (0 where
        it cannot pack): a value of length ``T + 2`` needs 2. Whatever plans packed rows from
        lengths (`buckets.packed_batch_plan`'s ``room``) plans with it."""
        return self.segments[0].program("pack").room if self.can_pack else 0

    def packing_room_of(self, var: str) -> int:
        """`packing_room` of the packed variable ``var`` (where several lengths pack, each
        has its own)."""
        return self.segments[0].program("pack").room_of(var) if self.can_pack else 0

    @functools.cached_property   # read on every call (the executor checks the lengths)
    def row_floors(self) -> dict[str, Any]:
        """Per ragged length variable, the shortest row every segment reads right
        (`_logical.RowFloor`: its length and the user's line that needs it)."""
        floors: dict[str, Any] = {}
        for segment in self.segments:
            for floor in segment.row_floors:
                if floor.length > getattr(floors.get(floor.var), "length", 0):
                    floors[floor.var] = floor
        return floors

    # -- the first program and the last one's outputs ---------------------------------------------

    exported = property(lambda self: self.segments[0].exported)
    jaxpr = property(lambda self: self.segments[0].jaxpr)
    input_paths = property(lambda self: self.segments[0].convention.paths)
    input_specs = property(lambda self: self.segments[0].convention.input_specs)
    out_tree = property(lambda self: self.segments[-1].out_tree)
    out_paths = property(lambda self: self.segments[-1].out_paths[
        :len(self.segments[-1].out_paths) - len(self.segments[-1].count_names)])

    @property
    def all_variables(self) -> tuple[LengthVar, ...]:
        return tuple(self.variables) + tuple(self.dynamic)

    def program_at(self, segment: Segment, bucket: Mapping[str, int],
                   counter: TraceCounter) -> tuple[Callable, list]:
        """The program to compile for one segment at one bucket: its exported one, or (slow
        path) the function retraced at the bucket's sizes; the list receives (out_tree,
        out_paths)."""
        if segment.exported is not None:
            return segment.exported.call, [segment.out_tree, segment.out_paths]
        if self.fn is None:
            raise PolymorphismError(self.reason or f"plan {self.name} holds no program")
        return trace_at(self.fn, segment.convention, bucket, counter)

    def _env(self, sizes: Mapping[str, int], what: str) -> dict[str, int]:
        if self.segments[0].jaxpr is None:
            raise PolymorphismError(self.reason or "this plan holds no symbolic program")
        needed = list({v.name: v for s in self.segments for v in s.variables}.values())
        return check_sizes_in(needed, sizes, f"{self.name}: {what}", optional=self.dynamic)

    def shapes(self, **sizes: int) -> list[Intermediate]:
        """Every intermediate's shape at these sizes -- data-dependent sizes included, e.g.
        ``shapes(T=100, K=7)`` -- computed from the symbolic programs alone (no compiling, no
        running): per segment (`Intermediate.segment`), its inputs (index -1), then each
        equation's outputs."""
        env = self._env(sizes, "shapes()")
        return [item for seg in self.segments for item in seg.shapes(env)]

    def output_shapes(self, **sizes: int) -> list[tuple[int, ...]]:
        env = self._env(sizes, "output_shapes()")
        final = self.segments[-1]
        local = {v.name: env[v.name] for v in final.variables}
        return [evaluate_shape(a.shape, local) for a in final.exported.out_avals][:len(self.out_paths)]

    def describe(self) -> str:
        """The program(s) with symbolic shapes, one line per equation, and both verdicts; a
        partitioned plan lists each segment and the user line it is cut at."""
        inputs = ", ".join(f"{v.name} in [{v.min}, {v.max}]" for v in self.variables)
        data = ", ".join(f"{v.name} in [{v.min}, {v.max}]" for v in self.dynamic)
        padding = ("; padding-safe" if self.padding_safe else
                   f"; NOT PADDING-SAFE — {self.padding_reason}")
        if self.mode == "single":
            lines = [f"Plan {self.name}: {self.verdict.text(self.variables)}"]
            if self.exported is not None:
                lines += self.segments[0].describe(indent="")
            return "\n".join(lines)
        if self.mode == "bounded":
            head = (f"Plan {self.name}: bounded (partition=False), one program traced once over "
                    f"{inputs or 'no length variables'}; data-dependent {data} defined in-program, "
                    f"computed at the upper bound")
        else:
            head = (f"Plan {self.name}: partitioned into {len(self.segments)} segments at "
                    f"{len(self.segments) - 1} data-dependent op(s), each traced once over "
                    f"symbolic sizes ({inputs or 'no input lengths'}; from data: {data})")
        lines = [head + padding]
        for seg in self.segments:
            names = ", ".join(v.name for v in seg.live_variables) or "no length variables"
            dead = list(seg.pinned)
            lines.append(f"segment {seg.index}: compiled per bucket of {names}"
                         + ("" if seg.index == 0 else
                            f"; runs at the smallest bucket of {seg.inputs_from[-1].var.name} "
                            f"holding its count")
                         + (f"; does not depend on {', '.join(dead)}" if dead else ""))
            lines += seg.describe(indent="  ")
        return "\n".join(lines)

    def __repr__(self) -> str:
        verdict = "reshaping impossible" if self.reason else "size-independent"
        padding = "" if self.reason or self.padding_safe else ", not padding-safe"
        parts = f", {len(self.segments)} segments" if len(self.segments) > 1 else ""
        dynamic = f", from data {[v.name for v in self.dynamic]}" if self.dynamic else ""
        return (f"<Plan {self.name}: {verdict}{padding}{parts}, variables "
                f"{[v.name for v in self.variables]}{dynamic}>")

    def save(self, path) -> None:
        """Write the exported program (and constants, if any) to ``path``; see `Plan.load`."""
        if self.exported is None:
            raise PolymorphismError(f"cannot save plan {self.name}: reshaping is impossible, so "
                                    f"there is no size-independent program ({self.reason})")
        held = [s.callbacks for s in self.segments if s.callbacks is not None]
        if held:
            raise PolyexecError(f"cannot save plan {self.name}: expected a program that a process "
                                f"without the Python code can run, received one that calls back "
                                f"into Python (jax.debug.print / jax.debug.callback at "
                                f"{'; '.join(h.describe() for h in held)}); it runs and compiles "
                                f"here as any plan, but a saved program cannot call Python: "
                                f"remove those calls to save it")
        if self.mode != "single":
            raise PolyexecError(f"cannot save plan {self.name}: saving a plan with data-dependent "
                                f"sizes ({len(self.segments)} segment(s), {self.mode}) is not "
                                f"supported; save a function without length= instead")
        # A variable traced at a raised min is stored as declared, its raise beside it: the
        # loaded plan then refuses a size below the raise as the live one does, naming why.
        declared = tuple(LengthVar(v.name, min=self.raised_mins[v.name].declared, max=v.max)
                         if v.name in self.raised_mins else v for v in self.variables)
        _serialize.save(path, name=self.name, exported=self.exported,
                        variables=declared, input_paths=self.input_paths,
                        input_specs=self.input_specs, out_paths=self.out_paths,
                        constants=self.constants or (), padding_reason=self.padding_reason,
                        row_floors=tuple(self.row_floors.values()),
                        raised_mins=self.verdict.raised)

    @staticmethod
    def load(path) -> "Plan":
        """Read a plan written by `save`. It runs without the Python code that made it, through
        ``px.bucketed(plan)`` (or `Bucketed.from_plan`): call that with the arrays of its Spec
        inputs (and, unless the plan was saved with its constants, the fixed arrays first, in
        flattened order). A typed PRNG key among the fixed arrays is stored, and taken, as its
        uint32 data (`jax.random.key_data`): the program reads it as a key of the impl it was
        traced with."""
        fields = _serialize.load(path)
        exported = fields["exported"]
        n_out = len(exported.out_avals)
        # Without the Python code the outputs have no structure: one array, or a tuple.
        out_tree = jax.tree_util.tree_structure(0 if n_out == 1 else tuple(range(n_out)))
        convention = Convention.stored(fields["input_specs"], fields["input_paths"],
                                       fields["variables"])
        segment = Segment(index=0, convention=convention, programs={"pad": Program(exported)},
                          jaxpr=None,
                          out_tree=out_tree, out_paths=fields["out_paths"],
                          padding_reason=fields["padding_reason"],
                          row_floors=fields["row_floors"],
                          live_variables=fields["variables"],
                          live_inputs=(True,) * len(convention.slots))
        return Plan(name=fields["name"], variables=fields["variables"], segments=(segment,),
                    verdict=Verdict(padding=fields["padding_reason"],
                                    raised=fields["raised_mins"]),
                    constants=fields["constants"])
