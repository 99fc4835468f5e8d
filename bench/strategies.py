"""The strategies compared, their batch schedules, and the worker that measures one of them.

A strategy decides how examples are grouped into batches (random batches, or length-grouped
batches from `buckets.batch_plan`), which padded shape each batch runs at (the cap, the batch's
exact maximum, a bucket) and how its worker process runs them. Every strategy runs every
example once per epoch; only the grouping and the padding differ.

Each strategy is one class, registered under its ``--strategies`` token with `register`:
parsing, the CLI's help, the worker and the report look it up in `REGISTRY`, so adding a
strategy is adding one class. A class says

- ``token`` / ``usage`` / ``description``: its name on the command line and in ``--help``;
- ``batching``: the label of its batches in the report (``random``, ``grouped``, ...);
- ``requires``: a strategy that must be listed too, and runs first (``polyexec-cached``
  reads the compile cache ``polyexec`` fills); ``cache_folder``: its persistent compile cache;
- ``models``: the ``--model`` choices it runs (`Strategy.check` refuses the others, before
  any worker starts);
- `Strategy.schedule`: every epoch's batches (example indices), and `Strategy.prepare`: the
  `Run` its worker drives -- the batches of each epoch, the step it calls per batch, the shape
  each batch ran at, its real tokens and predictions, and its compile accounting. ``pack``
  (`Pack`: Grain first-fit packed rows, a segment-id model step) brings its own batches and
  step this way, and nothing else needs to know.

>>> [s.name for s in parse_strategies("pad-max,fixed:16,64,1024,polyexec")]
['pad-max', 'fixed:16,64,1024', 'polyexec']
>>> sorted(REGISTRY)[:4]
['exact', 'fixed', 'pack', 'pad-max']
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import resource
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import buckets
import polyexec as px
from polyexec.training import choose_layout

from .devices import data_parallel_for, place
from .workloads import MIN_T, Config, Data, Step, build_step, load_data

DEFAULT_STRATEGIES = "pad-max,exact,pow2,pack,polyexec,polyexec-cached"

EVENT_PREFIX = "@@bench "

Shape = tuple[int, int]   # (rows, time) a batch runs at

REGISTRY: dict[str, type["Strategy"]] = {}


def register(cls: type["Strategy"]) -> type["Strategy"]:
    """Class decorator: make ``cls`` a ``--strategies`` choice under ``cls.token``."""
    if cls.token in REGISTRY:
        raise ValueError(f"register: token {cls.token!r} is taken by {REGISTRY[cls.token].__name__}")
    REGISTRY[cls.token] = cls
    return cls


def _bucket(sizes, n: int) -> int:
    i = int(np.searchsorted(np.asarray(sizes), n, side="left"))
    return int(sizes[i])


@dataclasses.dataclass(frozen=True)
class Files:
    """Where a worker finds what the run shares: the initial weights, its persistent compile
    cache, and the ``--buckets auto`` choice the first grouped worker writes."""

    state_file: str | None = None
    cache_dir: str | None = None
    choice_file: str | None = None


class Run:
    """What one worker process drives for its strategy, built by `Strategy.prepare`.

    Per epoch the worker calls ``start_epoch``, then ``step`` on each batch of ``batches``,
    then ``end_epoch``, all of it timed; ``setup_seconds`` (measuring, choosing) counts towards
    the cold epoch; ``summary`` gives the strategy's own columns once every epoch ran. A batch
    is whatever ``batches`` yields: by default an array of example indices from ``epochs``
    (the schedule), which ``real_tokens``, ``predictions`` and ``own_shape`` read.
    """

    state: Any
    data: Data
    epochs: list[list[np.ndarray]]
    setup_seconds: float = 0.0

    def batch_count(self) -> int | None:
        """Batches in all epochs, for the progress bar (None: not known before they run)."""
        return sum(len(e) for e in self.epochs)

    def batches(self, epoch: int) -> Iterable[Any]:
        """Epoch ``epoch``'s batches, iterated inside the timed epoch."""
        return self.epochs[epoch]

    def real_tokens(self, batch: Any) -> int:
        return int(self.data.lengths[batch].sum())

    def predictions(self, batch: Any) -> int:
        """Next-byte predictions the loss averages over: (length - 1) per example."""
        return int(np.maximum(self.data.lengths[batch] - 1, 0).sum())

    def own_shape(self, batch: Any) -> Shape:
        """The (rows, time) batch ``batch`` is scheduled at."""
        raise NotImplementedError

    def start_epoch(self, epoch: int) -> None:
        pass

    def step(self, state: Any, batch: Any) -> tuple[Any, Any, Shape]:
        """Run ``batch``: ``(loss, new state, the (rows, time) it ran at)``; the loss is the
        mean over the batch's ``predictions``."""
        raise NotImplementedError

    def end_epoch(self, epoch: int) -> None:
        pass

    def summary(self, events: px.CompileCounts) -> dict:
        """``compiles``, ``traces``, ``compile_s``, ``bucket_count``, ``buckets``,
        ``partial_rows``, ``auto``, ``upgraded_batches``, ``warmup``; optionally
        ``plan_seconds``."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One padding strategy (a registered subclass); instances are values (sizes, options)."""

    token: ClassVar[str]
    usage: ClassVar[str]              # how --strategies spells it: "pad-max", "fixed:S1,S2,..."
    description: ClassVar[str]
    batching: ClassVar[str] = "random"
    requires: ClassVar[str | None] = None
    cache_folder: ClassVar[str | None] = None
    # polyexec's warm throughput goal against this peer (a line of the summary), if any
    goal: ClassVar[float | None] = None
    # the --model choices it runs (filter-mlp and seq2seq are benchmarks of their own: no
    # strategy runs them)
    models: ClassVar[tuple[str, ...]] = ("gru", "lstm", "attention")
    # The model's loss as plain jax.jit runs it on a padded batch: masked by hand. Only the
    # executor's logical rewrite lets the unmasked loss (`examples.rnn.model.lm_loss`) run.
    hand_masked: ClassVar[bool] = True
    # Runs its rows split over a Mesh of --devices N (pack, polyexec, polyexec-cached).
    multi_device: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return self.token

    @classmethod
    def from_args(cls, args: tuple[int, ...] | None) -> "Strategy":
        """The strategy of ``token`` (``args`` None) or ``token:N1,N2,...``."""
        if args is not None:
            raise px.OptionError(f"--strategies: {cls.token}: expected no ':' arguments, "
                                 f"received {cls.token}:{','.join(map(str, args))}")
        return cls()

    # -- what runs ------------------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        """Refuse a ``--model`` this strategy does not run."""
        if model not in self.models:
            raise px.OptionError(f"--strategies {self.name}: expected --model "
                                 f"{' / '.join(self.models)}, received --model {model}")

    def check_devices(self, devices: int) -> None:
        """Refuse ``--devices N`` (N > 1) when this strategy runs on one device only."""
        if devices > 1 and not self.multi_device:
            raise px.OptionError(f"--strategies {self.name}: expected --devices 1 (it runs on "
                                 f"one device; over several: pack, polyexec, polyexec-cached), "
                                 f"received --devices {devices}")

    def check(self, cfg: Config, data: Data) -> None:
        """Refuse a workload this strategy cannot run (called before any worker starts)."""
        self.check_model(cfg.model)
        self.check_devices(cfg.devices)
        self.t_policy(cfg, data)

    def t_policy(self, cfg: Config, data: Data) -> buckets.BucketPolicy | None:
        """The bucket policy of the time axis (None: no buckets, or chosen in the worker)."""
        return None

    def row_sizes(self, cfg: Config) -> list[int]:
        """Row buckets: the batch size itself; under a token budget powers of two (grouped
        batches use ``buckets.batch_size_for(bucket, max_tokens)``, a power of two)."""
        if cfg.batch_size is not None:
            return [cfg.batch_size]
        top = buckets.batch_size_for(MIN_T, cfg.max_tokens)
        return list(buckets.Geometric(1, top).sizes) if top > 1 else [1]

    def schedule(self, cfg: Config, data: Data, policy) -> list[list[np.ndarray]]:
        """Every epoch's batches (example indices): one shared random order, batches cut at
        the strategy's padded length under a token budget."""
        pad = (lambda n: n) if policy is None else (lambda n: _bucket(policy.sizes, n))
        return [random_batches(cfg, data, epoch, pad) for epoch in range(cfg.epochs)]

    def padded_shape(self, cfg: Config, policy, rows: int, longest: int) -> Shape:
        """(rows, time) a batch of ``rows`` examples, the longest ``longest``, runs at: the
        policy's bucket; rows padded to the batch size (one row shape), or under a token
        budget to a power of two."""
        t = max(longest, MIN_T)
        if policy is not None:
            t = _bucket(policy.sizes, t)
        if cfg.batch_size is not None:
            return cfg.batch_size, t
        return _bucket(self.row_sizes(cfg), rows), t

    def prepare(self, cfg: Config, data: Data, step: Step, files: Files) -> Run:
        """The `Run` of this strategy in its worker process (random batches through
        ``px.bucketed`` at the strategy's buckets, by default)."""
        policy = self.t_policy(cfg, data)
        return BucketedRun(self, cfg, data, step, policy, self.schedule(cfg, data, policy))

    # -- how it is reported ---------------------------------------------------------------------

    def summary_line(self, row: dict, polyexec: dict, extra: dict) -> str | None:
        """A sentence comparing polyexec's result row with this strategy's ``row``."""
        if self.goal is None:
            return None
        return (f"polyexec vs {self.name}: "
                f"{polyexec['tokens_per_s_warm'] / row['tokens_per_s_warm']:.2f}x warm, "
                f"{polyexec['tokens_per_s_cold'] / row['tokens_per_s_cold']:.2f}x cold "
                f"(goal {self.goal:.0f}x)")


@register
@dataclasses.dataclass(frozen=True)
class PadMax(Strategy):
    token: ClassVar[str] = "pad-max"
    usage: ClassVar[str] = "pad-max"
    description: ClassVar[str] = "random batches padded to the cap (one compile)"
    goal: ClassVar[float | None] = 4.0

    def t_policy(self, cfg, data):
        return buckets.Fixed([cfg.cap])

    def row_sizes(self, cfg):
        # Under a token budget its batches are always max_tokens // cap rows: one shape.
        return [cfg.batch_size] if cfg.batch_size is not None else [cfg.max_tokens // cfg.cap]


@register
@dataclasses.dataclass(frozen=True)
class Exact(Strategy):
    token: ClassVar[str] = "exact"
    usage: ClassVar[str] = "exact"
    description: ClassVar[str] = ("random batches, plain jax.jit at each batch's exact longest "
                                  "length (one compile per distinct length)")
    goal: ClassVar[float | None] = 3.0

    def padded_shape(self, cfg, policy, rows, longest):
        t = max(longest, MIN_T)
        return (cfg.batch_size if cfg.batch_size is not None else rows), t

    def prepare(self, cfg, data, step, files):
        return ExactRun(self, cfg, data, step, self.schedule(cfg, data, None))


@register
@dataclasses.dataclass(frozen=True)
class Pow2(Strategy):
    token: ClassVar[str] = "pow2"
    usage: ClassVar[str] = "pow2"
    description: ClassVar[str] = "random batches, px.bucketed with power-of-two buckets"

    def t_policy(self, cfg, data):
        # Powers of two from 2, with the cap itself as the largest bucket.
        return buckets.Geometric(MIN_T, cfg.cap)


@register
@dataclasses.dataclass(frozen=True)
class FixedSizes(Strategy):
    """``fixed:S1,S2,...``: random batches, ``px.bucketed`` with the given buckets."""

    sizes: tuple[int, ...] = ()
    token: ClassVar[str] = "fixed"
    usage: ClassVar[str] = "fixed:S1,S2,..."
    description: ClassVar[str] = "random batches, px.bucketed with the given buckets"

    @property
    def name(self) -> str:
        return f"fixed:{','.join(map(str, self.sizes))}"

    @classmethod
    def from_args(cls, args):
        if not args:
            raise px.OptionError("--strategies: 'fixed:' expected sizes, e.g. "
                                 "fixed:16,64,256,1024, received none")
        sizes = tuple(sorted(set(args)))
        if min(sizes) < MIN_T:
            raise px.OptionError(f"--strategies: fixed sizes: expected sizes >= {MIN_T} (the loss "
                                 f"needs T >= 2), received fixed:{','.join(map(str, args))}")
        return cls(sizes)

    def t_policy(self, cfg, data):
        if max(self.sizes) < cfg.cap:
            raise px.OptionError(f"--strategies {self.name}: expected a largest size >= the cap "
                                 f"{cfg.cap}, received largest size {max(self.sizes)} (add a "
                                 f"size >= {cfg.cap})")
        return buckets.Fixed(self.sizes)


@register
@dataclasses.dataclass(frozen=True)
class Polyexec(Strategy):
    """Length-grouped batches from `buckets.batch_plan` over ``--buckets`` (auto: chosen by
    predicted cost in the worker, `polyexec.training.choose_buckets`), each (rows, length)
    bucket compiled ahead of need, into a persistent compile cache."""

    token: ClassVar[str] = "polyexec"
    usage: ClassVar[str] = "polyexec"
    description: ClassVar[str] = ("length-grouped batches, buckets by cost (--buckets), compiled "
                                  "ahead of need")
    batching: ClassVar[str] = "grouped"
    cache_folder: ClassVar[str | None] = "xla-cache"
    masking: ClassVar[bool] = True
    hand_masked: ClassVar[bool] = False   # the model as written: no mask, rows ragged
    multi_device: ClassVar[bool] = True

    def t_policy(self, cfg, data):
        if cfg.buckets == "auto":      # chosen in the worker, from a measured cost
            return None
        return buckets.Optimal.fit(data.padded_lengths, max_buckets=cfg.buckets)

    def schedule(self, cfg, data, policy):
        return [[b.indices for b in buckets.batch_plan(
                    data.padded_lengths, policy, batch_size=cfg.batch_size,
                    max_tokens=cfg.max_tokens, seed=cfg.seed, epoch=epoch)]
                for epoch in range(cfg.epochs)]

    def padded_shape(self, cfg, policy, rows, longest):
        t = _bucket(policy.sizes, max(longest, MIN_T))
        if t in getattr(policy, "partial_rows", ()):
            return rows, t     # a partial batch at its own rows (Auto chose it); full ones are full
        if cfg.batch_size is not None:
            return cfg.batch_size, t
        # Under a token budget a bucket's batches pad to its full batch: one shape a bucket.
        return buckets.batch_size_for(t, cfg.max_tokens), t

    def prepare(self, cfg, data, step, files):
        if files.cache_dir is None:
            raise px.OptionError(f"{self.name}: cache_dir: expected the persistent cache "
                                 f"folder, received None")
        px.enable_persistent_cache(files.cache_dir)
        policy = self.t_policy(cfg, data)
        # --devices N: fit's data parallelism (`polyexec.training.data_parallel`): the state
        # replicated, every batch's rows split over the Mesh by the bucketed step's shardings,
        # row buckets a multiple of the devices.
        dp = data_parallel_for(cfg.devices) if cfg.devices > 1 else None
        if dp is not None:
            step = dataclasses.replace(step, state=place(step.state, dp.replicated))
        # The packed rewrite needs the logical one (masking); --layout pad keeps plans pad-only.
        layout = cfg.layout if self.masking and policy is None else "pad"
        f = bucketed_step(self, cfg, step, policy or buckets.Fixed([int(data.padded_lengths.max())]),
                          layout="pad" if layout == "pad" else "auto", data_parallel=dp)
        setup, choice, rows = 0.0, None, None
        if policy is None:      # part of the cold epoch's time: measured here, added to it
            if files.choice_file is None:
                raise px.OptionError(f"{self.name}: choice_file: expected a path with --buckets "
                                     f"auto, received None")
            start = time.perf_counter()
            chosen, choice = choose_auto(cfg, data, step, f, files.choice_file, layout,
                                         data_parallel=dp)
            setup = time.perf_counter() - start
            if chosen.layout == "pack":
                run = PackedBucketedRun(cfg, data, step, chosen.step, [
                    chosen.epoch_plan(data.padded_lengths, epoch=epoch, seed=cfg.seed)
                    for epoch in range(cfg.epochs)],
                    chosen.row_lengths, auto_choice=choice, first_steps=chosen.first_steps)
                run.setup_seconds = setup
                return run
            policy, f = chosen.buckets.policy, chosen.step
            rows = list(chosen.buckets.sizes["B"])
        run = BucketedRun(self, cfg, data, step, policy, self.schedule(cfg, data, policy), f=f,
                          rows_buckets=rows, warmup=cfg.warmup, auto_choice=choice)
        run.setup_seconds = setup
        return run


@register
@dataclasses.dataclass(frozen=True)
class PolyexecCached(Polyexec):
    token: ClassVar[str] = "polyexec-cached"
    usage: ClassVar[str] = "polyexec-cached"
    description: ClassVar[str] = ("polyexec again in a second process, on the persistent compile "
                                  "cache polyexec filled")
    requires: ClassVar[str | None] = "polyexec"

    def summary_line(self, row, polyexec, extra):
        return (f"polyexec-cached (a second process on the persistent compile cache): "
                f"{row['fraction_of_limit_cold']:.2f} of the limit cold, {row['compiles']} "
                f"compiles")


@register
@dataclasses.dataclass(frozen=True)
class PolyexecNomask(Polyexec):
    """``polyexec`` with the executor's logical-length rewrite off, to show what it costs side
    by side. It compiles other programs, so it gets its own compile cache: it finds nothing of
    ``polyexec``'s and its compile counts compare."""

    token: ClassVar[str] = "polyexec-nomask"
    usage: ClassVar[str] = "polyexec-nomask"
    description: ClassVar[str] = ("polyexec with the logical-length rewrite off and the loss "
                                  "masked by hand (what the rewrite costs)")
    cache_folder: ClassVar[str | None] = "xla-cache-nomask"
    masking: ClassVar[bool] = False
    # fit refuses masking=False over devices: filler rows would count in a hand-masked mean
    multi_device: ClassVar[bool] = False
    hand_masked: ClassVar[bool] = True    # the rewrite's cost against the model masked by hand

    def summary_line(self, row, polyexec, extra):
        return (f"polyexec-nomask (the rewrite off, the loss masked by hand): polyexec runs at "
                f"{polyexec['tokens_per_s_warm'] / row['tokens_per_s_warm']:.2f}x its warm "
                f"throughput, {polyexec['compile_s']:.1f} s of compiles against "
                f"{row['compile_s']:.1f} s")


@register
@dataclasses.dataclass(frozen=True)
class Pack(Strategy):
    """The peer a JAX user builds instead of bucketing (`bench.packing`): each epoch's
    examples, in the random-batch strategies' shared order, packed first-fit by Grain into
    rows of the cap, ``--batch-size`` rows a batch (under ``--max-tokens``: max_tokens // cap
    rows, as pad-max), and a hand-written model that resets its state / restricts attention
    and the loss at segment ids. Every batch is ``(rows, cap)``: one ``jax.jit`` compile.

    Packing is part of the timed epoch: a user of packing pays it. The batches come from
    `bench.packing.iter_pack_epoch` one at a time inside the epoch's clock, as a Grain
    pipeline feeds a training loop, so packing the next batch overlaps the step JAX has
    dispatched. It takes fewer, larger optimiser steps than the others (rows hold several
    sequences): the report gives its steps, and each epoch's mean loss over the same examples
    (summed nats / predictions, `bench.packing.packed_loss_and_count`'s count) to compare.
    """

    token: ClassVar[str] = "pack"
    usage: ClassVar[str] = "pack"
    description: ClassVar[str] = ("Grain first-fit packing into rows of the cap, a "
                                  "segment-id model written by hand (one compile)")
    batching: ClassVar[str] = "packed"
    multi_device: ClassVar[bool] = True

    @staticmethod
    def rows(cfg: Config) -> int:
        return cfg.batch_size if cfg.batch_size is not None else cfg.max_tokens // cfg.cap

    def packed_config(self, cfg: Config) -> Config:
        """``cfg`` with its rows a batch as a batch size (what `bench.packing` takes)."""
        return dataclasses.replace(cfg, batch_size=self.rows(cfg), max_tokens=None)

    def check(self, cfg, data):
        self.check_model(cfg.model)
        self.check_devices(cfg.devices)
        if importlib.util.find_spec("grain") is None:
            raise px.OptionError("--strategies pack: expected Grain to be installed (pip install "
                                 "'polyexec[bench]', Python >= 3.11), received no 'grain' "
                                 "module")

    def row_sizes(self, cfg):
        return [self.rows(cfg)]

    def schedule(self, cfg, data, policy):
        """Every epoch's packed batches as the example indices each holds (packing order)."""
        from .packing import pack_epoch
        return [[np.asarray([i for row in b.examples for i in row], np.int64)
                 for b in pack_epoch(self.packed_config(cfg), data, epoch)]
                for epoch in range(cfg.epochs)]

    def padded_shape(self, cfg, policy, rows, longest):
        return self.rows(cfg), cfg.cap

    def prepare(self, cfg, data, step, files):
        return PackRun(self.packed_config(cfg), data, step)

    def summary_line(self, row, polyexec, extra):
        return (f"polyexec vs pack: {polyexec['tokens_per_s_warm'] / row['tokens_per_s_warm']:.2f}x "
                f"warm, {polyexec['tokens_per_s_cold'] / row['tokens_per_s_cold']:.2f}x cold "
                f"(polyexec / pack real tokens/s); pack: {extra.get('steps', '?')} steps of "
                f"packed rows, row efficiency {row['padding_efficiency']:.3f}")


@register
@dataclasses.dataclass(frozen=True)
class PolyexecPack(Strategy):
    """polyexec with ``layout="pack"``: the model exactly as ``polyexec`` runs it (no segment
    ids, no masks), its sequences packed first-fit into rows of the cap by
    `buckets.packed_batch_plan`, the same tokens a step as ``pack``: one compile. The
    executor's rewrite keeps the sequences of a row apart."""

    token: ClassVar[str] = "polyexec-pack"
    usage: ClassVar[str] = "polyexec-pack"
    description: ClassVar[str] = ("polyexec, layout='pack': the unchanged model over rows "
                                  "of the cap packed first-fit (one compile)")
    batching: ClassVar[str] = "packed"
    hand_masked: ClassVar[bool] = False

    @staticmethod
    def budget(cfg: Config) -> int:
        return Pack.rows(cfg) * cfg.cap          # the tokens of one of pack's batches

    def row_lengths(self, cfg: Config) -> list[int]:
        # Rows of the cap, as the peer packs: a quarter of the cap besides (each example in
        # the shortest row that holds it) filled 0.65 of the cells against 0.98 and ran 0.42x
        # the peer warm (pydoc default, --steps 30). Row lengths chosen by cost are not built.
        return [cfg.cap]

    def row_sizes(self, cfg):
        return sorted({max(1, self.budget(cfg) // n) for n in self.row_lengths(cfg)})

    def schedule(self, cfg, data, policy, room: int = 0):
        """Each epoch's packed steps; ``room``: the cells the step's packed program needs
        after each example (`Plan.packing_room`), counted as the executor packs them."""
        return [buckets.packed_batch_plan(data.padded_lengths, self.row_lengths(cfg),
                                          max_tokens=self.budget(cfg), seed=cfg.seed,
                                          epoch=epoch, room=room)
                for epoch in range(cfg.epochs)]

    def padded_shape(self, cfg, policy, rows, longest):
        n = _bucket(self.row_lengths(cfg), max(longest, MIN_T))
        return max(1, self.budget(cfg) // n), n

    def prepare(self, cfg, data, step, files):
        lengths = self.row_lengths(cfg)
        T = px.LengthVar("T", min=MIN_T, max=max(lengths))
        B = px.LengthVar("B", max=max(self.budget(cfg) // MIN_T, 1))
        f = px.bucketed(step.fn, in_specs=(None, step.batch_spec(B, T),
                                           px.Spec((B,), jnp.int32, lengths_of=T)),
                        buckets={T: lengths}, name=self.name, layout="pack",
                        pack_rows={n: max(1, self.budget(cfg) // n) for n in lengths})
        room = f.plan_for(step.state).packing_room
        return PackedBucketedRun(cfg, data, step, f, self.schedule(cfg, data, None, room),
                                 lengths)


def bucketed_update(step: Step, f, state, tokens, lengths):
    """``(loss, new state)`` of one batch of ``tokens`` through the bucketed step ``f``. A
    bucketed step returns a module's Python scalars (an equinox Dropout's p) as arrays, as
    jax.jit does; fed back, they would be traced (and Dropout branches on p): the state keeps
    its own non-array leaves."""
    return step_result(step, f(state, step.batch(tokens), lengths), state)


def step_result(step: Step, output, state):
    """``(loss, new state)`` of a bucketed step's ``output`` on ``state`` (see
    `bucketed_update`)."""
    loss, new = step.loss_and_state(output, state)
    return loss, jax.tree_util.tree_map(lambda old, x: x if eqx.is_array(old) else old,
                                        state, new)


def batch_arrays(data: Data, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A polyexec step's ``(tokens, lengths)`` for these examples, padded to their longest."""
    longest = max(int(data.lengths[indices].max()), MIN_T)
    return data.tokens[indices, :longest], data.lengths[indices].astype(np.int32)


def step_arguments(step: Step, data: Data, indices: np.ndarray) -> tuple[Any, np.ndarray]:
    """``step``'s ``(batch, lengths)`` for these examples (`batch_arrays`, in its form)."""
    tokens, lengths = batch_arrays(data, indices)
    return step.batch(tokens), lengths


class PackedBucketedRun(Run):
    """`PolyexecPack`'s worker, and ``polyexec``'s when it chose to pack: each batch's
    examples (padded to its longest, as any polyexec batch) through the packed
    ``px.bucketed`` step."""

    batching = "packed"

    def __init__(self, cfg: Config, data: Data, step: Step, f, epochs, row_lengths, *,
                 auto_choice: dict | None = None, first_steps: tuple = ()):
        self.cfg, self.data, self._step, self.f = cfg, data, step, f
        self.epochs, self.row_lengths, self.auto_choice = epochs, row_lengths, auto_choice
        self.state = step.state
        # (batch, output) of the first epoch's first batches, run (and timed) one after
        # another while choosing the layout: the epoch starts with them (`epoch_plan`), and
        # the run goes on from their outputs.
        self._first_steps = list(first_steps)

    def real_tokens(self, batch):
        return super().real_tokens(batch.indices)

    def predictions(self, batch):
        return super().predictions(batch.indices)

    def own_shape(self, batch):
        return batch.rows, batch.row_length

    def step(self, state, batch):
        if self._first_steps and self._first_steps[0][0] is batch:
            loss, state = step_result(self._step, self._first_steps.pop(0)[1], state)
        else:
            loss, state = bucketed_update(self._step, self.f, state,
                                          *batch_arrays(self.data, batch.indices))
        return loss, state, (batch.rows, batch.row_length)

    def summary(self, events):
        return {"compiles": self.f.stats.compiles - events.cache_hits, "traces": self.f.traces,
                "compile_s": self.f.stats.compile_seconds,
                "plan_seconds": dict(self.f.plan.seconds), "bucket_count": len(self.row_lengths),
                "buckets": list(self.row_lengths), "partial_rows": [], "auto": self.auto_choice,
                "upgraded_batches": 0, "warmup": None}


# ------------------------------------------------------------------------------- parsing


def strategies_help() -> str:
    """The ``--strategies`` choices, for ``--help``."""
    return "; ".join(f"{cls.usage}: {cls.description}" for cls in REGISTRY.values())


def _split(text: str) -> list[tuple[str, str, tuple[int, ...] | None]]:
    """``"a,b:1,2,c"`` -> [(token text, name, args)]: bare integers after ``name:N`` are more of
    its arguments."""
    out: list[list] = []
    for raw in text.split(","):
        token = raw.strip()
        if not token:
            raise px.OptionError(f"--strategies: expected a strategy between every two commas, "
                                 f"received an empty entry in {text!r}")
        if token.isdigit() and out and out[-1][2] is not None:
            out[-1][2].append(int(token))
            out[-1][0] += f",{token}"
            continue
        name, colon, first = token.partition(":")
        args = None
        if colon:
            first = first.strip()
            if not first.isdigit():
                raise px.OptionError(f"--strategies: {name} sizes: expected integers (e.g. "
                                     f"fixed:16,64,256,1024), received {first!r} in {token!r}")
            args = [int(first)]
        out.append([token, name, args])
    return [(t, n, tuple(a) if a is not None else None) for t, n, a in out]


def parse_strategy(text: str) -> Strategy:
    """One strategy from its name: ``"pad-max"``, ``"fixed:8,32"``.

    >>> parse_strategy("fixed:32,8")
    FixedSizes(sizes=(8, 32))
    """
    (token, name, args), *rest = _split(text)
    if rest:
        raise px.OptionError(f"--strategies: expected one strategy, received {text!r}")
    cls = REGISTRY.get(name)
    if cls is None:
        raise px.OptionError(f"--strategies: expected one of "
                             f"{', '.join(c.usage for c in REGISTRY.values())}; "
                             f"received unknown strategy {token!r}")
    return cls.from_args(args)


def parse_strategies(text: str) -> list[Strategy]:
    """``"pad-max,exact,fixed:16,32,64,polyexec"``: bare integers after ``fixed:`` are its sizes.
    Each strategy once; one that ``requires`` another runs after it.

    >>> parse_strategies("fixed:8,32")[0].sizes
    (8, 32)
    """
    out = []
    for token, name, args in _split(text):
        cls = REGISTRY.get(name)
        if cls is None:
            raise px.OptionError(f"--strategies: expected one of "
                                 f"{', '.join(c.usage for c in REGISTRY.values())}; "
                                 f"received unknown strategy {token!r}")
        out.append(cls.from_args(args))
    names = [s.name for s in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise px.OptionError(f"--strategies: expected each strategy once, received "
                             f"{', '.join(sorted(dup))} given twice")
    for s in out:
        if s.requires is not None and s.requires not in names:
            raise px.OptionError(f"--strategies: expected {s.requires} beside {s.name} (which "
                                 f"needs what {s.requires} leaves behind; list {s.requires} too), "
                                 f"received {s.name} alone")
    # A strategy that needs another's results runs after it.
    out.sort(key=lambda s: s.requires is not None)
    return out


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


# ------------------------------------------------------------------------------- choosing buckets


def choose_auto(cfg: Config, data: Data, step: Step, f, path: str, layout: str, *,
                data_parallel=None):
    """``--buckets auto``: `polyexec.training.choose_layout` -- compile and time ``f`` once
    (packed when its plan can pack and ``layout`` allows, else at the largest length's full
    batch), price pad (`buckets.Auto.fit`) and pack for ``cfg.epochs`` epochs, and pin the
    cheaper; returns (the `LayoutChoice`, the choice as a dict: layout, measured cost,
    predictions).

    The first grouped worker of a run writes its choice to ``path`` and the later ones reuse
    it (``known=``), so they compare on the same layout and buckets: ``polyexec-cached`` (the
    same job run again -- timed on a cache hit, a compile would look nearly free) and
    ``polyexec-nomask`` (which cannot pack: after a packed choice it chooses its own buckets).
    """
    known = saved = None
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            saved = json.load(fh)
        if saved["layout"] == "pad":
            known = {"layout": "pad",
                     "policy": buckets.Auto(tuple(saved["sizes"]), tuple(saved["partial_rows"]))}
        elif layout != "pad":
            known = saved
        saved = dict(saved, reused=True) if known is not None else None
    # In the background the other compiles overlap training: on 2 cores their wall cost
    # was 1/2-2/3 of their compile seconds. Parallel threads (--warmup blocking) gained
    # nothing there: fit's 18 compiles took 23.6 s wall on 2 threads, ~24.5 s at the
    # rate of one compile alone.
    overlap = 2 if cfg.warmup == "background" and (os.cpu_count() or 1) >= 2 else 1
    # The timed calls are the run's first packed batches; the run goes on from their outputs.
    choice = choose_layout(f, step.state, data.padded_lengths, epochs=cfg.epochs,
                           batch_size=cfg.batch_size, max_tokens=cfg.max_tokens, layout=layout,
                           seed=cfg.seed, min_length=MIN_T, parallel=overlap, known=known,
                           data_parallel=data_parallel,
                           examples=lambda indices: step_arguments(step, data, indices),
                           batch_of=lambda rows, length: step.batch(
                               np.zeros((rows, length), np.int32)),
                           next_arg=lambda output: step_result(step, output, step.state)[1])
    if saved is None:
        saved = {"layout": choice.layout, "reason": choice.reason,
                 "cost": dataclasses.asdict(choice.cost) if choice.cost else None,
                 "predicted": choice.prediction._asdict(),
                 "predicted_padding_efficiency": choice.prediction.padding_efficiency,
                 "predicted_pad": choice.pad._asdict() if choice.pad else None,
                 "predicted_pack": choice.pack._asdict() if choice.pack else None,
                 # The steps the timed calls ran (real batches kept as the run's first).
                 "timed_steps": len(getattr(choice, "first_steps", ()))}
        if choice.layout == "pad":
            saved.update(sizes=list(choice.buckets.policy.sizes),
                         partial_rows=list(choice.buckets.policy.partial_rows))
        else:
            saved.update(row_lengths=list(choice.row_lengths),
                         pack_rows={str(k): v for k, v in choice.pack_rows.items()},
                         max_tokens=choice.max_tokens)
        if not os.path.exists(path):
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(saved, fh)
    return choice, saved


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
        loss, state = self.step.loss_and_state(
            self.step.fn(eqx.combine(params, self._static), self.step.batch(tokens), lengths),
            params)
        # Arrays only, filtered here: jit would return a module's Python scalars (an equinox
        # Dropout's p) as arrays, and the next call's arguments would not match the compiled.
        return loss, eqx.filter(state, eqx.is_array)

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
        return executable(state, tokens, lengths)


def padded_batch(data: Data, idx: np.ndarray, rows: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """Examples ``idx`` as a (rows, t) token array and (rows,) lengths; extra rows have length 0."""
    return (px.pad_to(data.tokens[idx, :t], (rows, t), 0),
            px.pad_to(data.lengths[idx], (rows,), 0, np.int32))


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


def bucketed_step(strategy: Strategy, cfg: Config, step: Step, policy, layout: str = "pad",
                  data_parallel=None):
    """``step`` through ``px.bucketed`` with the strategy's (B, T) buckets; with a
    ``data_parallel`` mesh, the state replicated and the rows split over it (fit's
    ``shardings``)."""
    rows = strategy.row_sizes(cfg)
    dp = data_parallel if data_parallel is not None and data_parallel.mesh is not None else None
    shardings = None if dp is None else (dp.replicated, dp.batch, dp.batch)
    T = px.LengthVar("T", min=MIN_T, max=max(policy.sizes))
    # Packed, B counts sequences: as many as the largest grid holds of the shortest.
    B = px.LengthVar("B", max=max(rows) * (1 if layout == "pad" else T.max // MIN_T))
    return px.bucketed(step.fn, in_specs=(None, step.batch_spec(B, T),
                                          px.Spec((B,), jnp.int32, lengths_of=T)),
                       buckets={T: list(policy.sizes), B: rows}, name=strategy.name,
                       masking=getattr(strategy, "masking", True), layout=layout,
                       in_shardings=shardings)


def _combos_by_benefit(run: "BucketedRun") -> list[Shape]:
    """The (B, T) buckets a run uses, those that will carry the most real tokens first."""
    tokens: dict[Shape, int] = {}
    for ep in run.epochs:
        for idx in ep:
            shape = run.own_shape(idx)
            tokens[shape] = tokens.get(shape, 0) + int(run.data.lengths[idx].sum())
    return sorted(tokens, key=lambda shape: -tokens[shape])


class BucketedRun(Run):
    """Batches of example indices through ``px.bucketed`` at the strategy's buckets.

    ``warmup``: None (compile on first use), ``"blocking"`` (every (B, T) bucket compiled before
    the first step, on parallel threads) or ``"background"`` (`BackgroundWarmup`).
    """

    def __init__(self, strategy: Strategy, cfg: Config, data: Data, step: Step, policy,
                 epochs: list[list[np.ndarray]], *, f=None, rows_buckets=None,
                 warmup: str | None = None, auto_choice: dict | None = None):
        self.strategy, self.cfg, self.data, self.policy = strategy, cfg, data, policy
        self.epochs, self.warmup, self.auto_choice = epochs, warmup, auto_choice
        self._step = step
        self.f = f if f is not None else bucketed_step(strategy, cfg, step, policy)
        self.rows_buckets = rows_buckets or strategy.row_sizes(cfg)
        self.state = step.state
        self.upgraded = 0
        self._warm: BackgroundWarmup | None = None

    def own_shape(self, idx):
        return self.strategy.padded_shape(self.cfg, self.policy, len(idx),
                                          int(self.data.lengths[idx].max()))

    def start_epoch(self, epoch):
        if epoch != 0 or self.warmup is None:
            return
        combos = _combos_by_benefit(self)
        if self.warmup == "blocking":
            # Every (B, T) bucket this run uses, compiled before the first step on parallel
            # threads: part of the cold epoch's time.
            self.f.warmup(self._step.state, sizes=[{"B": b, "T": t} for b, t in combos])
        else:
            self._warm = BackgroundWarmup(self.f, (self._step.state,), combos)

    def step(self, state, idx):
        data = self.data
        longest = max(int(data.lengths[idx].max()), MIN_T)
        rows, t = own = self.own_shape(idx)
        if self._warm is not None:
            rows, t = self._warm.shape_for(rows, t)
            self.upgraded += (rows, t) != own
        # Without the rewrite (polyexec-nomask) px runs a batch's rows as given, adding none:
        # the filler rows its shape needs are the bench's own, of length 0 (its hand-masked
        # loss is a mean over tokens, which they do not change).
        if (not self.f.masking or (rows, t) != (_bucket(self.rows_buckets, len(idx)),
                                                _bucket(self.policy.sizes, longest))):
            tokens, lengths = padded_batch(data, idx, rows, t)
        else:   # the bucket px picks for the unpadded batch: it pads to it itself
            tokens = data.tokens[idx, :longest]
            lengths = data.lengths[idx].astype(np.int32)
        loss, state = bucketed_update(self._step, self.f, state, tokens, lengths)
        if self._warm is not None:
            self._warm.mark_ready((rows, t))
        return loss, state, (rows, t)

    def end_epoch(self, epoch):
        if self._warm is not None:
            self._warm.join()          # the cold epoch includes every compile; warm epochs none
            self._warm = None

    def summary(self, events):
        grouped = self.warmup is not None
        return {
            # A persistent-cache hit builds the executable without running XLA: not a compile.
            "compiles": self.f.stats.compiles - events.cache_hits,
            "traces": self.f.traces, "compile_s": self.f.stats.compile_seconds,
            "plan_seconds": dict(self.f.plan.seconds),
            "bucket_count": len(self.policy.sizes), "buckets": list(self.policy.sizes),
            "partial_rows": list(getattr(self.policy, "partial_rows", ())),
            "auto": self.auto_choice,    # --buckets auto: the measured cost and the prediction
            "upgraded_batches": self.upgraded,
            "warmup": self.warmup if grouped else None,
        }


class ExactRun(Run):
    """Random batches through `ExactJit`, each at its exact shape (rows padded to the batch
    size)."""

    def __init__(self, strategy: Strategy, cfg: Config, data: Data, step: Step,
                 epochs: list[list[np.ndarray]]):
        self.strategy, self.cfg, self.data, self.epochs = strategy, cfg, data, epochs
        self.exact = ExactJit(step)
        self.state = self.exact.state

    def own_shape(self, idx):
        return self.strategy.padded_shape(self.cfg, None, len(idx),
                                          int(self.data.lengths[idx].max()))

    def step(self, state, idx):
        rows, t = self.own_shape(idx)
        loss, state = self.exact(state, *padded_batch(self.data, idx, rows, t))
        return loss, state, (rows, t)

    def summary(self, events):
        e = self.exact
        return {"compiles": e.compiles, "traces": e.traces, "compile_s": e.compile_seconds,
                "bucket_count": e.compiles, "buckets": None, "partial_rows": [], "auto": None,
                "upgraded_batches": 0, "warmup": None}


class PackRun(Run):
    """`Pack`'s worker: batches from `bench.packing.iter_pack_epoch` (packed while the epoch
    is timed) through `bench.packing.PackedStep` (one compile, its seconds measured).
    ``cfg``: the packed config (`Pack.packed_config`)."""

    def __init__(self, cfg: Config, data: Data, step: Step):
        from .packing import build_packed_step
        self.cfg, self.data = cfg, data
        # --devices N: the rows of each batch split over fit's Mesh (whole rows a device).
        dp = data_parallel_for(cfg.devices) if cfg.devices > 1 else None
        self.packed = build_packed_step(cfg, state=step.state,   # the run's initial weights
                                        data_parallel=dp)
        self.state = self.packed.state

    def batch_count(self):
        return None        # known once Grain has packed the epoch

    def batches(self, epoch):
        from .packing import iter_pack_epoch
        return iter_pack_epoch(self.cfg, self.data, epoch)

    def real_tokens(self, batch):
        return batch.real_tokens

    def predictions(self, batch):
        return batch.predictions        # what packed_loss_and_count counts

    def own_shape(self, batch):
        return batch.tokens.shape

    def step(self, state, batch):
        loss, state = self.packed(state, batch)
        return loss, state, batch.tokens.shape

    def summary(self, events):
        p = self.packed
        return {"compiles": p.compiles, "traces": p.traces, "compile_s": p.compile_seconds,
                "bucket_count": 1, "buckets": [self.cfg.cap], "partial_rows": [], "auto": None,
                "upgraded_batches": 0, "warmup": None}


def run_strategy(strategy: Strategy, cfg: Config, files: Files = Files()) -> dict:
    """Run ``strategy`` for every epoch in this process; return its measurements.

    Besides the timings, each epoch's mean loss: summed nats over the predictions of the whole
    epoch (each batch's mean loss times its predictions, summed, over the epoch's predictions)
    -- the same number however the epoch's examples were batched, so strategies that batch
    differently (``pack``'s fewer, larger batches; polyexec's grouped ones) compare at equal
    data. Losses are read and counted after the epoch's clock stops.
    """
    data = load_data(cfg)
    run = strategy.prepare(cfg, data, build_step(cfg, files.state_file,
                                                 masked=strategy.hand_masked), files)
    emit("start", strategy=strategy.name, total=run.batch_count())
    state = run.state
    real = padded = done = 0
    shapes: set[Shape] = set()
    epoch_seconds, epoch_tokens, losses, epoch_loss = [], [], [], []
    with px.count_compiles() as counter:
        for e in range(cfg.epochs):
            start = time.perf_counter()
            run.start_epoch(e)
            loss, ran = None, []
            for batch in run.batches(e):
                loss, state, shape = run.step(state, batch)
                ran.append((batch, shape, loss))
                done += 1
                emit("step", strategy=strategy.name, done=done)
            run.end_epoch(e)
            jax.block_until_ready((loss, state))
            epoch_seconds.append(time.perf_counter() - start
                                 + (run.setup_seconds if e == 0 else 0.0))
            # Untimed: what the epoch computed (a transfer of the losses, no compile).
            nats, count = 0.0, 0
            for (batch, (rows, t), _), value in zip(ran, jax.device_get([r[2] for r in ran])):
                n = run.predictions(batch)
                nats, count = nats + float(value) * n, count + n
                real += run.real_tokens(batch)
                padded += rows * t
                shapes.add(run.own_shape(batch))
            epoch_loss.append(nats / max(count, 1))
            epoch_tokens.append(data.real_tokens)
            losses.append(float(loss))
    events = counter.counts()
    own = run.summary(events)
    warm_tokens, warm_seconds = sum(epoch_tokens[1:]), sum(epoch_seconds[1:])
    return {
        "strategy": strategy.name,
        # The devices the trained state lives on after the last step (--devices N: all N).
        "devices": len({d for leaf in jax.tree_util.tree_leaves(eqx.filter(state, eqx.is_array))
                        for d in leaf.sharding.device_set}),
        "batching": getattr(run, "batching", strategy.batching),
        "compiles": int(own["compiles"]),
        "traces": int(own["traces"]),
        "compile_s": float(own["compile_s"]),
        "padding_efficiency": real / padded,
        "tokens_per_s_cold": epoch_tokens[0] / epoch_seconds[0],
        "tokens_per_s_warm": warm_tokens / warm_seconds,
        "peak_rss_mb": peak_rss_mb(),
        # extras for the table and the plot (not part of the JSON results)
        "bucket_count": int(own["bucket_count"]),
        "buckets": own["buckets"],
        "partial_rows": own["partial_rows"],
        "auto": own["auto"],
        "choosing_seconds": run.setup_seconds,
        "plan_seconds": own.get("plan_seconds"),
        "cache_hits": events.cache_hits,
        "backend_compiles": events.backend_compiles,
        "upgraded_batches": own["upgraded_batches"],
        "warmup": own["warmup"],
        "distinct_shapes": len(shapes),
        "steps": done,
        "epoch_seconds": epoch_seconds,
        "final_loss": losses[-1],
        "epoch_loss": epoch_loss,
    }


def limit_shapes(cfg: Config, data: Data) -> list[dict]:
    """The shapes the limit is timed at: one or two per length group.

    The examples are split into groups by ``Optimal.fit`` (``cfg.buckets`` or 8 groups: tight
    length ranges); a group of n examples with mean length m is replaced by batches all of
    length m -- every row real, the same real tokens -- of ``rows`` examples (``--batch-size``,
    or what ``--max-tokens`` allows at the group's bucket), and with ``--batch-size`` also of
    as many examples as a batch of the cap holds tokens, ``batch_size * cap // m``
    (``budget_rows``; ``rows`` when that is not more): packed rows hold that many tokens a
    step, and a larger step costs less per token, so a limit timed at ``--batch-size`` rows
    alone is beaten by packing.
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
        budget = cfg.batch_size * cfg.cap // mean if cfg.batch_size else rows
        groups.append({"bucket": int(size), "length": mean, "rows": int(rows),
                       "budget_rows": int(max(budget, rows)),
                       "examples": int(members.size),
                       "real_tokens": int(data.lengths[members].sum()),
                       "members": members})
    return groups


def run_limit(cfg: Config, state_file: str | None = None, *, cache_dir: str | None = None,
              name: str = "limit") -> dict:
    """One pass of the limit: the same step, every row real, nothing compiled while timed.

    Per length group (`limit_shapes`) the step is compiled with plain jax.jit at each of the
    group's shapes, (rows, the group's mean length) and (budget rows, the same length), and
    called once untimed; then ``cfg.limit_rounds`` chunks of n calls are dispatched back to
    back (as an epoch's steps are) and blocked on, n chosen so that the chunks last about
    ``cfg.limit_seconds`` together. The fastest chunk gives the shape's rate (rows x length /
    seconds per step): other processes on the machine only ever slow a chunk down, so the
    fastest is the closest to what the step costs. The group's rate is its faster shape's:
    the fastest all-real step measured. ``combine_limits`` turns the group rates into one
    limit.

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
        shapes = []
        for rows in dict.fromkeys((g["rows"], g["budget_rows"])):
            timed, state = _time_limit_shape(cfg, data, step, state, g["members"], rows,
                                             g["length"])
            shapes.append(timed)
        best = max(shapes, key=lambda sh: sh["tokens_per_s"])
        out_groups.append({k: v for k, v in g.items() if k != "members"} | best |
                          {"shapes": shapes})
        emit("step", strategy=name, done=i + 1)
    return {"strategy": name, "groups": out_groups,
            "limit_tokens_per_s": combine_limits([out_groups], data.real_tokens)[0],
            "peak_rss_mb": peak_rss_mb(), "jax": jax.__version__,
            "device": f"{jax.devices()[0].platform}: {jax.devices()[0].device_kind}, "
                      f"{os.cpu_count()} CPU(s)"}


def _time_limit_shape(cfg: Config, data: Data, step, state, members, rows: int, t: int):
    """One limit shape timed (see `run_limit`): its numbers, and the state it leaves."""
    # Bytes of this group's own examples (the values do not change the cost: the step has no
    # data-dependent control flow); every row is real: lengths = t.
    tokens = data.tokens[np.resize(members, rows), :t]
    lengths = np.full(rows, t, np.int32)

    def chunk(n, state):
        start = time.perf_counter()
        for _ in range(n):
            loss, state = step(state, tokens, lengths)
        jax.block_until_ready((loss, state))
        return time.perf_counter() - start, state

    compiled_before = step.compile_seconds
    _, state = chunk(1, state)                      # compile + first run: not timed
    compile_s = step.compile_seconds - compiled_before
    budget = cfg.limit_seconds / cfg.limit_rounds
    n, (elapsed, state) = 1, chunk(1, state)
    while elapsed < budget and n < 4096:            # calibrate the chunk length
        n *= 2
        elapsed, state = chunk(n, state)
    per_step = [elapsed / n]
    for _ in range(cfg.limit_rounds - 1):
        elapsed, state = chunk(n, state)
        per_step.append(elapsed / n)
    best = min(per_step)
    return {"rows": rows, "calls_per_chunk": n, "seconds_per_step": best, "compile_s": compile_s,
            "seconds_per_step_all": per_step, "tokens_per_s": rows * t / best}, state


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
        result = run_strategy(parse_strategy(job["strategy"]), cfg,
                              Files(state_file=job.get("state_file"),
                                    cache_dir=job.get("cache_dir"),
                                    choice_file=job.get("choice_file")))
    emit("result", result=result)
    return 0
