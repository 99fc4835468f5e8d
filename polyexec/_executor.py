"""`bucketed`: validate, pick a bucket, pad, run the bucket's compiled program, slice back."""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import dataclasses
import itertools
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from . import _layout, _partition
from ._compile import compiles_forbidden
from ._errors import CompileError, PolymorphismError, SpecError
from ._plan import Plan, _TraceCounter, check_size_independence, flat_program, input_avals, trace_symbolic
from ._vars import LengthVar, Spec, bucket_sizes, resolve_vars


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


def _spec_leaves(tree: Any) -> list[Spec]:
    return [s for s in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Spec))
            if isinstance(s, Spec)]


class Bucketed:
    """A function compiled once per length bucket from one symbolic trace; see `bucketed`."""

    def __init__(self, fn: Callable, in_specs: Sequence[Any], out_specs: Any = None,
                 buckets: Mapping[LengthVar | str, Any] | None = None, *, strict: bool = False,
                 donate_argnums: Sequence[int] = (), max_cached: int = 64,
                 check_sizes: bool = False, name: str | None = None,
                 in_shardings: Sequence[Any] | None = None, partition: bool = True):
        if not isinstance(in_specs, (tuple, list)):
            raise SpecError(f"bucketed: in_specs must be a tuple with one entry per positional "
                            f"argument (a Spec, None, or a pytree of them), got {in_specs!r}")
        if max_cached < 1:
            raise ValueError(f"bucketed: max_cached must be >= 1, got {max_cached}")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self.in_specs = tuple(in_specs)
        self.out_specs = out_specs
        self.strict = strict
        self.donate_argnums = tuple(donate_argnums)
        self.max_cached = max_cached
        self.check_sizes = check_sizes
        if not isinstance(partition, bool):
            raise SpecError(f"bucketed: partition must be True or False, received {partition!r}")
        # Data-dependent sizes (px.compact(..., length=K)): cut the program there and re-bucket
        # what follows (True), or run it all as one program at the upper bound (False).
        self.partition = partition
        # One jax.sharding.Sharding (or None) per positional argument, applied to every array
        # leaf of it; the executables are compiled for them (data parallel: batch inputs
        # sharded over a Mesh, parameters replicated) and host-padded inputs are placed by them.
        if in_shardings is not None and len(in_shardings) != len(self.in_specs):
            raise SpecError(f"bucketed: in_shardings needs one entry per positional argument "
                            f"({len(self.in_specs)}), received {len(in_shardings)}")
        self.in_shardings = None if in_shardings is None else tuple(in_shardings)

        buckets = dict(buckets or {})
        explicit = {k.name: k for k in buckets if isinstance(k, LengthVar)}
        # Input variables are bound by input shapes; the others (named by out_specs, or by a
        # LengthVar key of `buckets`) are data-dependent sizes that a partition point defines.
        self._input_names = list(dict.fromkeys(
            [n for s in _spec_leaves(self.in_specs) for n in s.var_names]
            + [s.lengths_of for s in _spec_leaves(self.in_specs) if s.lengths_of]))
        names = list(dict.fromkeys(
            self._input_names + [n for s in _spec_leaves(out_specs) for n in s.var_names]
            + list(explicit)))
        self.variables = resolve_vars(names, explicit)
        policies = {}
        for key, policy in buckets.items():
            name = key.name if isinstance(key, LengthVar) else key
            if name not in self.variables:
                raise SpecError(f"bucketed({self.name}): buckets names {name!r}, which no Spec uses; "
                                f"valid: {', '.join(self.variables) or 'none'}")
            policies[name] = policy
        self._policies = policies
        self.bucket_sizes = {n: bucket_sizes(v, policies.get(n)) for n, v in self.variables.items()}

        self._lock = threading.Lock()
        self._counter = _TraceCounter()
        self._plans: dict[_layout.Signature, concurrent.futures.Future] = {}
        self._executables: collections.OrderedDict = collections.OrderedDict()
        self._stats: dict[tuple, BucketStats] = {}
        self._latest_plan: Plan | None = None
        self._warned = False

    # -- public -------------------------------------------------------------------------------

    def __call__(self, *args):
        call = _layout.bind(args, self.in_specs, self.variables)
        bucket = {n: self._bucket_for(n, s) for n, s in call.sizes.items()}
        plan = self._plan(call.signature)
        if isinstance(plan, _partition.PartitionedPlan):
            return _partition.run(self, plan, call, bucket)
        executable = self._executable(plan, call, bucket)
        flat, real, padded = _layout.pad_inputs(call, bucket)
        flat += [np.int32(call.sizes[v.name]) for v in plan.variables]
        out_leaves = executable(*flat)
        self._record(self._key(plan, bucket), calls=1, real_elements=real, padded_elements=padded)
        return self._unflatten(plan, out_leaves, call.sizes)

    @property
    def plan(self) -> Plan:
        """The plan of the latest call (tracing it now when no argument lacks a Spec)."""
        if self._latest_plan is None:
            if any(s is None for s in self.in_specs) or not all(isinstance(s, Spec) for s in self.in_specs):
                raise SpecError(f"{self.name}.plan: call the function or warmup(...) first — "
                                f"arguments without a Spec decide the plan")
            self._plan(self._example_call(()).signature)
        return self._latest_plan

    @property
    def stats(self) -> Stats:
        with self._lock:
            return Stats(self._counter.count, dict(self._stats))

    @property
    def traces(self) -> int:
        """How many times Python ran the user function (tracing)."""
        return self._counter.count

    def warmup(self, *args, sizes: Sequence[Mapping[str, int]] | None = None,
               max_workers: int | None = None, progress: bool = False) -> list[dict[str, int]]:
        """Compile buckets ahead of time on parallel threads; return the buckets compiled.

        ``args`` are the arguments without a Spec (e.g. the model), in order — or a full
        example call. ``sizes`` lists buckets as ``{name: size}`` dicts (default: every
        combination of every variable's bucket sizes).
        """
        call = self._example_call(args)
        plan = self._plan(call.signature)
        if sizes is None:
            names = list(self._input_names)
            combos = [dict(zip(names, c))
                      for c in itertools.product(*(self.bucket_sizes[n] for n in names))]
        else:
            combos = [{n: self._bucket_for(n, int(s)) for n, s in d.items()} for d in sizes]
        # A partitioned plan compiles each segment, later ones also per data-dependent bucket.
        jobs = (_partition.warmup_jobs(self, plan, combos)
                if isinstance(plan, _partition.PartitionedPlan) else [(plan, c) for c in combos])
        combos = [combo for _, combo in jobs]
        workers = max_workers or min(len(combos), os.cpu_count() or 1) or 1
        bar = _progress(progress, f"compiling {self.name}", len(combos))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = [pool.submit(self._executable, p, call, combo) for p, combo in jobs]
            for future in concurrent.futures.as_completed(futures):
                future.result()
                bar.advance()
        bar.close()
        return combos

    # -- internals ----------------------------------------------------------------------------

    def _bucket_for(self, name: str, size: int) -> int:
        sizes = self.bucket_sizes[name]
        i = bisect.bisect_left(sizes, size)
        if i == len(sizes):
            raise SpecError(f"{name}={size} is above the largest bucket {sizes[-1]}")
        return sizes[i]

    def _example_call(self, args: Sequence[Any]) -> _layout.BoundCall:
        """Bind either a full example call or only the non-Spec arguments, with dummy
        (all-pad, smallest-size) arrays standing in for the Spec arguments."""
        if len(args) == len(self.in_specs):
            return _layout.bind(args, self.in_specs, self.variables)
        fixed = [i for i, s in enumerate(self.in_specs) if s is None]
        if len(args) != len(fixed):
            raise SpecError(f"{self.name}.warmup: pass the {len(fixed)} argument(s) without a Spec "
                            f"(in_specs positions {fixed}) or a full example call of "
                            f"{len(self.in_specs)} arguments; received {len(args)}")
        given = iter(args)
        full = []
        for i, spec in enumerate(self.in_specs):
            if spec is None:
                full.append(next(given))
            elif isinstance(spec, Spec):
                if spec.dtype is None:
                    raise SpecError(f"{self.name}.warmup: in_specs[{i}] = {spec} has no dtype; give "
                                    f"it one or pass a full example call")
                shape = tuple(self.variables[d].min if isinstance(d, str) else d for d in spec.dims)
                full.append(np.zeros(shape, spec.dtype))
            else:
                raise SpecError(f"{self.name}.warmup: in_specs[{i}] is a pytree of Specs; pass a "
                                f"full example call")
        return _layout.bind(full, self.in_specs, self.variables)

    def _plan(self, signature: _layout.Signature) -> Plan:
        with self._lock:
            future = self._plans.get(signature)
            owner = future is None
            if owner:
                future = self._plans[signature] = concurrent.futures.Future()
        if owner:
            try:
                plan = self._trace(signature)
            except BaseException as e:
                with self._lock:
                    del self._plans[signature]
                future.set_exception(e)
                raise
            future.set_result(plan)
        plan = future.result()
        self._latest_plan = plan
        if plan.reshaping_is_impossible:
            if self.strict:
                raise PolymorphismError(plan.reason)
            if not self._warned:
                self._warned = True
                warnings.warn(f"{self.name} is not shape-polymorphic, so it is retraced and "
                              f"compiled per bucket: {plan.reason}", stacklevel=3)
        return plan

    def _trace(self, signature: _layout.Signature) -> Plan:
        # A plain Plan, or a PartitionedPlan when the function defines data-dependent sizes.
        plan = _partition.trace(self, signature)
        if self.check_sizes and not isinstance(plan, _partition.PartitionedPlan):
            plan = check_size_independence(plan, self.fn, self._counter, self.bucket_sizes)
        return plan

    def _key(self, plan: Plan, bucket: Mapping[str, int]) -> tuple:
        return tuple((v.name, bucket[v.name]) for v in plan.variables)

    def _executable(self, plan: Plan, call: _layout.BoundCall, bucket: Mapping[str, int]):
        key = (id(plan), self._key(plan, bucket))
        with self._lock:
            future = self._executables.get(key)
            owner = future is None
            if owner:
                if compiles_forbidden():
                    raise CompileError(f"{self.name}: bucket {dict(bucket)} is not compiled and "
                                       f"compiles are forbidden here")
                future = self._executables[key] = concurrent.futures.Future()
                self._evict()
            else:
                self._executables.move_to_end(key)
        if owner:
            try:
                start = time.perf_counter()
                executable = self._compile(plan, call, bucket)
                seconds = time.perf_counter() - start
            except BaseException as e:
                with self._lock:
                    self._executables.pop(key, None)
                future.set_exception(e)
                raise
            future.set_result(executable)
            self._record(key[1], compiles=1, compile_seconds=seconds)
        return future.result()

    def _evict(self) -> None:
        while len(self._executables) > self.max_cached:
            oldest = next(iter(self._executables))
            if not self._executables[oldest].done():
                break
            self._executables.pop(oldest)

    def _compile(self, plan: Plan, call: _layout.BoundCall, bucket: Mapping[str, int]):
        avals = plan.bucket_avals(bucket)
        if self.in_shardings is not None:
            avals = [aval if arg >= len(self.in_shardings) or self.in_shardings[arg] is None else
                     jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=self.in_shardings[arg])
                     for aval, arg in zip(avals, call.arg_index)] + avals[len(call.arg_index):]
        donate = tuple(i for i, arg in enumerate(call.arg_index[:len(call.arrays)])
                       if arg in self.donate_argnums and plan.can_donate)
        if plan.exported is not None:
            program = plan.exported.call
        else:  # the slow path: Python runs again for this bucket, with max_length answered
            cell: list = []
            program = flat_program(self.fn, plan.signature, [v.name for v in plan.variables],
                                   dict(bucket), self._counter, cell)
        lowered = jax.jit(program, donate_argnums=donate).lower(*avals)
        if plan.exported is None:
            plan.out_tree, plan.out_paths = cell
        return lowered.compile()

    def _record(self, key: tuple, **increments) -> None:
        with self._lock:
            current = self._stats.get(key) or BucketStats(key)
            self._stats[key] = dataclasses.replace(
                current, **{k: getattr(current, k) + v for k, v in increments.items()})

    def _unflatten(self, plan: Plan, leaves: Sequence[Any], sizes: Mapping[str, int]):
        if self.out_specs is not None:
            specs = _layout.spec_per_leaf(self.out_specs, jax.tree_util.tree_unflatten(
                plan.out_tree, list(range(len(leaves)))), "out_specs")
            leaves = [leaf if spec is _layout.FIXED else _layout.unpad(leaf, spec, sizes)
                      for leaf, spec in zip(leaves, specs)]
        return jax.tree_util.tree_unflatten(plan.out_tree, list(leaves))


class _NoBar:
    def advance(self):
        pass

    def close(self):
        pass


class _RichBar:
    def __init__(self, description: str, total: int):
        from rich.progress import Progress
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
    one exported program, with no Python retrace — and slices outputs with a Spec back to the
    real sizes (as NumPy arrays).

    Options: ``strict`` (raise `PolymorphismError` instead of falling back), ``donate_argnums``,
    ``max_cached`` (executables kept, LRU), ``check_sizes`` (also run the two-size
    independence check: two extra Python traces), ``name``, ``partition`` (default True: a
    function with data-dependent sizes, ``px.compact(..., length=K)``, is cut there and the
    rest runs at the bucket of ``K``; False: one program at the upper bound — see
    `PartitionedPlan`), ``in_shardings`` (one ``jax.sharding.Sharding`` or None per positional
    argument, for all its arrays: each bucket is compiled for them and host-padded inputs are
    placed by them — e.g. a model replicated and the batch split over a Mesh; values handed
    between the segments of a partitioned program are placed by XLA).

    >>> import jax.numpy as jnp, numpy as np, polyexec as px
    >>> T = px.LengthVar("T", min=1, max=256)
    >>> def total(x, n):   # x: (B, T) padded with 0
    ...     return jnp.sum(x, axis=1) * n
    >>> B = px.LengthVar("B", max=8)
    >>> f = px.bucketed(total, in_specs=(px.Spec("B T", jnp.float32), None),
    ...                 out_specs=px.Spec("B"), buckets={T: [16, 64, 256]})
    >>> f(np.ones((2, 5), np.float32), 2.0).tolist()
    [10.0, 10.0]
    >>> f.stats.compiles, f.traces
    (1, 1)
    """
    if isinstance(fn, Plan):
        from ._serialize import bucketed_plan
        return bucketed_plan(fn, buckets=buckets, **options)
    if in_specs is None:
        raise SpecError("bucketed: in_specs is required (one Spec or None per positional argument)")
    return Bucketed(fn, in_specs, out_specs, buckets, **options)
