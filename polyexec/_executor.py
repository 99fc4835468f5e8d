"""Stage 7, executor: `bucketed` caches plans and executables and runs them.

Per call: bind the arguments (validate, read the sizes), get the plan of the call's signature
(traced once, cached), let a layout (`_layouts`: pad or pack) place the call into a bucket, then
run the plan's segments in order -- each one's executable for that layout and bucket (compiled
once, single-flight, LRU: `_Executables`) -- and let the layout take the outputs back. Besides
that one run path, `Bucketed` keeps statistics (`_Counters`) and warm-up; its views
(`with_buckets`, `with_layout`) share what `_Shared` holds. Nothing here traces or rewrites a
program: that is `plan_function`'s job, and a plan never changes once made.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import copy
import dataclasses
import functools
import os
import threading
import time
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import numpy as np
from rich.progress import Progress

from . import _bind, _layouts
from ._cache import compiles_forbidden
from ._errors import (CompileError, LengthOverflowError, OptionError, PolyexecError,
                      PolymorphismError, SpecError, check_bool, check_int, check_option)
from ._plan import CutPoint, Plan, Segment
from ._planner import plan_function
from ._spec import LengthVar, Spec, bucket_sizes, call_variables
from ._trace import SHAPE_ERRORS, TraceCounter


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
        labels = {key: " ".join(f"{n}={s}" for n, s in key) or "(no lengths)"
                  for key in self.buckets}
        w = max([22, *(len(label) + 2 for label in labels.values())])
        rows = [f"{'bucket':<{w}}{'calls':>8}{'compiles':>10}{'compile s':>11}{'efficiency':>12}"]
        for key in sorted(self.buckets):
            b = self.buckets[key]
            rows.append(f"{labels[key]:<{w}}{b.calls:>8}{b.compiles:>10}"
                        f"{b.compile_seconds:>11.2f}{b.padding_efficiency:>12.3f}")
        rows.append(f"{'total':<{w}}{self.calls:>8}{self.compiles:>10}"
                    f"{self.compile_seconds:>11.2f}{self.padding_efficiency:>12.3f}"
                    f"   traces: {self.traces}")
        return "\n".join(rows)


@dataclasses.dataclass(frozen=True)
class _Compiled:
    executable: Any
    out_tree: Any            # per bucket: the slow path's program may differ in structure
    out_paths: tuple[str, ...]

    @functools.cached_property
    def spanning(self) -> tuple[tuple[int, Any], ...]:
        """(position, sharding) of the inputs split over other processes' devices too."""
        return tuple((i, s) for i, s in enumerate(self.executable.input_shardings[0])
                     if s is not None and not s.is_fully_addressable)

    def __call__(self, inputs: Sequence[Any]):
        """Run on ``inputs``; a host array whose sharding spans other processes' devices is
        made a global array from the slices this process's devices hold (a packed grid is
        built on every process, and each contributes its own rows)."""
        inputs = list(inputs)
        for i, sharding in self.spanning:
            if isinstance(inputs[i], (np.ndarray, np.generic)):
                host = np.asarray(inputs[i])
                inputs[i] = jax.make_array_from_callback(host.shape, sharding, host.__getitem__)
        return self.executable(*inputs)


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


class _Shared:
    """What every view of one bucketed function shares (`Bucketed.with_buckets`,
    `Bucketed.with_layout`): its plans (one per signature, made once), its executables
    (compiled once per segment, layout and bucket) and its stats. Plans and executables never
    change once made; the maps holding them are guarded, each by its own lock."""

    def __init__(self, max_cached: int):
        self.lock = threading.Lock()
        self.plans: dict[tuple[_bind.Signature, bool], concurrent.futures.Future] = {}
        self.executables = _Executables(max_cached)
        self.counters = _Counters()


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
        # (T's buckets), the rows bucketed by B's; "auto": per call, the fewer cells. The
        # option maps here, once, to the layouts calls may run in (`_LAYOUT_OPTIONS`).
        self.layout = check_option(layout, LAYOUTS, f"{where}: layout")
        self._layouts, self._by_cost = _LAYOUT_OPTIONS[self.layout]
        # Whether plans hold the packed program (kept by `with_layout("pad")` copies).
        self._with_packed = any(x.own_program for x in self._layouts)
        # Rows per row length for packed calls (a packed batch plan's shapes), so a partial
        # batch runs at its row length's full shape instead of compiling a smaller one.
        self.pack_rows = _layouts.PACK.check_rows(pack_rows, where)
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
        self._check_row_lengths(self.pack_rows, where)
        # Arguments every call starts with: a loaded plan's stored constants.
        self._prefix: tuple[Any, ...] = ()
        self._loaded: Plan | None = None

        self._shared = _Shared(check_int(max_cached, f"{where}: max_cached", min=1))
        self._lock = threading.Lock()       # this view's own state: _sizes, _warned
        self._latest_plan: Plan | None = None
        self._warned = False

    def _view(self, **changes) -> "Bucketed":
        """This function with other options (`with_buckets`, `with_layout`): a value of its
        own -- its lock, bucket sizes, latest plan and warning -- sharing with this one only
        the configuration it does not change, which nothing mutates, and `_Shared`."""
        other = copy.copy(self)
        other._lock = threading.Lock()
        other._sizes = dict(self._sizes)
        for name, value in changes.items():
            setattr(other, name, value)
        return other

    @property
    def _counters(self) -> "_Counters":
        return self._shared.counters

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

    def call_at_least(self, buckets: Mapping[str, int], *args):
        """``self(*args)`` run padded at buckets no smaller than ``buckets`` (each one of the
        variable's bucket sizes; a packing call chooses its own rows). A partial batch's real
        rows run at the full batch's compiled shape this way -- no new compile -- and the
        padded rows of ``B`` are no rows: a mean over the rows counts the real ones only,
        where zero-length filler rows would have been counted (`polyexec.training` does this).
        With ``masking=False`` the rows a ``lengths_of`` input indexes are never padded: they
        run at their own number (see `bucketed`).

        >>> import jax.numpy as jnp, numpy as np, polyexec as px
        >>> B, T = px.LengthVar("B", max=8), px.LengthVar("T", max=16)
        >>> f = px.bucketed(lambda x: jnp.mean(jnp.sum(x, 1)), in_specs=(px.Spec("B T", jnp.float32),),
        ...                 buckets={B: [2, 8], T: [16]})
        >>> float(f.call_at_least({"B": 8}, np.ones((2, 3), np.float32))), sorted(f.stats.buckets)
        (3.0, [(('B', 8), ('T', 16))])
        """
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
        raised = plan.raised_mins.get(name) if plan is not None else None
        if raised is not None:   # the program was traced from there up (JAX's rule needs it)
            sizes = tuple(s for s in sizes if s >= raised.min) or (self.variables[name].max,)
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
        # Under layout="pack", packed grids (`_layouts._Pack.warmup_buckets`); chosen per call
        # by cost, the padded buckets.
        layout = self._runs_in(plan) or _layouts.PAD
        jobs = [(seg, layout, bucket) for seg, bucket
                in layout.warmup_buckets(plan, sizes, self, list(self._input_names))]
        self._compile_all([functools.partial(self._executable, plan, seg, layout, bucket)
                           for seg, layout, bucket in jobs], max_workers, progress)
        return [bucket for _, _, bucket in jobs]

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
        view = self._view(_policies=policies, _sizes=sizes)
        view._check_row_lengths(view.pack_rows, f"{self.name}.with_buckets")
        return view

    def _check_row_lengths(self, pack_rows: Mapping[int, int], where: str) -> None:
        """Every ``pack_rows`` key a row length: a bucket of a ragged length variable (one a
        ``lengths_of`` input names; without one, of any). Another key was silently never used
        (``pack_rows={7: 2}`` with row lengths 16 and 64)."""
        if not pack_rows:
            return
        ragged = {leaf.lengths_of for leaf in jax.tree_util.tree_leaves(
            self.in_specs, is_leaf=lambda x: isinstance(x, Spec)) if isinstance(leaf, Spec)
            and leaf.lengths_of is not None}
        names = [n for n in self._sizes if n in ragged] or list(self._sizes)
        lengths = sorted({s for n in names for s in self._sizes[n]})
        wrong = [k for k in pack_rows if k not in lengths]
        if wrong:
            raise OptionError(f"{where}: pack_rows: expected keys that are row lengths (the "
                              f"buckets of {', '.join(names)}: {lengths}), received "
                              f"{', '.join(map(str, wrong))}, which no row has")

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
        layout = check_option(layout, LAYOUTS, f"{where}: layout")
        layouts, by_cost = _LAYOUT_OPTIONS[layout]
        view = self._view(layout=layout, _layouts=layouts, _by_cost=by_cost,
                          _with_packed=self._with_packed or any(x.own_program for x in layouts),
                          pack_rows=_layouts.PACK.check_rows(pack_rows, where)
                          if pack_rows is not None else self.pack_rows)
        view._check_row_lengths(view.pack_rows, where)
        return view

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
        shared = self._shared
        with shared.lock:
            future = shared.plans.get(key)
            owner = future is None
            if owner:
                future = shared.plans[key] = concurrent.futures.Future()
        if owner:
            try:
                plan = self._make_plan(signature)
            except BaseException as e:
                with shared.lock:
                    del shared.plans[key]
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
        for path, (shape, dtype), key, want in zip(signature.leaf_paths("array"),
                                                   signature.array_avals, signature.array_keys,
                                                   expected):
            if (tuple(shape), np.dtype(dtype)) != (tuple(want[0]), np.dtype(want[1])):
                data = "" if key is None else f" (the data of a typed PRNG key, impl {key})"
                raise SpecError(f"{path}: expected {np.dtype(want[1]).name}{list(want[0])}, "
                                f"received {np.dtype(dtype).name}{list(shape)}{data}")
        return self._loaded

    def _verdict(self, plan: Plan) -> None:
        """Never silent: a plan that cannot guarantee a result warns once, or raises (strict)."""
        # A layout the option pins (layout="pack") that cannot run the plan: it runs padded.
        unable = None if self._by_cost else self._layouts[0].unable(plan)
        if unable is not None and not plan.reshaping_is_impossible and plan.padding_safe:
            message = self._layouts[0].fallback_message(self.name, unable)
            reason = unable
        elif plan.reshaping_is_impossible:
            # The retraced program sees concrete sizes, so nothing can tell its length axes
            # from others: it runs on the padded arrays as written, unchecked.
            unchecked = (", and nothing checks that padding leaves its result unchanged (each "
                         "bucket runs it on the padded arrays as written)" if self.masking else "")
            # Nor can its outputs' length axes be told apart: without out_specs they keep the
            # bucket's sizes (see `_layouts._Padded.unplace`).
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
        """One call, whatever its layout: placed into a bucket (`_place`), then each segment's
        executable at that bucket, in order; between two segments the count of the
        data-dependent size is read on the host and the handed values cut to its bucket.
        The layout takes the outputs back (`Placed.unplace`)."""
        _bind.check_raised_mins(call, plan.raised_mins)
        _bind.check_row_floors(call, plan.row_floors)
        placed = self._place(plan, call, least or {})
        handed: list[Any] = []
        for segment in plan.segments:
            compiled = self._executable(plan, segment, placed.layout, placed.bucket)
            outputs = compiled(placed.inputs(segment, handed))
            if segment.callbacks is not None:     # jax.debug.print's values, on the host
                outputs = segment.callbacks.run(outputs)
            self._counters.add(placed.layout.stats_key(segment, placed.bucket), calls=1,
                               real_elements=placed.real, padded_elements=placed.padded)
            if segment.cut is None:
                break
            # A segment reads the values of every cut before it.
            new, placed.real, placed.padded = self._hand_over(plan, segment.cut, outputs,
                                                              placed.sizes, placed.bucket)
            handed = handed + new
        return placed.unplace(segment, compiled.out_tree, outputs, self.out_specs)

    def _runs_in(self, plan: Plan) -> _layouts.Layout | None:
        """The layout every call of ``plan`` runs in: the first of the option's layouts that
        runs it (the last, pad, runs every plan); None where the option chooses per call by
        cost between several that run it (``auto``, `_place`)."""
        able = [layout for layout in self._layouts if layout.runs(plan)]
        return None if self._by_cost and len(able) > 1 else able[0]

    def _place(self, plan: Plan, call: _bind.BoundCall, least: Mapping[str, int]
               ) -> _layouts.Placed:
        """The layout this call runs in, and the call placed by it. ``pack`` when the plan can;
        ``auto``: the layout with fewer cells (a step's cost is per cell), equal cells staying
        padded, one sequence a row. A call pinned at a least bucket (`call_at_least`) of a
        packing function packs as usual: its rows are its own."""
        layout = self._runs_in(plan)
        if layout is None:       # chosen by cost: packed only when it has fewer cells
            packed = _layouts.PACK.place(plan, call, self, least)
            if packed.cells < packed.padded_cells(plan, self):
                return packed
            layout = _layouts.PAD
        return layout.place(plan, call, self, least)

    def packing_of(self, lengths: Any, *args) -> tuple[np.ndarray, int]:
        """``(row of each sequence, rows)`` of the packed grid a call with these ``lengths``
        (of its ``lengths_of`` input) runs in; ``args``, the arguments without a Spec. Known
        from the lengths alone: across processes, each one loads the sequences of its own rows
        only (`polyexec.training`), and the executor assembles the grid from every process's
        rows.

        >>> import jax.numpy as jnp, numpy as np, polyexec as px
        >>> T, B = px.LengthVar("T", max=8), px.LengthVar("B", max=8)
        >>> f = px.bucketed(lambda x, n: jnp.sum(x), layout="pack", buckets={T: [8]},
        ...                 in_specs=(px.Spec("B T", jnp.float32),
        ...                           px.Spec("B", jnp.int32, lengths_of=T)))
        >>> row, rows = f.packing_of([5, 3, 6, 2])
        >>> row.tolist(), rows
        ([1, 1, 0, 0], 2)
        """
        plan = self.plan_for(*args)
        return _layouts.PACK.packing_of(plan, lengths, self, self._runs_in(plan))

    def exported_program(self, plan: Plan | None = None) -> Any:
        """The `jax.export.Exported` the calls of ``plan`` (default: `plan`, the latest call's)
        run: the packed rewrite where they run packed rows (``layout="pack"``), else the
        padded program -- ``layout="auto"``'s too, which packs call by call; None where
        reshaping is impossible (each bucket is retraced). Costs are recorded by it
        (`polyexec.training.measure_cost`).

        >>> import jax.numpy as jnp, numpy as np, polyexec as px
        >>> T = px.LengthVar("T", max=16)
        >>> f = px.bucketed(lambda x: x * 2, in_specs=(px.Spec("T", jnp.float32),), buckets={T: [16]})
        >>> type(f.exported_program()).__name__
        'Exported'
        """
        plan = self.plan if plan is None else plan
        return (self._runs_in(plan) or _layouts.PAD).exported(plan)

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

    # -- compiling ------------------------------------------------------------------------------

    def _executable(self, plan: Plan, segment: Segment, layout: _layouts.Layout,
                    bucket: Mapping[str, int]) -> _Compiled:
        """The compiled program of one segment in one layout at one bucket (counted in the
        stats when this call compiled it)."""
        key = layout.stats_key(segment, bucket)
        return self._cached((id(segment), layout.name, key), key, layout.describe(bucket),
                            lambda: self._compile(plan, segment, layout, bucket))

    def _cached(self, cache_key: tuple, stats_key: tuple, what: str,
                compile: Callable[[], _Compiled]) -> _Compiled:
        """An executable compiled once (refused under `forbid_compiles`), its compile counted
        in the stats under ``stats_key`` by the call that made it."""
        def refuse():
            if compiles_forbidden():
                raise CompileError(f"{self.name}: {what} is not compiled and compiles are "
                                   f"forbidden here")

        compiled, seconds = self._shared.executables.get(cache_key, compile, refuse)
        if seconds is not None:
            self._counters.add(stats_key, compiles=1, compile_seconds=seconds)
        return compiled

    def _compile(self, plan: Plan, segment: Segment, layout: _layouts.Layout,
                 bucket: Mapping[str, int]) -> _Compiled:
        program, avals, n, cell = layout.program(plan, segment, bucket, self._counters.traces)
        # The convention's inputs carry the call's shardings; a layout's own inputs (a packed
        # grid's per-cell positions) follow, split over the devices as the rows they describe.
        avals = (segment.convention.with_shardings(avals[:n], self.in_shardings)
                 + layout.with_shardings(segment, avals[n:], self.in_shardings))
        donate = (segment.convention.donated(self.donate_argnums) if segment.can_donate
                  else ())
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


Layout = Literal["pad", "pack", "auto"]
LAYOUTS: tuple[str, ...] = typing.get_args(Layout)
# The one place a ``layout`` option is read by its value: the layouts its calls may run in,
# preferred first (the last, pad, runs every plan), and whether each call chooses between
# those that run its plan by cost (its cells) rather than running the first.
_LAYOUT_OPTIONS: dict[str, tuple[tuple[_layouts.Layout, ...], bool]] = {
    "pad": ((_layouts.PAD,), False),
    "pack": ((_layouts.PACK, _layouts.PAD), False),
    "auto": ((_layouts.PACK, _layouts.PAD), True),
}


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
    padded sizes as written, for code that masks by itself -- except the rows a ``lengths_of``
    input indexes (``B``), which run at the call's own number: a filler row of length 0 is
    one such code would count as an example), ``donate_argnums``,
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

