"""`fit`: the training loop over bucketed train and eval steps."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax

import buckets as _buckets

from .._compile import disable_persistent_cache, enable_persistent_cache
from .._executor import Bucketed
from . import _events
from ._checkpoint import latest_checkpoint, load_checkpoint, read_meta, save_checkpoint
from ._data import Batching, Examples, as_examples, pad_batch
from ._parallel import DataParallel, data_parallel
from ._progress import RunDisplay
from ._state import TrainState, place
from ._steps import EvalFn, LossFn, make_eval_step, make_train_step


class StopTraining(Exception):
    """Raise from a callback to end `fit` cleanly after the current step (a checkpoint is
    written first when ``checkpoint_dir`` is set)."""


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What a callback sees after each train step. ``state`` is valid until the next step,
    which donates its buffers: copy what you keep (``jax.tree_util.tree_map(jnp.copy, ...)``)."""

    step: int                  # steps done in the whole run (resumes included)
    epoch: int                 # 0-based
    position: int              # batches done in this epoch
    loss: float
    bucket: tuple[int, int]    # (B, T) the step ran at
    state: TrainState


@dataclasses.dataclass(frozen=True)
class FitResult:
    """The trained state, the metrics records, and the compiled steps (with their ``.stats``)."""

    state: TrainState
    history: list[dict]
    train_step: Bucketed
    eval_step: Bucketed | None
    policy: Any
    batch_buckets: tuple[int, ...]
    checkpoint: str | None
    stopped_early: bool

    @property
    def model(self) -> Any:
        return self.state.model

    def epochs(self) -> list[dict]:
        return [r for r in self.history if r["kind"] == "epoch"]

    @property
    def val_loss(self) -> float | None:
        """The latest validation loss, if any."""
        values = [r["val_loss"] for r in self.history if r.get("val_loss") is not None]
        return values[-1] if values else None


def _resolve_policy(spec: Any, train: Examples, validation: Examples | None, min_length: int):
    lengths = train.lengths
    if spec is None:
        policy = _buckets.Optimal.fit(lengths)
    elif isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
        policy = _buckets.Optimal.fit(lengths, max_buckets=int(spec))
    else:
        policy = _buckets.as_policy(spec)
    sizes = sorted({max(int(s), min_length) for s in policy.sizes})
    if validation is not None and int(validation.lengths.max()) > sizes[-1]:
        # The buckets fit the training lengths; one more covers the longest validation example.
        sizes.append(int(validation.lengths.max()))
    if sizes != list(policy.sizes):
        policy = _buckets.Fixed(sizes)
    for name, ex in (("data", train), ("validation", validation)):
        if ex is None:
            continue
        over = np.flatnonzero(ex.lengths > policy.largest)
        if over.size:
            i = int(over[0])
            raise ValueError(f"fit: {name}[{i}] has length {int(ex.lengths[i])}, above the largest "
                             f"bucket {policy.largest} of {policy!r}; cap or truncate long examples "
                             f"or use buckets whose largest size covers them")
    return policy


def _cache_dir(cache: bool | str | os.PathLike) -> str | None:
    if cache is True:
        return enable_persistent_cache()
    if cache is False or cache is None:
        disable_persistent_cache()
        return None
    return enable_persistent_cache(os.fspath(cache))


def _warmup(jobs: list[tuple[Bucketed, Any, dict]], workers: int | None, display: RunDisplay) -> None:
    """Compile every (step, bucket) pair on parallel threads: XLA compiles release the GIL."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = None
    if display.enabled:
        bar = Progress(TextColumn("compiling buckets"), BarColumn(bar_width=24), MofNCompleteColumn(),
                       TimeElapsedColumn(), console=display.console, transient=True)
        task = bar.add_task("warmup", total=len(jobs))
        bar.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
            futures = [pool.submit(step.warmup, arg, sizes=[combo], max_workers=1)
                       for step, arg, combo in jobs]
            for future in concurrent.futures.as_completed(futures):
                future.result()
                if bar is not None:
                    bar.advance(task)
    finally:
        if bar is not None:
            bar.stop()


def _stats(train: Bucketed, evaluate: Bucketed | None) -> tuple[int, float]:
    compiles = train.stats.compiles + (evaluate.stats.compiles if evaluate else 0)
    seconds = train.stats.compile_seconds + (evaluate.stats.compile_seconds if evaluate else 0.0)
    return compiles, seconds


def evaluate(eval_step: Bucketed, model: Any, examples: Examples, batching: Batching,
             dp: DataParallel, pad_id: int = 0) -> tuple[float, int]:
    """Mean loss over ``examples`` (exact: summed totals over summed counts) and the count."""
    total, count = 0.0, 0.0
    for batch in batching.epoch(examples.lengths, 0, shuffle=False):
        tokens, lengths = pad_batch(examples, batch.indices, batching.rows(batch.bucket_size),
                                    batch.bucket_size, pad_id)
        t, c = eval_step(model, dp.global_batch(tokens), dp.global_batch(lengths))
        total += float(t)
        count += float(c)
    return (total / count if count else float("nan")), int(count)


def fit(model: Any, loss_fn: LossFn, data: Sequence[Any], *,
        optimizer: optax.GradientTransformation, epochs: int = 1,
        validation: Sequence[Any] | None = None, eval_fn: EvalFn | None = None,
        batch_size: int | None = None, max_tokens: int | None = None, buckets: Any = None,
        min_length: int = 2, pad_id: int = 0, seed: int = 0, shuffle: bool = True,
        devices: int | Sequence[Any] | None = None, cache: bool | str | os.PathLike = True,
        warmup: bool = True, warmup_workers: int | None = None,
        checkpoint_dir: str | os.PathLike | None = None, checkpoint_every: int | None = None,
        keep_checkpoints: int = 3, resume: bool = True, max_steps: int | None = None,
        metrics_file: str | os.PathLike | None = None,
        callbacks: Sequence[Callable[[StepInfo], None]] = (), progress: bool | None = None,
        verbose: bool = True, console: Any = None) -> FitResult:
    """Train an equinox model with an optax optimiser through bucketed, compiled-once steps.

    ``data`` (and ``validation``) is a sequence of variable-length examples: 1-D integer arrays
    or ``bytes``. Each epoch groups them into batches whose lengths fall in one bucket
    (`buckets.batch_plan`, shuffled deterministically from ``(seed, epoch)``), pads each batch
    on the host to exactly ``(B, T)`` for its bucket — ``B`` rows: ``batch_size``, or with
    ``max_tokens`` the largest power of two with ``B*T <= max_tokens`` — and runs
    ``loss_fn(model, tokens (B, T) int32, lengths (B,) int32) -> scalar`` through
    `make_train_step` (``jax.value_and_grad`` + ``optimizer.update``, state donated). The loss
    must mask by ``lengths`` (``px.sequence_mask``); then padding never changes a gradient.

    Buckets: ``buckets=None`` fits eight to the training lengths (``buckets.Optimal.fit``),
    an int K fits K, or pass a policy (``buckets.Geometric(2, 1024)``) or a list of sizes.
    ``min_length`` (default 2, for next-token losses that slice ``tokens[:, :-1]``) is the
    smallest padded length. Every bucket the data uses is compiled before the first step
    (``warmup``) on parallel threads, into JAX's persistent compile cache (``cache=True``:
    ``$POLYEXEC_CACHE_DIR`` or ``~/.cache/polyexec/xla``; a path; or False for none), so a
    second run loads the executables instead of compiling them.

    Validation: after every epoch, ``eval_fn(model, tokens, lengths) -> (summed loss, count)``
    over ``validation`` (exact mean: totals over counts), or without ``eval_fn`` the mean of
    ``loss_fn`` weighted by real tokens.

    Checkpoints (``checkpoint_dir``): at every epoch end and every ``checkpoint_every`` steps,
    the `TrainState` (model, optimiser state, step) and the data order (seed, epoch, batches
    done in the epoch) are written atomically with ``eqx.tree_serialise_leaves``; with
    ``resume=True`` a later call with the same arguments continues from the newest one and ends
    with the same parameters as a run that was never interrupted. ``max_steps`` stops after
    that many steps in total; a callback may raise `StopTraining`.

    Data parallel: ``devices=None`` uses every local device (``devices=n``: the first n): the
    parameters are replicated and the batch axis is split over a one-axis ``Mesh`` (``B`` is
    rounded up to a multiple of the device count; XLA adds the gradient all-reduce, and the
    loss is the same as on one device). On CPU, ``XLA_FLAGS=--xla_force_host_platform_device_count=4``
    (set before jax is imported) gives four devices. Multi-host: call
    ``jax.distributed.initialize()`` in every process first, then ``fit`` with the same
    arguments everywhere: the mesh spans all processes' devices, each process pads only its
    share of every global batch (``batch_plan(num_shards=process_count, shard_index=...)``) and
    assembles the global batch with ``jax.make_array_from_process_local_data``; process 0
    writes checkpoints, metrics and output.

    Metrics: the returned `FitResult` has ``history``, a list of dicts (``kind`` "warmup",
    "step", "epoch"), also appended as JSON lines to ``metrics_file``. Each epoch record has
    train/validation loss, tokens/s, padding efficiency (real tokens / padded tokens),
    compiles and compile seconds.

    >>> import equinox as eqx, jax, jax.numpy as jnp, numpy as np, optax
    >>> from polyexec import training
    >>> def loss(model, tokens, lengths):         # masked per-token regression, for brevity
    ...     x = tokens.astype(jnp.float32)[..., None] / 10
    ...     err = (jax.vmap(jax.vmap(model))(x)[..., 0] - 1.0) ** 2
    ...     mask = jnp.arange(tokens.shape[1]) < lengths[:, None]
    ...     return jnp.sum(jnp.where(mask, err, 0.0)) / jnp.maximum(jnp.sum(mask), 1)
    >>> data = [np.arange(n) % 7 for n in range(2, 40)]
    >>> result = training.fit(eqx.nn.Linear(1, 1, key=jax.random.PRNGKey(0)), loss, data,
    ...                       optimizer=optax.adam(0.05), epochs=3, batch_size=8, buckets=[8, 16, 40],
    ...                       validation=data[:10], cache=False, verbose=False)
    >>> [r["epoch"] for r in result.epochs()], result.train_step.traces
    ([0, 1, 2], 1)
    >>> result.epochs()[-1]["val_loss"] < result.epochs()[0]["val_loss"]
    True
    """
    if not callable(loss_fn):
        raise TypeError(f"fit: loss_fn must be callable (model, tokens, lengths) -> loss, got "
                        f"{type(loss_fn).__name__}")
    for name, value, low in (("epochs", epochs, 0), ("min_length", min_length, 1), ("seed", seed, 0),
                             ("keep_checkpoints", keep_checkpoints, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"fit: {name} must be an int >= {low}, got {value!r}")
    for name, value in (("checkpoint_every", checkpoint_every), ("max_steps", max_steps)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                                  or value < 1):
            raise ValueError(f"fit: {name} must be None or an int >= 1, got {value!r}")
    if batch_size is not None and max_tokens is not None:
        raise ValueError(f"fit: pass one of batch_size= or max_tokens=, not both "
                         f"(got batch_size={batch_size!r}, max_tokens={max_tokens!r})")
    if batch_size is None and max_tokens is None:
        batch_size = 32
    for name, value in (("batch_size", batch_size), ("max_tokens", max_tokens)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                                  or value < 1):
            raise ValueError(f"fit: {name} must be an int >= 1, got {value!r}")

    train = as_examples(data, "fit: data")
    val = as_examples(validation, "fit: validation") if validation is not None else None
    policy = _resolve_policy(buckets, train, val, min_length)
    dp = data_parallel(devices)
    main = dp.process_index == 0
    batching = Batching(policy, batch_size, max_tokens, shuffle, seed, dp.local_devices,
                        dp.processes, dp.process_index)
    display = RunDisplay(progress=_interactive(console) if progress is None else progress,
                         verbose=verbose and main, console=console)
    cache_path = _cache_dir(cache)

    used_train = sorted(set(policy.assign(train.lengths).tolist()))
    used_val = sorted(set(policy.assign(val.lengths).tolist())) if val is not None else []
    used = sorted(set(used_train) | set(used_val))
    rows = batching.batch_buckets(used)
    global_rows = {s: batching.rows(s) * dp.processes for s in used}
    multi_host = dp.processes > 1
    train_step = make_train_step(loss_fn, optimizer, length_buckets=used,
                                 batch_buckets=[r * dp.processes for r in rows],
                                 min_length=min_length, pad_id=pad_id, shardings=dp.shardings,
                                 check_lengths=not multi_host)
    eval_step = None
    if val is not None:
        eval_step = make_eval_step(loss_fn, eval_fn, length_buckets=used,
                                   batch_buckets=[r * dp.processes for r in rows],
                                   min_length=min_length, pad_id=pad_id, shardings=dp.shardings,
                                   check_lengths=not multi_host)

    state = TrainState.create(model, optimizer)
    fingerprint = {"examples": len(train), "lengths": train.fingerprint(), "buckets": list(used),
                   "batch_size": batch_size, "max_tokens": max_tokens, "shuffle": shuffle,
                   "seed": seed}
    start_epoch, start_position, step = 0, 0, 0
    totals = _new_totals()
    history: list[dict] = []
    restored = None
    if checkpoint_dir is not None and resume:
        restored = latest_checkpoint(checkpoint_dir)
    if restored is not None:
        meta = read_meta(restored)
        mismatch = {k: (meta["fingerprint"].get(k), v) for k, v in fingerprint.items()
                    if meta["fingerprint"].get(k) != v}
        if mismatch:
            detail = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in mismatch.items())
            raise ValueError(f"fit: cannot resume from {restored}: the run differs ({detail}); "
                             f"use another checkpoint_dir or resume=False")
        state, meta = load_checkpoint(restored, like=state)
        start_epoch, start_position, step = meta["epoch"], meta["position"], meta["step"]
        totals = meta["totals"]
        history = [dict(r) for r in meta["history"]]
        display.print(f"resumed from {restored}: step {step}, epoch {start_epoch + 1}, "
                      f"batch {start_position}")
    state = place(state, dp.replicated)
    writer = _MetricsWriter(metrics_file if main else None, restored_step=step if restored else None,
                            restored_epoch=start_epoch if restored else None)

    display.print(f"devices: {dp.size} ({jax.devices()[0].platform}"
                  + (f", batch axis split over a {dp.size}-device mesh" if dp.mesh is not None else "")
                  + f") | length buckets {list(used)} | rows per bucket "
                  + ", ".join(f"T={s}: B={global_rows[s]}" for s in used)
                  + f" | compile cache: {cache_path or 'off'}")

    before = _events.snapshot()
    t0 = time.perf_counter()
    if warmup and start_epoch < epochs:
        jobs = [(train_step, state, {"B": global_rows[s], "T": s}) for s in used_train]
        if eval_step is not None:
            jobs += [(eval_step, state.model, {"B": global_rows[s], "T": s}) for s in used_val]
        _warmup(jobs, warmup_workers, display)
        compiles, seconds = _stats(train_step, eval_step)
        events = _events.since(before)
        record = {"kind": "warmup", "step": step, "compiles": compiles, "compile_seconds": seconds,
                  "xla_compiles": events["xla_compiles"], "cache_hits": events["cache_hits"],
                  "seconds": time.perf_counter() - t0}
        history.append(record)
        writer.write(record)
        display.print(f"warmup: {compiles} buckets compiled in {record['seconds']:.1f} s "
                      f"({events['xla_compiles']} XLA compiles, {events['cache_hits']} loaded from "
                      f"the persistent cache; {seconds:.1f} s of compile time over the threads)")
    if start_epoch < epochs:
        plan = train_step.plan
        display.print(f"train step: {train_step.traces} Python trace(s); " + (
            f"NOT shape-polymorphic, one trace per bucket: {plan.reason}"
            if plan.reshaping_is_impossible else
            "shape-polymorphic (reshaping_is_impossible=False): one program for every bucket"))

    stopped = False
    last_checkpoint = restored
    try:
        for epoch in range(start_epoch, epochs):
            batches = batching.epoch(train.lengths, epoch)
            position = start_position if epoch == start_epoch else 0
            if epoch != start_epoch:
                totals = _new_totals()
            compiles_at_start, _ = _stats(train_step, eval_step)
            display.start_epoch(epoch, epochs, len(batches), position)
            epoch_t0 = time.perf_counter()
            while position < len(batches):
                batch = batches[position]
                bucket = batch.bucket_size
                b = batching.rows(bucket)
                t_step = time.perf_counter()
                tokens, lengths = pad_batch(train, batch.indices, b, bucket, pad_id)
                state, metrics = train_step(state, dp.global_batch(tokens), dp.global_batch(lengths))
                loss = float(metrics["loss"])
                seconds = time.perf_counter() - t_step
                real = int(lengths.sum()) * dp.processes   # approximate across hosts
                position += 1
                step += 1
                totals["loss_sum"] += loss * real
                totals["tokens"] += real
                totals["padded"] += b * bucket * dp.processes
                totals["steps"] += 1
                totals["seconds"] += seconds
                compiles, _ = _stats(train_step, eval_step)
                record = {"kind": "step", "step": step, "epoch": epoch, "position": position,
                          "loss": loss, "grad_norm": float(metrics["grad_norm"]), "tokens": real,
                          "bucket": [b * dp.processes, bucket], "seconds": seconds,
                          "compiles": compiles}
                history.append(record)
                writer.write(record)
                display.step(loss=loss, rate=totals["tokens"] / max(totals["seconds"], 1e-9),
                             bucket=(b * dp.processes, bucket), compiles=compiles)
                info = StepInfo(step, epoch, position, loss, (b * dp.processes, bucket), state)
                try:
                    for callback in callbacks:
                        callback(info)
                except StopTraining:
                    stopped = True
                if max_steps is not None and step >= max_steps:
                    stopped = True
                if checkpoint_dir is not None and main and (
                        stopped or (checkpoint_every and step % checkpoint_every == 0)):
                    last_checkpoint = save_checkpoint(
                        checkpoint_dir, state, _meta(step, epoch, position, totals, history,
                                                     fingerprint), keep=keep_checkpoints)
                if stopped:
                    break
            display.end_epoch()
            if stopped:
                break
            wall = time.perf_counter() - epoch_t0
            val_loss = None
            if eval_step is not None:
                val_loss, _ = evaluate(eval_step, state.model, val, batching, dp, pad_id)
            compiles, compile_seconds = _stats(train_step, eval_step)
            record = {"kind": "epoch", "epoch": epoch, "step": step, "steps": totals["steps"],
                      "train_loss": totals["loss_sum"] / max(totals["tokens"], 1),
                      "val_loss": val_loss, "tokens": totals["tokens"],
                      "tokens_per_s": totals["tokens"] / max(totals["seconds"], 1e-9),
                      "padding_efficiency": totals["tokens"] / max(totals["padded"], 1),
                      "compiles": compiles, "compiles_epoch": compiles - compiles_at_start,
                      "compile_seconds": compile_seconds,
                      "seconds": time.perf_counter() - epoch_t0, "train_seconds": wall}
            history.append(record)
            writer.write(record)
            display.epoch_summary(record)
            if checkpoint_dir is not None and main:
                last_checkpoint = save_checkpoint(
                    checkpoint_dir, state, _meta(step, epoch + 1, 0, _new_totals(), history,
                                                 fingerprint), keep=keep_checkpoints)
    finally:
        display.end_epoch()
        writer.close()
    return FitResult(state=state, history=history, train_step=train_step, eval_step=eval_step,
                     policy=policy, batch_buckets=tuple(r * dp.processes for r in rows),
                     checkpoint=last_checkpoint, stopped_early=stopped)


def _new_totals() -> dict:
    return {"loss_sum": 0.0, "tokens": 0, "padded": 0, "steps": 0, "seconds": 0.0}


def _meta(step, epoch, position, totals, history, fingerprint) -> dict:
    return {"step": step, "epoch": epoch, "position": position, "totals": dict(totals),
            "history": [r for r in history if r["kind"] == "epoch"], "fingerprint": fingerprint}


def _interactive(console) -> bool:
    if console is not None:
        return bool(console.is_terminal)
    from rich.console import Console
    return Console().is_terminal


class _MetricsWriter:
    """JSON lines, one record per line. On resume, records after the checkpoint (written by the
    interrupted run past its last checkpoint) are dropped, so the file reads as one run."""

    def __init__(self, path, *, restored_step: int | None, restored_epoch: int | None):
        self._file = None
        if path is None:
            return
        path = os.fspath(path)
        kept: list[str] = []
        if restored_step is not None and os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        r = json.loads(line)
                    except json.JSONDecodeError:
                        continue   # a line torn by the kill
                    if r.get("step", 0) > restored_step:
                        continue
                    if r.get("kind") == "epoch" and r.get("epoch", -1) >= restored_epoch:
                        continue
                    kept.append(line if line.endswith("\n") else line + "\n")
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self._file = open(path, "w")
        self._file.writelines(kept)
        self._file.flush()

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
