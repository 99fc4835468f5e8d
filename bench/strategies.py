"""The strategies compared, their batch schedules, and the worker that measures one of them.

A strategy decides two things: how examples are grouped into batches (random batches, or
length-grouped batches from `buckets.batch_plan`), and which padded shape each batch runs at
(the cap, the batch's exact maximum, a bucket). Every strategy runs every example once per
epoch; only the grouping differs.

>>> [s.name for s in parse_strategies("pad-max,fixed:16,64,1024,polyexec")]
['pad-max', 'fixed:16,64,1024', 'polyexec']
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys
import threading
import time
import typing
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import buckets
import polyexec as px
from .workloads import MIN_T, Config, Data, Step, build_step, load_data

StrategyKind = Literal["pad-max", "exact", "pow2", "fixed", "polyexec", "polyexec-cached",
                       "polyexec-nomask"]
KINDS: tuple[str, ...] = typing.get_args(StrategyKind)
DEFAULT_STRATEGIES = "pad-max,exact,pow2,polyexec,polyexec-cached"

EVENT_PREFIX = "@@bench "


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One strategy; ``sizes`` only for ``fixed``."""

    kind: str
    sizes: tuple[int, ...] | None = None

    @property
    def name(self) -> str:
        return f"fixed:{','.join(map(str, self.sizes))}" if self.kind == "fixed" else self.kind

    @property
    def grouped(self) -> bool:
        """Length-grouped batches (the same examples per epoch, grouped by bucket)."""
        return self.kind in ("polyexec", "polyexec-cached", "polyexec-nomask")

    @property
    def masking(self) -> bool:
        """The executor's logical-length rewrite: off for ``polyexec-nomask``, which is there to
        measure what the rewrite costs, side by side with ``polyexec``."""
        return self.kind != "polyexec-nomask"

    @property
    def cache_folder(self) -> str | None:
        """The persistent compile cache a grouped strategy runs on (a folder of the run's
        temporary directory). ``polyexec-cached`` reads the one ``polyexec`` fills;
        ``polyexec-nomask`` compiles other programs and gets its own, so it finds nothing of
        ``polyexec``'s and its compile counts compare."""
        if not self.grouped:
            return None
        return "xla-cache-nomask" if not self.masking else "xla-cache"

    @property
    def batching(self) -> str:
        return "grouped" if self.grouped else "random"


def parse_strategies(text: str) -> list[Strategy]:
    """``"pad-max,exact,fixed:16,32,64,polyexec"``: bare integers after ``fixed:`` are its sizes.

    >>> parse_strategies("fixed:8,32")[0].sizes
    (8, 32)
    """
    out: list[Strategy] = []
    fixed: list[int] | None = None

    def close_fixed():
        nonlocal fixed
        if fixed is not None:
            if not fixed:
                raise px.OptionError("--strategies: 'fixed:' expected sizes, e.g. "
                                  "fixed:16,64,256,1024, received none")
            out.append(Strategy("fixed", tuple(sorted(set(fixed)))))
            fixed = None

    for raw in text.split(","):
        token = raw.strip()
        if not token:
            raise px.OptionError(f"--strategies: expected a strategy between every two commas, "
                              f"received an empty entry in {text!r}")
        if token.isdigit() and fixed is not None:
            fixed.append(int(token))
            continue
        close_fixed()
        if token.startswith("fixed:"):
            first = token[len("fixed:"):].strip()
            if not first.isdigit():
                raise px.OptionError(f"--strategies: fixed sizes: expected integers (e.g. "
                                  f"fixed:16,64,256,1024), received {first!r} in {token!r}")
            fixed = [int(first)]
        elif token in KINDS and token != "fixed":
            out.append(Strategy(token))
        else:
            raise px.OptionError(f"--strategies: expected one of "
                              f"{', '.join(k if k != 'fixed' else 'fixed:S1,S2,...' for k in KINDS)}; "
                              f"received unknown strategy {token!r}")
    close_fixed()
    names = [s.name for s in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise px.OptionError(f"--strategies: expected each strategy once, received "
                          f"{', '.join(sorted(dup))} given twice")
    if any(s.kind == "fixed" and min(s.sizes) < MIN_T for s in out):
        raise px.OptionError(f"--strategies: fixed sizes: expected sizes >= {MIN_T} (the loss needs "
                          f"T >= 2), received {', '.join(s.name for s in out if s.kind == 'fixed')}")
    if "polyexec-cached" in names and "polyexec" not in names:
        raise px.OptionError("--strategies: expected polyexec beside polyexec-cached (which reuses "
                          "the compile cache polyexec fills; list polyexec too), received "
                          "polyexec-cached alone")
    # polyexec-cached must run after polyexec (it reads the cache polyexec writes).
    out.sort(key=lambda s: s.kind == "polyexec-cached")
    return out


# ------------------------------------------------------------------------------- policies


def t_policy(strategy: Strategy, cfg: Config, data: Data) -> buckets.BucketPolicy | None:
    """The bucket policy of the time axis (None for ``exact``: no buckets)."""
    if strategy.kind == "pad-max":
        return buckets.Fixed([cfg.cap])
    if strategy.kind == "pow2":
        # Powers of two from 2, with the cap itself as the largest bucket.
        return buckets.Geometric(MIN_T, cfg.cap)
    if strategy.kind == "fixed":
        if max(strategy.sizes) < cfg.cap:
            raise px.OptionError(f"--strategies {strategy.name}: expected a largest size >= the cap "
                              f"{cfg.cap}, received largest size {max(strategy.sizes)} (add a "
                              f"size >= {cfg.cap})")
        return buckets.Fixed(strategy.sizes)
    if strategy.grouped and cfg.buckets != "auto":   # auto: chosen in the worker (choose_auto)
        return buckets.Optimal.fit(data.padded_lengths, max_buckets=cfg.buckets)
    return None


def choose_auto(cfg: Config, data: Data, step: Step, f, path: str):
    """``--buckets auto``: compile and time ``f`` once at the largest length's full batch,
    then `buckets.Auto.fit` for ``cfg.epochs`` epochs; returns (policy, f at its shapes, the
    rows it uses, and the choice as a dict: measured cost, prediction).

    The first grouped worker of a run writes its choice to ``path`` and the later ones reuse
    it, so they compare on the same buckets: ``polyexec-cached`` (the same job run again --
    timed on a cache hit, a compile would look nearly free) and ``polyexec-nomask``.
    """
    from polyexec.training import measure_cost
    lengths = data.padded_lengths
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            saved = json.load(fh)
        policy = buckets.Auto(tuple(saved["sizes"]), tuple(saved["partial_rows"]))
        saved["reused"] = True
    else:
        top = int(lengths.max())
        rows = cfg.batch_size or buckets.batch_size_for(top, cfg.max_tokens)
        probe = np.resize(np.flatnonzero(lengths == top), rows)
        tokens, _ = padded_batch(data, probe, rows, top)
        # In the background the other compiles overlap training: on 2 cores their wall cost
        # was 1/2-2/3 of their compile seconds. Parallel threads (--warmup blocking) gained
        # nothing there: fit's 18 compiles took 23.6 s wall on 2 threads, ~24.5 s at the
        # rate of one compile alone.
        overlap = 2 if cfg.warmup == "background" and (os.cpu_count() or 1) >= 2 else 1
        cost = measure_cost(f, step.state, tokens, np.full(rows, top, np.int32), parallel=overlap)
        policy = buckets.Auto.fit(lengths, cost, epochs=cfg.epochs, batch_size=cfg.batch_size,
                                  max_tokens=cfg.max_tokens, compiled=[(rows, top)])
        saved = {"sizes": list(policy.sizes), "partial_rows": list(policy.partial_rows),
                 "cost": dataclasses.asdict(cost), "predicted": policy.prediction._asdict(),
                 "predicted_padding_efficiency": policy.prediction.padding_efficiency}
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(saved, fh)
    plan = buckets.batch_plan(lengths, policy, batch_size=cfg.batch_size,
                              max_tokens=cfg.max_tokens, shuffle=False)
    rows_used = sorted({b.rows for b in plan})
    return policy, f.with_buckets({"T": list(policy.sizes), "B": rows_used}), rows_used, saved


def b_sizes(strategy: Strategy, cfg: Config) -> list[int]:
    """Row buckets: the batch size itself; under a token budget, ``max_tokens // cap`` for
    pad-max (its batches are always that many rows, one shape) and powers of two for the rest
    (grouped batches use ``buckets.batch_size_for(bucket, max_tokens)``, a power of two)."""
    if cfg.batch_size is not None:
        return [cfg.batch_size]
    if strategy.kind == "pad-max":
        return [cfg.max_tokens // cfg.cap]
    top = buckets.batch_size_for(MIN_T, cfg.max_tokens)
    return list(buckets.Geometric(1, top).sizes) if top > 1 else [1]


def _bucket(sizes, n: int) -> int:
    i = int(np.searchsorted(np.asarray(sizes), n, side="left"))
    return int(sizes[i])


# ------------------------------------------------------------------------------- schedules


def random_batches(cfg: Config, data: Data, epoch: int, padded_len) -> list[np.ndarray]:
    """One epoch of shuffled batches (the same shuffle for every random-batch strategy).

    With ``max_tokens`` a batch grows in shuffled order while rows x padded length (as the
    strategy pads: ``padded_len(max length)``) stays within the budget.
    """
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 1000 + epoch]))
    order = rng.permutation(data.lengths.size)
    if cfg.batch_size is not None:
        return [order[i:i + cfg.batch_size] for i in range(0, order.size, cfg.batch_size)]
    out, current, longest = [], [], 0
    lengths = data.padded_lengths
    for i in order:
        longer = max(longest, int(lengths[i]))
        if current and (len(current) + 1) * padded_len(longer) > cfg.max_tokens:
            out.append(np.asarray(current))
            current, longer = [], int(lengths[i])
        current.append(i)
        longest = longer
    out.append(np.asarray(current))
    return out


def schedule(strategy: Strategy, cfg: Config, data: Data, policy) -> list[list[np.ndarray]]:
    """Every epoch's batches (example indices) for ``strategy``."""
    epochs = []
    for epoch in range(cfg.epochs):
        if strategy.grouped:
            plan = buckets.batch_plan(data.padded_lengths, policy, batch_size=cfg.batch_size,
                                      max_tokens=cfg.max_tokens, seed=cfg.seed, epoch=epoch)
            epochs.append([b.indices for b in plan])
        else:
            pad = (lambda n: n) if policy is None else (lambda n: _bucket(policy.sizes, n))
            epochs.append(random_batches(cfg, data, epoch, pad))
    return epochs


def padded_shape(strategy: Strategy, cfg: Config, policy, rows: int, longest: int) -> tuple[int, int]:
    """(rows, time) a batch of ``rows`` examples, the longest ``longest``, runs at.

    With ``batch_size`` every strategy pads the rows to it (one row shape). Under a token
    budget: exact runs its exact shape; pad-max ``(max_tokens // cap, cap)``; grouped batches
    pad to their bucket's full batch (``batch_size_for(bucket, max_tokens)`` rows, so a
    bucket is one shape); pow2/fixed pad the rows to a power of two.
    """
    t = max(longest, MIN_T)
    if policy is not None:
        t = _bucket(policy.sizes, t)
    if strategy.grouped and t in getattr(policy, "partial_rows", ()):
        return rows, t        # a partial batch at its own rows (Auto chose it); full ones are full
    if cfg.batch_size is not None:
        return cfg.batch_size, t
    if strategy.kind == "exact":
        return rows, t
    if strategy.grouped:
        return buckets.batch_size_for(t, cfg.max_tokens), t
    return _bucket(b_sizes(strategy, cfg), rows), t


# ------------------------------------------------------------------------------- the worker


def emit(kind: str, **payload: Any) -> None:
    """One event line for the orchestrating process (it drives the progress bar)."""
    sys.stdout.write(EVENT_PREFIX + json.dumps({"event": kind, **payload}) + "\n")
    sys.stdout.flush()


def peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux (bytes on macOS); process-wide and monotone, which is why
    # every strategy runs in a process of its own.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


class ExactJit:
    """Plain ``jax.jit`` of the step at each exact input shape, the way the ``exact`` strategy
    and the limit run it: every new shape is traced, lowered and compiled (jit's ahead-of-time
    API, so the seconds are measured, not inferred) and its executable kept; calls run it.

    The state's arrays are the jitted argument and everything else is closed over, so the
    state's static leaves never become inputs.
    """

    def __init__(self, step: Step):
        self.step = step
        self.state, self._static = eqx.partition(step.state, eqx.is_array)
        self.traces = 0
        self.compile_seconds = 0.0
        self._executables: dict[tuple, Any] = {}
        self._jitted = jax.jit(self._call)

    def _call(self, params, tokens, lengths):
        self.traces += 1                 # Python runs only when jit traces
        return self.step.fn(eqx.combine(params, self._static), tokens, lengths)

    @property
    def compiles(self) -> int:
        return len(self._executables)

    def __call__(self, state, tokens, lengths) -> tuple[Any, Any]:
        """``(loss, state after the step)``, the state as arrays only."""
        key = (tokens.shape, lengths.shape)
        executable = self._executables.get(key)
        if executable is None:
            start = time.perf_counter()
            executable = self._jitted.lower(state, tokens, lengths).compile()
            self.compile_seconds += time.perf_counter() - start
            self._executables[key] = executable
        loss, state = self.step.loss_and_state(executable(state, tokens, lengths), state)
        return loss, eqx.filter(state, eqx.is_array)


def padded_batch(data: Data, idx: np.ndarray, rows: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """Examples ``idx`` as a (rows, t) token array and (rows,) lengths; extra rows have length 0."""
    return (px.pad_to(data.tokens[idx, :t], (rows, t), 0),
            px.pad_to(data.lengths[idx], (rows,), 0, np.int32))


def _combos_by_benefit(strategy, cfg, data, policy, epochs) -> list[tuple[int, int]]:
    """The (B, T) buckets a run uses, those that will carry the most real tokens first."""
    tokens: dict[tuple[int, int], int] = {}
    for ep in epochs:
        for idx in ep:
            shape = padded_shape(strategy, cfg, policy, len(idx), int(data.lengths[idx].max()))
            tokens[shape] = tokens.get(shape, 0) + int(data.lengths[idx].sum())
    return sorted(tokens, key=lambda shape: -tokens[shape])


class BackgroundWarmup:
    """Compile a bucketed function's (B, T) buckets one after another on a background thread,
    those carrying the most tokens first, while the caller trains.

    A batch whose bucket is not compiled yet runs in a compiled bucket at most ``max_ratio``
    times its size when one is ready (it costs at most that much more compute, against a
    compile that costs ~10 steps); otherwise it runs in its own bucket, which the caller's
    thread then compiles (or waits for, when the background thread is on it: px compiles
    each bucket once). On CPU the GRU train step keeps about one core busy (a scan of small
    matmuls), so on two cores the background compiles largely overlap with training. Padding
    never changes results, so none of this changes what is computed, only what it costs.
    """

    def __init__(self, f, fixed_args: tuple, combos: list[tuple[int, int]], max_ratio: float = 2.0):
        self.max_ratio = max_ratio
        self._lock = threading.Lock()
        self._ready: set[tuple[int, int]] = set()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._compile_all, args=(f, fixed_args, combos),
                                        name="polyexec-bench-warmup", daemon=True)
        self._thread.start()

    def _compile_all(self, f, fixed_args, combos):
        for b, t in combos:
            try:
                f.warmup(*fixed_args, sizes=[{"B": b, "T": t}], max_workers=1)
            except BaseException as e:   # re-raised on the main thread by join()
                self._error = e
                return
            with self._lock:
                self._ready.add((b, t))

    def shape_for(self, rows: int, t: int) -> tuple[int, int]:
        """The (B, T) bucket to run a batch in whose own bucket is (rows, t)."""
        with self._lock:
            if (rows, t) in self._ready:
                return rows, t
            fits = [c for c in self._ready
                    if c[0] >= rows and c[1] >= t and c[0] * c[1] <= self.max_ratio * rows * t]
        return min(fits, key=lambda c: (c[0] * c[1], c)) if fits else (rows, t)

    def mark_ready(self, combo: tuple[int, int]) -> None:
        """A bucket the caller's own call compiled (or found compiled)."""
        with self._lock:
            self._ready.add(combo)

    def join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def bucketed_step(strategy: Strategy, cfg: Config, step: Step, policy):
    """``step`` through ``px.bucketed`` with the strategy's (B, T) buckets."""
    rows = b_sizes(strategy, cfg)
    T = px.LengthVar("T", min=MIN_T, max=max(policy.sizes))
    B = px.LengthVar("B", max=max(rows))
    return px.bucketed(step.fn, in_specs=(None, px.Spec((B, T), jnp.int32),
                                          px.Spec((B,), jnp.int32, lengths_of=T)),
                       buckets={T: list(policy.sizes), B: rows}, name=strategy.name,
                       masking=strategy.masking)


def run_strategy(strategy: Strategy, cfg: Config, *, cache_dir: str | None = None,
                 state_file: str | None = None, choice_file: str | None = None) -> dict:
    """Run ``strategy`` for every epoch in this process; return its measurements."""
    if strategy.grouped:
        if cache_dir is None:
            raise px.OptionError(f"{strategy.name}: cache_dir: expected the persistent cache "
                              f"folder, received None")
        px.enable_persistent_cache(cache_dir)

    data = load_data(cfg)
    auto = strategy.grouped and cfg.buckets == "auto"
    policy = t_policy(strategy, cfg, data)
    step = build_step(cfg, state_file)

    choosing, auto_choice = 0.0, None
    if strategy.kind == "exact":
        call = exact = ExactJit(step)
        state = exact.state
    else:
        f = bucketed_step(strategy, cfg, step, policy or buckets.Fixed([int(data.padded_lengths.max())]))
        state = step.state
        rows_buckets = b_sizes(strategy, cfg)
        if auto:     # part of the cold epoch's time: measured below, added to it
            start = time.perf_counter()
            if choice_file is None:
                raise px.OptionError(f"{strategy.name}: choice_file: expected a path with --buckets "
                                  f"auto, received None")
            policy, f, rows_buckets, auto_choice = choose_auto(cfg, data, step, f, choice_file)
            choosing = time.perf_counter() - start

        def call(state, tokens, lengths):
            return step.loss_and_state(f(state, tokens, lengths), state)

    epochs = schedule(strategy, cfg, data, policy)
    emit("start", strategy=strategy.name, total=sum(len(e) for e in epochs))
    with px.count_compiles() as counter:
        real = padded = upgraded = 0
        epoch_seconds, epoch_tokens, losses = [], [], []
        done = 0
        warm = None
        for e, batches in enumerate(epochs):
            start = time.perf_counter()
            if e == 0 and strategy.grouped:
                combos = _combos_by_benefit(strategy, cfg, data, policy, epochs)
                if cfg.warmup == "blocking":
                    # Every (B, T) bucket this run uses, compiled before the first step on parallel
                    # threads: part of the cold epoch's time.
                    f.warmup(step.state, sizes=[{"B": b, "T": t} for b, t in combos])
                else:
                    warm = BackgroundWarmup(f, (step.state,), combos)
            loss = None
            for idx in batches:
                longest = max(int(data.lengths[idx].max()), MIN_T)
                rows, t = padded_shape(strategy, cfg, policy, len(idx), longest)
                own = (rows, t)
                if warm is not None:
                    rows, t = warm.shape_for(rows, t)
                    upgraded += (rows, t) != own
                if strategy.kind == "exact" or (rows, t) != (_bucket(rows_buckets, len(idx)),
                                                             _bucket(policy.sizes, longest)):
                    tokens, lengths = padded_batch(data, idx, rows, t)
                else:   # the bucket px picks for the unpadded batch: it pads to it itself
                    tokens = data.tokens[idx, :longest]
                    lengths = data.lengths[idx].astype(np.int32)
                loss, state = call(state, tokens, lengths)
                if warm is not None:
                    warm.mark_ready((rows, t))
                real += int(data.lengths[idx].sum())
                padded += rows * t
                done += 1
                emit("step", strategy=strategy.name, done=done)
            if warm is not None:
                warm.join()          # the cold epoch includes every compile; warm epochs none
                warm = None
            jax.block_until_ready((loss, state))
            epoch_seconds.append(time.perf_counter() - start + (choosing if e == 0 else 0.0))
            epoch_tokens.append(data.real_tokens)
            losses.append(float(loss))
    events = counter.counts().as_dict()

    if strategy.kind == "exact":
        compiles, compile_s, n_traces, n_buckets = (exact.compiles, exact.compile_seconds,
                                                    exact.traces, exact.compiles)
    else:
        # A persistent-cache hit builds the executable without running XLA: not a compile.
        compiles, compile_s, n_traces, n_buckets = (f.stats.compiles - events["cache_hits"],
                                                    f.stats.compile_seconds, f.traces,
                                                    len(policy.sizes))
    warm_tokens, warm_seconds = sum(epoch_tokens[1:]), sum(epoch_seconds[1:])
    return {
        "strategy": strategy.name,
        "batching": strategy.batching,
        "compiles": int(compiles),
        "traces": int(n_traces),
        "compile_s": float(compile_s),
        "padding_efficiency": real / padded,
        "tokens_per_s_cold": epoch_tokens[0] / epoch_seconds[0],
        "tokens_per_s_warm": warm_tokens / warm_seconds,
        "peak_rss_mb": peak_rss_mb(),
        # extras for the table and the plot (not part of the JSON results)
        "bucket_count": int(n_buckets),
        "buckets": list(policy.sizes) if policy is not None else None,
        "partial_rows": list(getattr(policy, "partial_rows", ())),
        "auto": auto_choice,             # --buckets auto: the measured cost and the prediction
        "choosing_seconds": choosing,
        "cache_hits": events["cache_hits"],
        "backend_compiles": events["backend_compiles"],
        "upgraded_batches": upgraded,
        "warmup": cfg.warmup if strategy.grouped else None,
        "distinct_shapes": len({padded_shape(strategy, cfg, policy, len(i),
                                             int(data.lengths[i].max()))
                                for ep in epochs for i in ep}),
        "steps": sum(len(ep) for ep in epochs),
        "epoch_seconds": epoch_seconds,
        "final_loss": losses[-1],
    }


def limit_shapes(cfg: Config, data: Data) -> list[dict]:
    """The shapes the limit is timed at: one per length group.

    The examples are split into groups by ``Optimal.fit`` (``cfg.buckets`` or 8 groups: tight
    length ranges); a group of n examples with mean length m is replaced by ceil(n / rows)
    batches of ``rows`` examples all of length m -- every row real, the same real tokens.
    """
    policy = buckets.Optimal.fit(data.padded_lengths,
                                 max_buckets=8 if cfg.buckets == "auto" else cfg.buckets)
    assign = policy.assign(data.padded_lengths)
    groups = []
    for size in policy.sizes:
        members = np.flatnonzero(assign == size)
        if not members.size:
            continue
        mean = max(int(round(float(data.lengths[members].mean()))), MIN_T)
        rows = cfg.batch_size or buckets.batch_size_for(size, cfg.max_tokens)
        groups.append({"bucket": int(size), "length": mean, "rows": int(rows),
                       "examples": int(members.size),
                       "real_tokens": int(data.lengths[members].sum()),
                       "members": members})
    return groups


def run_limit(cfg: Config, state_file: str | None = None, *, cache_dir: str | None = None,
              name: str = "limit") -> dict:
    """One pass of the limit: the same step, every row real, nothing compiled while timed.

    Per length group (`limit_shapes`) the step is compiled with plain jax.jit at (rows, the
    group's mean length) and called once untimed; then ``cfg.limit_rounds`` chunks of n calls
    are dispatched back to back (as an epoch's steps are) and blocked on, n chosen so that the
    chunks last about ``cfg.limit_seconds`` together. The fastest chunk gives the group's rate
    (rows x length / seconds per step): other processes on the machine only ever slow a chunk
    down, so the fastest is the closest to what the step costs. ``combine_limits`` turns the
    group rates into one limit.

    ``cache_dir``: a persistent compile cache shared by the limit passes only, so the pass
    after the strategies loads its programs instead of compiling them again.
    """
    if cache_dir is not None:
        px.enable_persistent_cache(cache_dir)
    data = load_data(cfg)
    groups = limit_shapes(cfg, data)
    emit("start", strategy=name, total=len(groups))
    step = ExactJit(build_step(cfg, state_file))
    state = step.state
    out_groups = []
    for i, g in enumerate(groups):
        rows, t = g["rows"], g["length"]
        # Bytes of this group's own examples (the values do not change the cost: the step has
        # no data-dependent control flow); every row is real: lengths = t.
        tokens = data.tokens[np.resize(g["members"], rows), :t]
        lengths = np.full(rows, t, np.int32)

        def chunk(n, state):
            start = time.perf_counter()
            for _ in range(n):
                loss, state = step(state, tokens, lengths)
            jax.block_until_ready((loss, state))
            return time.perf_counter() - start, state

        first, state = chunk(1, state)                  # compile + first run: not timed
        budget = cfg.limit_seconds / cfg.limit_rounds
        n, (elapsed, state) = 1, chunk(1, state)
        while elapsed < budget and n < 4096:           # calibrate the chunk length
            n *= 2
            elapsed, state = chunk(n, state)
        per_step = [elapsed / n]
        for _ in range(cfg.limit_rounds - 1):
            elapsed, state = chunk(n, state)
            per_step.append(elapsed / n)
        best = min(per_step)
        out_groups.append({k: v for k, v in g.items() if k != "members"} |
                          {"calls_per_chunk": n, "seconds_per_step": best,
                           "seconds_per_step_all": per_step, "tokens_per_s": rows * t / best})
        emit("step", strategy=name, done=i + 1)
    return {"strategy": name, "groups": out_groups,
            "limit_tokens_per_s": combine_limits([out_groups], data.real_tokens)[0],
            "peak_rss_mb": peak_rss_mb(), "jax": jax.__version__,
            "device": f"{jax.devices()[0].platform}: {jax.devices()[0].device_kind}, "
                      f"{os.cpu_count()} CPU(s)"}


def combine_limits(passes: list[list[dict]], real_tokens: int) -> tuple[float, list[float]]:
    """The limit from one or more passes: per group the fastest rate seen in any pass, then
    real tokens over the time every group's tokens take at that rate:
    ``sum(tokens_g) / sum(tokens_g / rate_g)``. Returns (limit, per-group rates).

    >>> g = [{"real_tokens": 100, "tokens_per_s": 50.0}, {"real_tokens": 300, "tokens_per_s": 100.0}]
    >>> combine_limits([g], 400)[0]           # 100/50 + 300/100 = 5 s for 400 tokens
    80.0
    """
    rates = [max(p[i]["tokens_per_s"] for p in passes) for i in range(len(passes[0]))]
    seconds = sum(g["real_tokens"] / r for g, r in zip(passes[0], rates))
    return real_tokens / seconds, rates


def worker_main(config_path: str) -> int:
    """Entry point of a worker process: ``polyexec-bench --worker CONFIG.json``."""
    with open(config_path, encoding="utf-8") as fh:
        job = json.load(fh)
    cfg = Config.from_dict(job["config"])
    if job["strategy"] == "limit":
        result = run_limit(cfg, job.get("state_file"), cache_dir=job.get("cache_dir"),
                           name=job.get("name", "limit"))
    else:
        s = job["strategy"]
        strategy = Strategy(s["kind"], tuple(s["sizes"]) if s["sizes"] else None)
        result = run_strategy(strategy, cfg, cache_dir=job.get("cache_dir"),
                              state_file=job.get("state_file"), choice_file=job.get("choice_file"))
    emit("result", result=result)
    return 0
