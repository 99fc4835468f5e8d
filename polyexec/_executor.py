"""Stage 7, executor: `bucketed` caches plans and executables and runs them.

Per call: bind the arguments (validate, read the sizes), pick each variable's bucket, get the
plan of the call's signature (traced once, cached), then run its segments in order -- each
one's executable at the bucket (compiled once, single-flight, LRU: `_Executables`), its inputs
assembled by its `Convention` -- and slice the outputs back. Besides that one run path,
`Bucketed` keeps statistics (`_Counters`) and warm-up. Nothing here traces or rewrites a
program: that is `plan_function`'s job, and a plan never changes once made.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import copy
import dataclasses
import functools
import itertools
import os
import threading
import time
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax import export
from rich.progress import Progress

import buckets as _buckets

from . import _bind
from ._cache import compiles_forbidden
from ._errors import (CompileError, LengthOverflowError, OptionError, PolyexecError,
                      PolymorphismError, SpecError, check_bool, check_int, check_option)
from ._jax_internals import dim_vars, evaluate_dim
from ._plan import CutPoint, Plan, Segment
from ._planner import plan_function
from ._spec import LengthVar, Spec, bucket_sizes, call_variables
from ._trace import SHAPE_ERRORS, TraceCounter, evaluate_shape


@dataclasses.dataclass(frozen=True)
class BucketStats:
    """What one bucket has cost and done."""

    sizes: tuple[tuple[str, int], ...]
    calls: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0
    real_elements: int = 0
    padded_elements: int = 0

    @property
    def padding_efficiency(self) -> float:
        return self.real_elements / self.padded_elements if self.padded_elements else 1.0


@dataclasses.dataclass(frozen=True)
class Stats:
    """Per-bucket counters of a bucketed function; ``str(stats)`` is a table."""

    traces: int
    buckets: Mapping[tuple[tuple[str, int], ...], BucketStats]

    calls = property(lambda self: sum(b.calls for b in self.buckets.values()))
    compiles = property(lambda self: sum(b.compiles for b in self.buckets.values()))
    compile_seconds = property(lambda self: sum(b.compile_seconds for b in self.buckets.values()))

    @property
    def padding_efficiency(self) -> float:
        real = sum(b.real_elements for b in self.buckets.values())
        padded = sum(b.padded_elements for b in self.buckets.values())
        return real / padded if padded else 1.0

    def __str__(self) -> str:
        rows = [f"{'bucket':<22}{'calls':>8}{'compiles':>10}{'compile s':>11}{'efficiency':>12}"]
        for key in sorted(self.buckets):
            b = self.buckets[key]
            label = " ".join(f"{n}={s}" for n, s in key) or "(no lengths)"
            rows.append(f"{label:<22}{b.calls:>8}{b.compiles:>10}{b.compile_seconds:>11.2f}"
                        f"{b.padding_efficiency:>12.3f}")
        rows.append(f"{'total':<22}{self.calls:>8}{self.compiles:>10}{self.compile_seconds:>11.2f}"
                    f"{self.padding_efficiency:>12.3f}   traces: {self.traces}")
        return "\n".join(rows)


@dataclasses.dataclass(frozen=True)
class _Compiled:
    executable: Any
    out_tree: Any            # per bucket: the slow path's program may differ in structure
    out_paths: tuple[str, ...]


class _Executables:
    """Compiled programs by (segment, bucket): each compiled once -- threads asking at the same
    time wait for the one compile -- and the least recently used dropped past ``max_cached``."""

    def __init__(self, max_cached: int):
        self.max_cached = max_cached
        self._lock = threading.Lock()
        self._futures: collections.OrderedDict = collections.OrderedDict()

    def get(self, key: tuple, compile: Callable[[], _Compiled],
            refuse: Callable[[], None]) -> tuple[_Compiled, float | None]:
        """The executable and, when this call compiled it, the compile's seconds. ``refuse``
        runs (and may raise) before a compile starts."""
        with self._lock:
            future = self._futures.get(key)
            owner = future is None
            if owner:
                refuse()
                future = self._futures[key] = concurrent.futures.Future()
                self._evict()
            else:
                self._futures.move_to_end(key)
        if not owner:
            return future.result(), None
        try:
            start = time.perf_counter()
            compiled = compile()
            seconds = time.perf_counter() - start
        except BaseException as e:
            with self._lock:
                self._futures.pop(key, None)
            future.set_exception(e)
            raise
        future.set_result(compiled)
        return compiled, seconds

    def _evict(self) -> None:
        while len(self._futures) > self.max_cached:
            oldest = next(iter(self._futures))
            if not self._futures[oldest].done():
                break
            self._futures.pop(oldest)


class _Counters:
    """Per-bucket statistics and the trace count, shared by a function and its re-bucketed
    copies (`Bucketed.with_buckets`)."""

    def __init__(self):
        self.traces = TraceCounter()
        self._lock = threading.Lock()
        self._buckets: dict[tuple, BucketStats] = {}

    def add(self, key: tuple, **increments) -> None:
        with self._lock:
            current = self._buckets.get(key) or BucketStats(key)
            self._buckets[key] = dataclasses.replace(
                current, **{k: getattr(current, k) + v for k, v in increments.items()})

    def snapshot(self) -> Stats:
        with self._lock:
            return Stats(self.traces.count, dict(self._buckets))


class Bucketed:
    """A function compiled once per length bucket from one symbolic trace; see `bucketed`."""

    def __init__(self, fn: Callable, in_specs: Sequence[Any], out_specs: Any = None,
                 buckets: Mapping[LengthVar | str, Any] | None = None, *, strict: bool = False,
                 donate_argnums: Sequence[int] = (), max_cached: int = 64,
                 check_sizes: bool = False, name: str | None = None,
                 in_shardings: Sequence[Any] | None = None, partition: bool = True,
                 masking: bool = True, variables: Sequence[LengthVar] = (),
                 layout: Layout = "pad", pack_rows: Mapping[int, int] | None = None):
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        where = f"bucketed({self.name})"
        if not isinstance(in_specs, (tuple, list)):
            raise SpecError(f"{where}: in_specs: expected a tuple with one entry per positional "
                            f"argument (a Spec, None, or a pytree of them), received {in_specs!r}")
        self.fn = fn
        self.in_specs = tuple(in_specs)
        self.out_specs = out_specs
        self.strict = check_bool(strict, f"{where}: strict")
        self.check_sizes = check_bool(check_sizes, f"{where}: check_sizes")
        # Data-dependent sizes (px.compact(..., length=K)): cut the program there and re-bucket
        # what follows (True), or run it all as one program at the upper bound (False).
        self.partition = check_bool(partition, f"{where}: partition")
        # The logical-length rewrite (padding never changes a result); False for code that
        # masks by itself and wants no overhead.
        self.masking = check_bool(masking, f"{where}: masking")
        # "pad": one sequence per padded row; "pack": several per row of a row-length bucket
        # (T's buckets), the rows bucketed by B's; "auto": per call, the fewer cells.
        self.layout = check_option(layout, LAYOUTS, f"{where}: layout")
        # Whether plans hold the packed program (kept by `with_layout("pad")` copies).
        self._with_packed = self.layout != "pad"
        # Rows per row length for packed calls (a packed batch plan's shapes), so a partial
        # batch runs at its row length's full shape instead of compiling a smaller one.
        self.pack_rows = _check_pack_rows(pack_rows, where)
        self.donate_argnums = tuple(check_int(i, f"{where}: donate_argnums", min=0)
                                    for i in donate_argnums)
        # One jax.sharding.Sharding (or None) per positional argument, applied to every array
        # leaf of it; the executables are compiled for them (data parallel: batch inputs
        # sharded over a Mesh, parameters replicated) and host-padded inputs are placed by them.
        if in_shardings is not None and len(in_shardings) != len(self.in_specs):
            raise OptionError(f"{where}: in_shardings: expected one entry per positional "
                              f"argument ({len(self.in_specs)}), received {len(in_shardings)}")
        self.in_shardings = None if in_shardings is None else tuple(in_shardings)
        resolved = call_variables(self.in_specs, out_specs, buckets, variables, where)
        self.variables = dict(resolved.variables)
        self._input_names = resolved.inputs
        self._policies = resolved.policies
        # Bucket sizes are checked now (a bad policy fails here, not at the first call); those
        # of data-dependent variables that only a plan defines are made when first asked.
        self._sizes: dict[str, tuple[int, ...]] = {
            n: bucket_sizes(v, self._policies.get(n)) for n, v in self.variables.items()}
        # Arguments every call starts with: a loaded plan's stored constants.
        self._prefix: tuple[Any, ...] = ()
        self._loaded: Plan | None = None

        self._lock = threading.Lock()
        self._plans: dict[tuple[_bind.Signature, bool], concurrent.futures.Future] = {}
        self._executables = _Executables(check_int(max_cached, f"{where}: max_cached", min=1))
        self._counters = _Counters()
        self._latest_plan: Plan | None = None
        self._warned = False

    @classmethod
    def from_plan(cls, plan: Plan, buckets: Mapping[LengthVar | str, Any] | None = None,
                  **options) -> "Bucketed":
        """Run a plan loaded by `Plan.load`: call it with its Spec'd inputs (and, unless it was
        saved with its constants, its fixed arrays first, in flattened order). Outputs are cut
        to their symbolic shapes at the real sizes."""
        if plan.exported is None:
            raise PolymorphismError(plan.reason or f"plan {plan.name} holds no program")
        in_specs = [s if isinstance(s, Spec) else None for s in plan.input_specs]
        by_name = {v.name: v for v in plan.variables}
        runner = cls(None, in_specs, None,
                     {by_name[k] if isinstance(k, str) else k: p for k, p in (buckets or {}).items()},
                     name=plan.name, variables=plan.variables, **options)
        runner._loaded, runner._prefix = plan, tuple(plan.constants or ())
        return runner

    # -- public -------------------------------------------------------------------------------

    def __call__(self, *args):
        call = self._bind(args)
        return self._run(self._plan(call.signature), call)

    def _call_at_least(self, buckets: Mapping[str, int], *args):
        """A padded call at buckets no smaller than ``buckets`` (each one of the variable's
        bucket sizes). polyexec.training runs a partial batch's real rows at its full batch's
        shape this way: padded rows of ``B`` are not rows, so a mean over the rows counts the
        real ones only, where zero-length filler rows would have been counted."""
        call = self._bind(args)
        return self._run(self._plan(call.signature), call, buckets)

    @property
    def plan(self) -> Plan:
        """The plan of the latest call (tracing it now when no argument lacks a Spec)."""
        if self._latest_plan is None:
            if not all(isinstance(s, Spec) for s in self.in_specs):
                raise SpecError(f"{self.name}.plan: call the function or warmup(...) first — "
                                f"arguments without a Spec decide the plan")
            self._plan(self._example_call(()).signature)
        return self._latest_plan

    def plan_for(self, *args) -> Plan:
        """The plan of a call with these arguments -- the ones without a Spec (e.g. the
        model), or a full call -- traced once, compiling nothing."""
        return self._plan(self._example_call(args).signature)

    @property
    def stats(self) -> Stats:
        return self._counters.snapshot()

    @property
    def traces(self) -> int:
        """How many times Python ran the user function (tracing)."""
        return self._counters.traces.count

    def bucket_sizes(self, name: str, plan: Plan | None = None) -> tuple[int, ...]:
        """The sizes variable ``name`` compiles at: its policy's, plus the sizes a plan needs as
        boundaries (a reshaping-impossible plan that compares ``T == c``)."""
        with self._lock:
            sizes = self._sizes.get(name)
            if sizes is None:
                var = self.variables.get(name) or next(
                    v for v in (plan.dynamic if plan else ()) if v.name == name)
                sizes = self._sizes[name] = bucket_sizes(var, self._policies.get(name))
        extra = plan.split_sizes.get(name, ()) if plan is not None else ()
        if extra:
            var = self.variables[name]
            sizes = tuple(sorted(set(sizes) | {s for s in extra if var.min <= s <= var.max}))
        return sizes

    def bucket_for(self, name: str, size: int, plan: Plan | None = None) -> int:
        """The smallest bucket of ``name`` that holds ``size``."""
        sizes = self.bucket_sizes(name, plan)
        i = bisect.bisect_left(sizes, size)
        if i == len(sizes):
            raise LengthOverflowError(f"{name}={size} is above the largest bucket {sizes[-1]}")
        return sizes[i]

    def warmup(self, *args, sizes: Sequence[Mapping[str, int]] | None = None,
               max_workers: int | None = None, progress: bool = False) -> list[dict[str, int]]:
        """Compile buckets ahead of time on parallel threads; return the buckets compiled.

        ``args`` are the arguments without a Spec (e.g. the model), in order — or a full
        example call. ``sizes`` lists buckets as ``{name: size}`` dicts (default: every
        combination of every variable's bucket sizes).
        """
        sizes = _bind.check_warmup(sizes, max_workers, self._input_names, self.variables,
                                   f"{self.name}.warmup")   # before anything traces
        call = self._example_call(args)
        plan = self._plan(call.signature)
        if self.layout == "pack" and plan.can_pack:
            return self._warmup_packed(plan, sizes, max_workers, progress)
        if sizes is None:
            names = list(self._input_names)
            combos = [dict(zip(names, c))
                      for c in itertools.product(*(self.bucket_sizes(n, plan) for n in names))]
        else:
            combos = [{n: self.bucket_for(n, int(s), plan) for n, s in d.items()} for d in sizes]
        jobs = self._warmup_jobs(plan, combos)
        self._compile_all([functools.partial(self._executable, plan, seg, combo)
                           for seg, combo in jobs], max_workers, progress)
        return [combo for _, combo in jobs]

    def _warmup_packed(self, plan: Plan, sizes, max_workers, progress) -> list[dict[str, int]]:
        """`warmup` under ``layout="pack"``: ``{B: rows, T: row length}`` sizes are packed
        grids, at the rows a call of that many rows would run (``pack_rows``, else B's
        bucket); by default every ``pack_rows`` entry, or else every B x T bucket."""
        ((var, (_, rows_var)),) = plan.segments[0].convention.rows_at.items()
        if sizes is None:
            grids = ([{rows_var: r, var: n} for n, r in sorted(self.pack_rows.items())]
                     or [{rows_var: r, var: n} for r in self.bucket_sizes(rows_var, plan)
                         for n in self.bucket_sizes(var, plan)])
        else:
            grids = []
            for d in sizes:
                n = self.bucket_for(var, int(d[var]), plan)
                grids.append({var: n,
                              rows_var: self._packed_rows(plan, rows_var, n, int(d[rows_var]))})
        self._compile_all([functools.partial(self._packed_executable, plan.segments[0], grid)
                           for grid in grids], max_workers, progress)
        return grids

    def _compile_all(self, jobs: Sequence[Callable[[], Any]], max_workers, progress) -> None:
        workers = max_workers or min(len(jobs), os.cpu_count() or 1) or 1
        bar = _progress(progress, f"compiling {self.name}", len(jobs))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = [pool.submit(job) for job in jobs]
            for future in concurrent.futures.as_completed(futures):
                future.result()
                bar.advance()
        bar.close()

    def with_buckets(self, buckets: Mapping[LengthVar | str, Any]) -> "Bucketed":
        """This function at other bucket sizes, sharing its trace, compiled buckets and stats.

        Nothing is traced again, and a bucket both compile at is compiled once: for sizes
        chosen after a first compile (`polyexec.training.fit` measures one bucket, then picks
        the others by predicted cost). Variables not in ``buckets`` keep their sizes.

        >>> import jax.numpy as jnp, numpy as np, polyexec as px
        >>> T = px.LengthVar("T", max=64)
        >>> f = px.bucketed(lambda x: x * 2, in_specs=(px.Spec("T", jnp.float32),), buckets={T: [64]})
        >>> g = f.with_buckets({T: [8, 64]})
        >>> g(np.ones(5, np.float32)).shape, g.traces, g.bucket_sizes("T"), f.bucket_sizes("T")
        ((5,), 1, (8, 64), (64,))
        """
        where = f"{self.name}.with_buckets"
        policies = dict(self._policies)
        for key, policy in dict(buckets).items():
            name = key.name if isinstance(key, LengthVar) else key
            if name not in self.variables:
                raise SpecError(f"{where}: buckets: expected keys among the variables the Specs "
                                f"use ({', '.join(self.variables)}), received {name!r}")
            policies[name] = policy
        sizes = {n: bucket_sizes(v, policies.get(n)) for n, v in self.variables.items()}
        other = copy.copy(self)     # shares the lock, plans, executables and counters
        other._policies, other._sizes = policies, sizes
        return other

    def with_layout(self, layout: Layout, pack_rows: Mapping[int, int] | None = None
                    ) -> "Bucketed":
        """This function under another ``layout`` (and ``pack_rows``), sharing its trace,
        compiled programs and stats: a run that chose its layout by cost
        (`polyexec.training.choose_layout`) pins it on a step made with ``layout="auto"``
        without tracing again. From a ``layout="pad"`` function, a packing copy traces once more (the pad
        plan holds no packed program).

        >>> import jax.numpy as jnp, numpy as np, polyexec as px
        >>> T, B = px.LengthVar("T", max=64), px.LengthVar("B", max=8)
        >>> f = px.bucketed(lambda x, n: jnp.sum(x), layout="auto", buckets={T: [64]},
        ...                 in_specs=(px.Spec("B T", jnp.float32), px.Spec("B", jnp.int32, lengths_of=T)))
        >>> x, n = np.ones((4, 10), np.float32), np.array([10, 3, 7, 1], np.int32)
        >>> [float(g(x, n)) for g in (f.with_layout("pad"), f.with_layout("pack"))], f.traces
        ([21.0, 21.0], 1)
        >>> sorted(f.stats.buckets)     # one padded (B, T) bucket, one packed row
        [(('B', 4), ('T', 64)), (('rows(B)', 1), ('row_length(T)', 64))]
        """
        where = f"{self.name}.with_layout"
        other = copy.copy(self)     # shares the lock, plans, executables and counters
        other.layout = check_option(layout, LAYOUTS, f"{where}: layout")
        other._with_packed = self._with_packed or other.layout != "pad"
        other.pack_rows = _check_pack_rows(pack_rows, where) if pack_rows is not None \
            else self.pack_rows
        return other

    # -- planning -------------------------------------------------------------------------------

    def _bind(self, args: Sequence[Any]) -> _bind.BoundCall:
        expected = len(self.in_specs) - len(self._prefix)
        if self._loaded is not None and len(args) != expected:   # its in_specs are not the user's
            raise SpecError(f"plan {self.name}: expected {expected} positional arguments, "
                            f"received {len(args)}")
        return _bind.bind(self._prefix + tuple(args), self.in_specs, self.variables,
                          offset=len(self._prefix))

    def _example_call(self, args: Sequence[Any]) -> _bind.BoundCall:
        """Bind either a full example call or only the non-Spec arguments, with zeros at each
        variable's minimum standing in for the Spec arguments."""
        args = self._prefix + tuple(args)
        if len(args) != len(self.in_specs):
            args = _bind.example_args(self.in_specs, self.variables, args, f"{self.name}.warmup")
        return _bind.bind(args, self.in_specs, self.variables)

    def _plan(self, signature: _bind.Signature) -> Plan:
        """The plan of a signature: made once (threads asking at the same time wait for it)."""
        # A pad-only plan has no packed program: a copy that may pack (`with_layout`) makes
        # its own plan rather than run padded for ever.
        key = (signature, self._with_packed)
        with self._lock:
            future = self._plans.get(key)
            owner = future is None
            if owner:
                future = self._plans[key] = concurrent.futures.Future()
        if owner:
            try:
                plan = self._make_plan(signature)
            except BaseException as e:
                with self._lock:
                    del self._plans[key]
                future.set_exception(e)
                raise
            future.set_result(plan)
        plan = future.result()
        self._latest_plan = plan
        self._verdict(plan)
        return plan

    def _make_plan(self, signature: _bind.Signature) -> Plan:
        if self._loaded is None:
            return plan_function(self.fn, signature, self.variables, self._input_names,
                                 self.out_specs, self._counters.traces, name=self.name,
                                 partition=self.partition, masking=self.masking,
                                 check_sizes=self.check_sizes,
                                 bucket_sizes={n: self.bucket_sizes(n) for n in self._input_names},
                                 pack=self._with_packed)
        # A loaded plan runs as it is, for the fixed arrays it was traced with.
        expected = [s for s in self._loaded.input_specs if not isinstance(s, Spec)]
        for path, (shape, dtype), want in zip(signature.leaf_paths("array"),
                                              signature.array_avals, expected):
            if (tuple(shape), np.dtype(dtype)) != (tuple(want[0]), np.dtype(want[1])):
                raise SpecError(f"{path}: expected {np.dtype(want[1]).name}{list(want[0])}, "
                                f"received {np.dtype(dtype).name}{list(shape)}")
        return self._loaded

    def _verdict(self, plan: Plan) -> None:
        """Never silent: a plan that cannot guarantee a result warns once, or raises (strict)."""
        if self.layout == "pack" and not plan.can_pack and not plan.reshaping_is_impossible \
                and plan.padding_safe:
            message = (f"{self.name} cannot run packed rows, so it runs one sequence per padded "
                       f"row (layout='pad', the same results): {plan.packing_reason}")
            reason = plan.packing_reason
        elif plan.reshaping_is_impossible:
            # The retraced program sees concrete sizes, so nothing can tell its length axes
            # from others: it runs on the padded arrays as written, unchecked.
            unchecked = (", and nothing checks that padding leaves its result unchanged (each "
                         "bucket runs it on the padded arrays as written)" if self.masking else "")
            # Nor can its outputs' length axes be told apart: without out_specs they keep the
            # bucket's sizes (see `_outputs`).
            uncut = ("; its outputs keep the bucket's shape (out_specs says how to cut them back)"
                     if self.out_specs is None else "")
            message = (f"{self.name} is not shape-polymorphic, so it is retraced and compiled per "
                       f"bucket{unchecked}{uncut}: {plan.reason}")
            reason = plan.reason
        elif self.masking and not plan.padding_safe:
            message = (f"{self.name} is not padding-safe, so padding may change its result: "
                       f"{plan.padding_reason}")
            reason = plan.padding_reason
        else:
            return
        if self.strict:
            raise PolymorphismError(reason)
        with self._lock:
            warn, self._warned = not self._warned, True
        if warn:
            warnings.warn(message, stacklevel=4)

    # -- running --------------------------------------------------------------------------------

    def _run(self, plan: Plan, call: _bind.BoundCall, least: Mapping[str, int] | None = None):
        """One call: each segment at its bucket, in order; between two, the count of the
        data-dependent size is read on the host and the handed values cut to its bucket."""
        _bind.check_row_floors(call, plan.row_floors)
        if self.layout != "pad" and plan.can_pack:
            layout = self._pack(plan, call)
            # auto: the layout with fewer cells for this call (a step's cost is per cell);
            # equal cells stay padded, one sequence a row.
            if self.layout == "pack" or layout.cells < self._padded_cells(plan, layout):
                return self._run_packed(plan, call, layout)
        sizes = dict(call.sizes)
        least = least or {}
        bucket = {n: max(self.bucket_for(n, s, plan), least.get(n, 0)) for n, s in sizes.items()}
        poly, real, padded = _bind.pad_inputs(call, bucket)   # before compiling: it may refuse
        handed: list[Any] = []
        for segment in plan.segments:
            compiled = self._executable(plan, segment, bucket)
            flat = segment.convention.assemble(arrays=call.arrays, poly=poly, handed=handed,
                                               sizes=sizes)
            outputs = compiled.executable(*segment.feed(flat, bucket))
            self._counters.add(self._key(segment, bucket), calls=1, real_elements=real,
                               padded_elements=padded)
            if segment.cut is None:
                break
            # A segment reads the values of every cut before it.
            new, real, padded = self._hand_over(plan, segment.cut, outputs, sizes, bucket)
            handed = handed + new
        n_user = len(outputs) - len(segment.count_names)
        for name, count in zip(segment.count_names, outputs[n_user:]):
            sizes[name] = int(count)
        # Global arrays across processes cannot be read on one: their outputs' ragged tails
        # stay as computed (polyexec.training's steps return losses, which have none).
        ragged = {name: (np.asarray(flat[at])[:sizes[rows]], rows)
                  for name, (at, rows) in segment.convention.rows_at.items()
                  if _bind._readable(flat[at])}
        return self._outputs(compiled.out_tree, segment, list(outputs[:n_user]), sizes, ragged)

    def _pack(self, plan: Plan, call: _bind.BoundCall) -> "_PackedLayout":
        """Where this call's sequences go: rows of the smallest row length (a bucket of T)
        that holds the longest, as many as first-fit needs bucketed by B's buckets (or
        ``pack_rows``), the sequences spread over all of them (`buckets.balanced_fit`): the
        packed program's scans stop at the last real column."""
        segment = plan.segments[0]
        ((var, (at, rows_var)),) = segment.convention.rows_at.items()
        poly_at = at - segment.convention.count("array")
        lengths = np.asarray(call.poly[poly_at]).astype(np.int64).reshape(-1)
        # A sequence of length 0 takes a cell where the program holds per-sequence values.
        cells = np.maximum(lengths, 1) if segment.packed_per_sequence else lengths
        row_length = self.bucket_for(var, max(int(lengths.max(initial=0)), 1), plan)
        first = _buckets.first_fit(cells, row_length)
        n_rows = self._packed_rows(plan, rows_var, row_length, first.rows)
        packing = _buckets.balanced_fit(cells, row_length, n_rows, first=first)
        return _PackedLayout(lengths, packing, n_rows, var, rows_var,
                             empty_cells=segment.packed_per_sequence)

    def _packed_rows(self, plan: Plan, rows_var: str, row_length: int, needed: int) -> int:
        """The rows a packed grid of ``row_length`` runs at when ``needed`` are filled:
        ``pack_rows[row_length]`` when it holds them, else B's bucket."""
        rows = self.pack_rows.get(row_length, 0)
        return rows if rows >= max(needed, 1) else self.bucket_for(rows_var, max(needed, 1), plan)

    def _padded_cells(self, plan: Plan, layout: "_PackedLayout") -> int | float:
        """The cells of the same call in the pad layout: its (B, T) bucket (infinite when B
        has no bucket that holds the sequences)."""
        try:
            rows = self.bucket_for(layout.rows_var, max(len(layout.lengths), 1), plan)
        except LengthOverflowError:
            return float("inf")
        return rows * self.bucket_for(layout.var, max(layout.longest, 1), plan)

    def _run_packed(self, plan: Plan, call: _bind.BoundCall, layout: "_PackedLayout"):
        """One call with several sequences per row (`_pack`); per-sequence outputs cut back
        out of their rows."""
        segment = plan.segments[0]
        var, rows_var, lengths = layout.var, layout.rows_var, layout.lengths
        n_rows, row_length, longest = layout.rows, layout.packing.row_length, layout.longest
        poly, real, padded = [], 0, 0
        for arr, (spec, dtype) in zip(call.poly, call.signature.poly):
            poly.append(layout.pack(np.asarray(arr), spec, dtype, self.bucket_for, plan))
            if var in spec.dims and rows_var in spec.dims:
                rest = int(np.prod(poly[-1].shape)) // (n_rows * row_length)
                real += int(lengths.sum()) * rest
                padded += n_rows * row_length * rest
        sizes = {**call.sizes, rows_var: len(lengths), var: longest}
        compiled = self._packed_executable(segment, {rows_var: n_rows, var: row_length})
        key = _packed_key(segment, {rows_var: n_rows, var: row_length})
        flat = segment.convention.assemble(arrays=call.arrays, poly=poly, sizes=sizes)
        outputs = compiled.executable(*flat, layout.pos, layout.seglen)
        self._counters.add(key, calls=1, real_elements=real, padded_elements=padded)
        leaves = [layout.unpack(leaf, aval.shape, sizes)
                  for leaf, aval in zip(outputs, segment.jaxpr.out_avals)]
        return jax.tree_util.tree_unflatten(compiled.out_tree, leaves)

    def _packed_executable(self, segment: Segment, bucket: Mapping[str, int]) -> _Compiled:
        """The packed program at ``{rows: R, row length: L}``, compiled once."""
        key = _packed_key(segment, bucket)

        def compile_packed():
            n = len(segment.convention.slots)
            avals = [jax.ShapeDtypeStruct(evaluate_shape(a.shape, bucket), a.dtype)
                     for a in segment.packed.in_avals]
            # The convention's inputs carry their shardings; the two layout arrays follow.
            avals = segment.convention.with_shardings(avals[:n], self.in_shardings) + avals[n:]
            donate = (segment.convention.donated(self.donate_argnums) if segment.can_donate
                      else ())
            lowered = jax.jit(segment.packed.call, donate_argnums=donate).lower(*avals)
            return _Compiled(lowered.compile(), segment.out_tree, segment.out_paths)

        return self._cached((id(segment), "pack", key), key, f"packed rows {dict(bucket)}",
                            compile_packed)

    def _hand_over(self, plan: Plan, cut: CutPoint, outputs: Sequence[Any],
                   sizes: dict[str, int], bucket: dict[str, int]) -> tuple[list[Any], int, int]:
        """The values a cut hands to the next segment, cut (or padded) to the bucket of its
        count; ``sizes`` and ``bucket`` learn the new variable. Returns the values and their
        real and padded element counts."""
        count = int(outputs[-1])           # the host synchronisation: the op decides its size
        values = [np.asarray(v) for v in outputs[:-1]]
        limit = min(v.shape[a] for v, a in zip(values, cut.axes) if a is not None)
        if not 0 <= count <= limit:
            raise PolyexecError(f"{cut.where}: count {count} is outside [0, {limit}], the "
                                f"size of the values buffer")
        if count > cut.var.max:
            raise LengthOverflowError(f"{cut.where}: data-dependent size {cut.var.name} = "
                                      f"{count} is above {cut.var.name}'s max={cut.var.max} "
                                      f"({cut.var})")
        size = self.bucket_for(cut.var.name, count, plan)
        sizes[cut.var.name], bucket[cut.var.name] = count, size
        handed, real, padded = [], 0, 0
        for v, a, fill in zip(values, cut.axes, cut.fills):
            if a is None:
                handed.append(v)
                continue
            shape = list(v.shape)
            shape[a] = size
            # The first `size` entries, padded with the fill if the buffer is shorter.
            handed.append(_bind.pad_to(v[(slice(None),) * a + (slice(0, size),)], shape, fill))
            rest = int(np.prod(v.shape)) // max(v.shape[a], 1)
            real += count * rest
            padded += size * rest
        return handed, real, padded

    def _outputs(self, out_tree, segment: Segment, leaves: list[Any], sizes: Mapping[str, int],
                 ragged: Mapping[str, tuple[np.ndarray, str]]):
        """The outputs as the exact-size call returns them: each leaf cut to its symbolic shape
        evaluated at the real sizes (``T - 1`` at T=5 is 4), or by ``out_specs`` when given.
        A reshaping-impossible plan has no symbolic shapes: without ``out_specs`` its outputs
        keep the bucket's size (its verdict has said so). An axis ragged along rows comes back
        at the longest row's length, each row's tail set to the pad (the out Spec's, else 0)."""
        specs = [None] * len(leaves)
        if self.out_specs is not None:
            specs = _bind.spec_per_leaf(self.out_specs, jax.tree_util.tree_unflatten(
                out_tree, list(range(len(leaves)))), "out_specs")
            leaves = [leaf if spec is _bind.FIXED else _bind.unpad(leaf, spec, sizes)
                      for leaf, spec in zip(leaves, specs)]
        elif segment.exported is not None:
            env = {n: int(s) for n, s in sizes.items()}
            # Sliced on the host, like inputs are padded there: slicing a device array would
            # compile one small program per distinct real size.
            real = [tuple(_real_size(d, env, ragged) for d in aval.shape)
                    for aval in segment.exported.out_avals]
            leaves = [leaf if shape == tuple(leaf.shape) else
                      np.asarray(leaf)[tuple(slice(0, n) for n in shape)]
                      for leaf, shape in zip(leaves, real)]
        if ragged and segment.exported is not None:
            leaves = [_clear_ragged_tails(leaf, aval.shape, sizes, ragged,
                                          getattr(spec, "pad", 0) or 0)
                      for leaf, aval, spec in zip(leaves, segment.exported.out_avals, specs)]
        return jax.tree_util.tree_unflatten(out_tree, leaves)

    # -- compiling ------------------------------------------------------------------------------

    def _key(self, segment: Segment, bucket: Mapping[str, int]) -> tuple:
        return tuple((v.name, bucket[v.name]) for v in segment.live_variables)

    def _executable(self, plan: Plan, segment: Segment, bucket: Mapping[str, int]) -> _Compiled:
        """The compiled program of one segment at one bucket (counted in the stats when this
        call compiled it)."""
        key = self._key(segment, bucket)
        return self._cached((id(segment), key), key, f"bucket {dict(bucket)}",
                            lambda: self._compile(plan, segment, bucket))

    def _cached(self, cache_key: tuple, stats_key: tuple, what: str,
                compile: Callable[[], _Compiled]) -> _Compiled:
        """An executable compiled once (refused under `forbid_compiles`), its compile counted
        in the stats under ``stats_key`` by the call that made it."""
        def refuse():
            if compiles_forbidden():
                raise CompileError(f"{self.name}: {what} is not compiled and compiles are "
                                   f"forbidden here")

        compiled, seconds = self._executables.get(cache_key, compile, refuse)
        if seconds is not None:
            self._counters.add(stats_key, compiles=1, compile_seconds=seconds)
        return compiled

    def _compile(self, plan: Plan, segment: Segment, bucket: Mapping[str, int]) -> _Compiled:
        convention = segment.convention
        avals = convention.with_shardings(segment.bucket_avals(bucket), self.in_shardings)
        donate = convention.donated(self.donate_argnums) if segment.can_donate else ()
        program, cell = plan.program_at(segment, bucket, self._counters.traces)
        try:
            lowered = jax.jit(program, donate_argnums=donate).lower(*avals)
        except SHAPE_ERRORS as e:
            if segment.exported is not None:
                raise
            # The slow path: code that only works at some sizes (a reshape that divides for
            # some T) fails at this bucket. Say where, and why it was retraced.
            raise PolymorphismError(f"{self.name} at bucket {dict(bucket)}: {type(e).__name__}: "
                                    f"{e}; it was retraced per bucket because {plan.reason}"
                                    ) from None
        return _Compiled(lowered.compile(), cell[0], tuple(cell[1]))

    def _warmup_jobs(self, plan: Plan, combos: Sequence[Mapping[str, int]]):
        """(segment, bucket) pairs to compile: each segment at every given input bucket combined
        with every bucket of its data-dependent variables (or the ones named in ``combos``)."""
        if plan.mode == "single":
            return [(plan.segments[0], combo) for combo in combos]
        jobs, seen = [], set()
        for seg in plan.segments:
            live = [v.name for v in seg.live_variables]
            for combo in combos:
                fixed = {n: combo[n] for n in live if n in combo}
                free = [n for n in live if n not in combo]
                for values in itertools.product(*(self.bucket_sizes(n, plan) for n in free)):
                    sizes = {**fixed, **dict(zip(free, values))}
                    key = (id(seg), tuple(sorted(sizes.items())))
                    if key not in seen:
                        seen.add(key)
                        jobs.append((seg, sizes))
        return jobs


def _packed_key(segment: Segment, bucket: Mapping[str, int]) -> tuple:
    """A packed program's stats key: ``(("rows(B)", R), ("row_length(T)", L))``."""
    ((var, (_, rows_var)),) = segment.convention.rows_at.items()
    return ((f"rows({rows_var})", bucket[rows_var]), (f"row_length({var})", bucket[var]))


def _check_pack_rows(pack_rows: Mapping[int, int] | None, where: str) -> dict[int, int]:
    if pack_rows is not None and not isinstance(pack_rows, Mapping):
        raise OptionError(f"{where}: pack_rows: expected a mapping row length -> rows, "
                          f"received {pack_rows!r}")
    return {check_int(k, f"{where}: pack_rows key (a row length)", min=1):
            check_int(v, f"{where}: pack_rows[{k}]", min=1) for k, v in (pack_rows or {}).items()}


Layout = Literal["pad", "pack", "auto"]
LAYOUTS: tuple[str, ...] = typing.get_args(Layout)


class _PackedLayout:
    """Where each sequence of one packed call sits, and the moves in and out of that grid
    (on the host, like padding: a device gather would compile per call shape)."""

    def __init__(self, lengths: np.ndarray, packing, rows: int, var: str, rows_var: str, *,
                 empty_cells: bool = False):
        self.lengths, self.packing, self.rows = lengths, packing, rows
        self.var, self.rows_var = var, rows_var
        # Whether a sequence of length 0 holds a cell (pos 0, seglen 0) for its per-sequence
        # values: `packing` placed it as a sequence of length 1.
        self.empty_cells = empty_cells

    # Per real cell, built only when the call runs packed: layout="auto" prices a call by
    # its cells alone and may run it padded.
    @functools.cached_property
    def seq(self) -> np.ndarray:
        return _cells_of(self.lengths)[0]

    @functools.cached_property
    def offset(self) -> np.ndarray:
        return _cells_of(self.lengths)[1]

    @functools.cached_property
    def row(self) -> np.ndarray:
        return self.packing.row[self.seq]

    @functools.cached_property
    def column(self) -> np.ndarray:
        return self.packing.start[self.seq] + self.offset

    @functools.cached_property
    def pos(self) -> np.ndarray:
        pos = np.full((self.rows, self.packing.row_length), -1, np.int32)
        pos[self.row, self.column] = self.offset
        if self.empty_cells:
            empty = self.lengths == 0
            pos[self.packing.row[empty], self.packing.start[empty]] = 0
        return pos

    @functools.cached_property
    def sequence_cells(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(sequence, row, column)`` of every cell a sequence holds (one for a sequence of
        length 0 where it has one): where its per-sequence values are."""
        seq, offset = _cells_of(np.maximum(self.lengths, 1) if self.empty_cells else self.lengths)
        return seq, self.packing.row[seq], self.packing.start[seq] + offset

    @functools.cached_property
    def seglen(self) -> np.ndarray:
        seglen = np.zeros((self.rows, self.packing.row_length), np.int32)
        seglen[self.row, self.column] = self.lengths[self.seq]
        return seglen

    @property
    def longest(self) -> int:
        return int(self.lengths.max(initial=0))

    @property
    def cells(self) -> int:
        return self.rows * self.packing.row_length

    def pack(self, arr: np.ndarray, spec: Spec, dtype, bucket_for, plan) -> np.ndarray:
        dims = list(spec.dims)
        if self.rows_var in dims and self.var in dims:
            b, t = dims.index(self.rows_var), dims.index(self.var)
            x = np.moveaxis(arr, (b, t), (0, 1))
            out = np.full((self.rows, self.packing.row_length) + x.shape[2:], spec.pad, dtype)
            out[self.row, self.column] = x[self.seq, self.offset]
            return np.moveaxis(out, (0, 1), (b, t))
        if self.rows_var in dims:
            # Per sequence (the lengths, labels): at every cell of its sequence, a columns axis
            # after the rows axis.
            b = dims.index(self.rows_var)
            x = np.moveaxis(arr, b, 0)
            out = np.zeros((self.rows, self.packing.row_length) + x.shape[1:], dtype)
            seq, row, column = self.sequence_cells
            out[row, column] = x[seq]
            return np.moveaxis(out, (0, 1), (b, b + 1))
        bucket = {n: bucket_for(n, s, plan) for n, s in zip(dims, arr.shape) if isinstance(n, str)}
        bucket[self.var] = self.packing.row_length
        return _bind.pad_to(arr.astype(dtype, copy=False),
                            [bucket.get(d, s) if isinstance(d, str) else s
                             for d, s in zip(dims, arr.shape)], spec.pad)

    def unpack(self, leaf, shape, sizes: Mapping[str, int]):
        """An output as the pad layout returns it: a ``(B, T-like)`` pair of axes becomes
        ``(sequences, e(longest))`` with each sequence's own ``e(n)`` positions and zeros
        after; other length axes are cut to their real sizes (on the host). An output with
        no length axis (a loss, a train step's new parameters) stays on the device: reading
        it would wait for the step, and the caller's next batch could not overlap it."""
        names = [dim_vars(d) for d in shape]
        if not any(names):
            return leaf
        leaf = np.asarray(leaf)
        b = [a for a, n in enumerate(names) if n == {self.rows_var}]
        t = [a for a, n in enumerate(names) if self.var in n and self.rows_var not in n]
        if len(b) == 1 and len(t) == 1:
            b, t = b[0], t[0]
            d = shape[t]
            per = np.maximum(np.asarray(evaluate_dim(d, {**sizes, self.var: self.lengths})), 0)
            per = np.broadcast_to(per, self.lengths.shape).astype(np.int64)
            x = np.moveaxis(leaf, (b, t), (0, 1))
            out = np.zeros((len(self.lengths), int(per.max(initial=0))) + x.shape[2:], x.dtype)
            keep = self.offset < per[self.seq]
            out[self.seq[keep], self.offset[keep]] = x[self.row[keep], self.column[keep]]
            return np.moveaxis(out, (0, 1), (b, t))
        if len(b) == 1 and not t:
            # Per sequence: held at every cell of its sequence; read at its first.
            b = b[0]
            x = np.moveaxis(leaf, (b, b + 1), (0, 1))
            return np.moveaxis(x[self.packing.row, self.packing.start], 0, b)
        real = evaluate_shape(shape, sizes)
        return leaf[tuple(slice(0, n) for n in real)] if real != tuple(leaf.shape) else leaf


def _cells_of(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(sequence, offset)`` of every cell of sequences laid end to end, ``counts`` cells
    each."""
    seq = np.repeat(np.arange(len(counts)), counts)
    return seq, np.arange(len(seq)) - np.repeat(np.cumsum(counts) - counts, counts)


def _real_size(d, env: Mapping[str, int], ragged: Mapping[str, tuple[np.ndarray, str]]) -> int:
    """An output dimension at the real sizes: a count over rows of a length ragged along them
    (``B*T``, a reshape merging the rows) is the sum of the rows' own counts."""
    if not export.is_symbolic_dim(d):
        return int(d)
    names = dim_vars(d)
    for name, (lengths, rows) in ragged.items():
        if name in names and rows in names:
            per_row = np.maximum(np.asarray(evaluate_dim(
                d // export.symbolic_shape(rows, scope=d.scope)[0], {**env, name: lengths})), 0)
            return int(np.sum(per_row))
    # A ragged length alone: the longest real row's (the input may be wider than that).
    longest = {name: int(lengths.max(initial=0)) for name, (lengths, _) in ragged.items()
               if name in names}
    return max(int(evaluate_dim(d, {**env, **longest})), 0)


def _clear_ragged_tails(leaf, shape, sizes: Mapping[str, int],
                        ragged: Mapping[str, tuple[np.ndarray, str]], pad) -> Any:
    """``leaf`` with each row's positions beyond its own length (along every axis ragged along
    a rows axis the leaf has) set to ``pad``: they do not exist, whatever the program left
    there. On the host, like the slicing before it."""
    out = None
    for axis, d in enumerate(shape):
        if not export.is_symbolic_dim(d):
            continue
        names = dim_vars(d)
        for name, (lengths, rows) in ragged.items():
            row_axes = [k for k, r in enumerate(shape) if export.is_symbolic_dim(r) and str(r) == rows]
            if name not in names or rows in names or len(row_axes) != 1:
                continue
            env = {**sizes, name: lengths}
            per_row = np.maximum(np.asarray(evaluate_dim(d, env)), 0)        # (rows,)
            if out is None:
                out = np.array(leaf)
            index = [1] * out.ndim
            index[axis] = out.shape[axis]
            beyond = np.arange(out.shape[axis]).reshape(index) >= np.expand_dims(
                per_row, [k for k in range(out.ndim) if k != row_axes[0]])
            out = np.where(beyond, np.asarray(pad, out.dtype), out)
    return leaf if out is None else out


class _NoBar:
    def advance(self):
        pass

    def close(self):
        pass


class _RichBar:
    def __init__(self, description: str, total: int):
        self._progress = Progress(transient=True)
        self._task = self._progress.add_task(description, total=total)
        self._progress.start()

    def advance(self):
        self._progress.advance(self._task)

    def close(self):
        self._progress.stop()


def _progress(enabled: bool, description: str, total: int):
    return _RichBar(description, total) if enabled else _NoBar()


def bucketed(fn: Callable | Plan, in_specs: Sequence[Any] | None = None, out_specs: Any = None,
             buckets: Mapping[LengthVar | str, Any] | None = None, **options) -> Bucketed:
    """Trace ``fn`` once over symbolic lengths; compile and run it per length bucket.

    Each call validates the arguments against ``in_specs`` (a Spec, or None for arguments that
    are not length-polymorphic such as a model: their arrays keep their own shapes, other leaves
    are static), binds every `LengthVar` from the input shapes, picks the smallest bucket that
    fits, pads the inputs (``Spec.pad``), runs that bucket's executable — compiled once from the
    one exported program, with no Python retrace — and cuts every output back to its exact-size
    shape (its symbolic shape at the real sizes; ``out_specs`` overrides per output; cut
    outputs are NumPy arrays). The program is rewritten once so every operation computes over
    the real lengths: padding never changes a result (see `Plan.padding_safe`).

    Spec names resolve against the LengthVars the call is given (in the Specs, as ``buckets``
    keys, in ``variables=``), else those visible where ``bucketed`` is called.

    Options: ``strict`` (raise `PolymorphismError` instead of falling back or warning),
    ``masking`` (default True: the logical-length rewrite; False runs the program over the
    padded sizes as written, for code that masks by itself), ``donate_argnums``,
    ``max_cached`` (executables kept, LRU), ``check_sizes`` (also run the two-size
    independence check: two extra Python traces), ``name``, ``variables``, ``partition``
    (default True: a function with data-dependent sizes, ``px.compact(..., length=K)``, is cut
    there and the rest runs at the bucket of ``K``; False: one program at the upper bound — see
    `Plan.segments`), ``in_shardings`` (one ``jax.sharding.Sharding`` or None per positional
    argument, for all its arrays: each bucket is compiled for them and host-padded inputs are
    placed by them — e.g. a model replicated and the batch split over a Mesh), ``layout``
    (``"pad"``, the default: one sequence per padded row; ``"pack"``: with a ``lengths_of``
    input, the sequences are laid end to end first-fit into rows of T's bucket for the
    longest, the rows bucketed by B's buckets or given per row length by ``pack_rows``, and a
    rewritten program keeps every sequence apart -- same results, fewer padded cells; a plan
    that cannot (`Plan.packing_reason` names the line) runs padded, with one warning;
    ``"auto"``: per call, the layout with fewer cells when the plan can pack, silently pad
    otherwise; a run that chooses by predicted time pins one with `Bucketed.with_layout`,
    as `polyexec.training.choose_layout` does). A `Plan` read by
    `Plan.load` runs through ``bucketed(plan)`` (`Bucketed.from_plan`).

    >>> import jax.numpy as jnp, numpy as np, polyexec as px
    >>> T = px.LengthVar("T", min=1, max=256)
    >>> B = px.LengthVar("B", max=8)
    >>> def mean_over_time(x, n):   # plain code: no mask, yet the padding never counts
    ...     return jnp.mean(x, axis=1) * n
    >>> f = px.bucketed(mean_over_time, in_specs=(px.Spec("B T", jnp.float32), None),
    ...                 out_specs=px.Spec("B"), buckets={T: [16, 64, 256]})
    >>> f(np.ones((2, 5), np.float32), 2.0).tolist()
    [2.0, 2.0]
    >>> f.stats.compiles, f.traces, f.plan.padding_safe
    (1, 1, True)
    """
    if isinstance(fn, Plan):
        return Bucketed.from_plan(fn, buckets=buckets, **options)
    if not callable(fn):
        raise OptionError(f"bucketed: fn: expected a callable or a px.Plan, received "
                          f"{type(fn).__name__} {fn!r}")
    if in_specs is None:
        raise SpecError("bucketed: in_specs: expected one Spec or None per positional argument, "
                        "received None")
    return Bucketed(fn, in_specs, out_specs, buckets, **options)

