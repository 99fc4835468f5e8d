"""`fit`: the training loop over bucketed train and eval steps.

In the order a run goes through them: `FitOptions` checks the arguments; `_prepare` builds
the immutable `_Run` (data, buckets, devices, the two compiled steps); `_restore` resumes from
the newest checkpoint; `_warmup` compiles every bucket the data uses; `_train_epoch` runs one
epoch of `_train_step` and writes the epoch record (`_records`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import inspect
import os
import time
import typing
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
import rich.console

import buckets as _buckets

from .. import Bucketed
from .._cache import count_compiles, enable_persistent_cache
from .._errors import OptionError, PolyexecError, PolymorphismError, check_int, is_int
from ._checkpoint import (checkpoint_dir_lock, latest_checkpoint, list_checkpoints,
                          load_checkpoint, read_meta, save_checkpoint)
from ._auto import choose_buckets, choose_layout, rebucket
from ._data import Batching, Examples, PackedBatching, as_examples
from ._several import JointBatching, JointPackedBatching, choose_several, several_policies
from ._options import FitOptions, check_callable
from ._outputs import check_output_dir, check_output_file
from ._parallel import DataParallel, data_parallel
from ._progress import RunDisplay
from ._records import MetricsLog, Position, epoch_record, step_record, warmup_record
from ._state import TrainState, copy_arrays, place
from ._data import pad_batch
from ._steps import EvalFn, LossFn, as_loss_call, check_loss, make_eval_step, make_train_step


class StopTraining(Exception):
    """Raise from a callback to end `fit` cleanly after the current step (a checkpoint is
    written first when ``checkpoint_dir`` is set)."""


class NonFiniteError(PolyexecError, FloatingPointError):
    """A train step's loss or gradient was not finite (``on_nonfinite="stop"``, the default).

    The step was not applied and nothing was checkpointed after the step before it. ``step``
    (1-based, counted over the whole run, as a step record's ``step``), ``epoch`` (0-based),
    ``indices`` (the examples of the batch, indices into ``data``; across processes this
    process's share), ``loss`` and ``grad_norm`` say where and what; ``checkpoint`` is the last
    one written (None when none was)."""

    def __init__(self, message: str, *, step: int, epoch: int, indices: Sequence[int],
                 loss: float, grad_norm: float, checkpoint: str | None):
        super().__init__(message)
        self.step, self.epoch, self.indices = step, epoch, list(indices)
        self.loss, self.grad_norm, self.checkpoint = loss, grad_norm, checkpoint


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What a callback sees after each train step. ``state`` is valid until the next step,
    which donates its buffers: copy what you keep (``jax.tree_util.tree_map(jnp.copy, ...)``)."""

    step: int                  # steps done in the whole run (resumes included)
    epoch: int                 # 0-based
    position: int              # batches done in this epoch
    loss: float
    bucket: tuple[int, ...]    # (B, T) the step ran at; (B, *sizes) for several lengths
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
    partial_rows: Any = "full"     # the buckets whose partial batch ran at its own rows
    prediction: Any = None         # buckets="auto": the predicted cost (`buckets.Prediction`)
    layout: str = "pad"            # "pack": several examples a row (see fit's ``layout``)

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


def fit(model: Any, loss_fn: LossFn, data: Sequence[Any], *,
        optimizer: optax.GradientTransformation, validation: Sequence[Any] | None = None,
        eval_fn: EvalFn | None = None, **options: Any) -> FitResult:
    """Train an equinox model with an optax optimiser through bucketed, compiled-once steps.

    The keyword options (``epochs=1``, ``batch_size``, ``max_tokens``, ``buckets``,
    ``min_length=2``, ``pad_id=0``, ``seed=0``, ``shuffle=True``, ``devices``, ``cache``,
    ``warmup=True``, ``warmup_workers``, ``checkpoint_dir``, ``checkpoint_every``,
    ``keep_checkpoints=3``, ``resume=True``, ``max_steps``, ``metrics_file``, ``callbacks``,
    ``progress``, ``verbose=True``, ``console``, ``masking=True``, ``layout="auto"``,
    ``train_on_padding=False``, ``specs=None``, ``on_nonfinite="stop"``, ``has_aux=False``)
    are the fields of `FitOptions`, declared and checked there; what they do is below.

    ``data`` (and ``validation``) is a sequence of variable-length examples, each a pytree of
    arrays of one structure (``{"tokens": (T,) int, "label": () int, "tags": (T,) int}``) or,
    the one-field case, a 1-D integer array (or ``bytes``). A leaf's axes are named once, by
    default from the data: its first axis is the example's length ``T`` when its size varies
    across the examples, its other axes and the leaves that do not vary are fixed sizes, a
    scalar is one value per example; ``specs`` declares them with ``px.Spec`` (a pytree of
    Specs without the batch axis, a dict naming some keys only, ``"T"`` the length: e.g.
    ``specs={"pair": px.Spec("T T")}``; ``pad``: what padding holds, else ``pad_id``). Each
    epoch groups the examples into batches whose lengths fall in one bucket
    (`buckets.batch_plan`, shuffled deterministically from ``(seed, epoch)``) of ``B`` rows —
    ``batch_size``, or with ``max_tokens`` the largest power of two with ``B*T <= max_tokens``
    for the bucket's ``T`` — and runs ``loss_fn(model, batch) -> scalar`` through
    `make_train_step` (``jax.value_and_grad`` + ``optimizer.update``, state donated): the batch
    is the examples' pytree with a leading ``B``, every ``T`` axis padded. ``loss_fn`` asks for
    more by its parameters' names (`as_loss_call`): ``lengths`` receives the real lengths
    ``(B,)`` int32, and ``key`` a typed PRNG key of its own each step,
    ``jax.random.fold_in(step_keys(seed)[0], step)`` (the step counted over the whole run,
    resumes included: a resumed run draws the keys an uninterrupted one does). The one-field
    case keeps the shorthand ``loss_fn(model, tokens (B, T) int32, lengths (B,) int32)``: a
    third positional parameter receives the lengths, whatever its name. Examples of several
    lengths (an encoder-decoder's ``{"src": (S,), "tgt": (T,)}``: leaves whose sizes differ
    across the examples, or ``specs`` naming several) batch by a bucket of each length
    (``buckets``: ``"auto"``, an int K for K each, or a dict naming each length's), pack an
    example's sequences into the same row of every length's rows, and give ``lengths`` as
    ``{name: (B,)}``; they train on one process (any number of its devices) --
    `polyexec.training._several`. A batch reaches the
    step stacked to its own longest example, and the executor pads it to the bucket, so
    ``train_step.stats`` count the padding. The executor's logical-length rewrite makes plain,
    unmasked code exact on the padded batch (each example computed at its own length, a mean
    over the rows counting the real ones); ``masking=False`` turns it off for a loss that
    masks by ``lengths`` itself: then no row is added to a batch (a partial batch runs at its
    own rows, one more compiled shape), and a run over several devices is refused (they would
    add rows of length 0, which such a loss counts as examples).

    Never on padding: a step the rewrite cannot keep padding out of is refused before either
    step compiles, with a `px.PolymorphismError` quoting the plan's verdict (naming your line):
    one that is not padding-safe (``plan.padding_reason``: an operation on a length axis with
    no rule, such as random draws shaped by the length), or one that is reshaping-impossible
    (``plan.reason``: retraced per bucket, it would run on the padded batch as written). At
    ``min_length=1`` a next-token loss slicing ``tokens[:, 1:]`` trains exactly (traced at
    ``T >= 2``, which JAX's rule needs, a one-token row adding no prediction); a loss that
    needs a longer minimum than polyexec raises by itself (``tokens[:, 10:]``: ``T >= 11``)
    is refused, and the error says which ``min_length`` to pass. ``train_on_padding=True`` trains
    such a step anyway, with the executor's one warning, padding possibly changing the loss
    and its gradients. With ``masking=False`` the loss masks the padding itself, as you said,
    and nothing is refused.

    Buckets: ``buckets="auto"`` (or None, the default) compiles and times the step once at the
    largest bucket, then chooses the (length x rows) set with the least predicted time for the
    epochs to run (`buckets.Auto.fit`: padded cells x step cost + compiles x compile cost; a
    bucket's partial last batch gets its own rows when that pays) and prints it with its
    prediction. The choice depends on measured times; ``buckets=result.policy`` of a finished
    run repeats it exactly. An int K fits K buckets (``buckets.Optimal.fit``), or pass a policy
    (``buckets.Geometric(2, 1024)``) or a list of sizes: their partial batches are padded to
    full rows (an `Auto` policy's own ``partial_rows`` excepted). ``min_length`` (default 2,
    for next-token losses that slice ``tokens[:, :-1]``) is the smallest padded length. Every (rows, length) shape the data uses is compiled before
    the first step (``warmup``) on parallel threads, those carrying the most tokens first.

    Layout: ``layout="auto"`` (the default) also prices packed rows when ``buckets="auto"``
    and the run is one process (on any number of its devices: the rows of a step, a multiple
    of the devices, are split over them, whole rows each): several examples share each row
    (`buckets.packed_batch_plan`, first-fit), rows of the longest bucket ``L``, as few as hold ``batch_size`` examples a
    step on average (an epoch takes as many optimiser steps as padded; with ``max_tokens``,
    ``max_tokens // L`` rows: the same cells a step, so more examples than padded rows hold),
    one compiled shape, and the loss unchanged -- the executor keeps the examples of a row
    apart (`px.bucketed`'s ``layout="pack"``), so they train as if padded. It packs when the
    prediction says packing is faster and both steps can pack (a loss that reads ``lengths``
    cannot: each row holds several); otherwise it pads, and says why. A batch field with two
    length axes (``specs`` ``"T T"``) never packs: ``"auto"`` pads, ``"pack"`` is refused. ``layout="pack"`` packs
    whatever the prediction, ``"pad"`` never packs. ``result.layout`` says which ran.

    Compile cache: ``cache=None`` (default) leaves JAX's process-wide compile-cache
    configuration as it is. ``cache=True`` turns on JAX's persistent compile cache in
    ``$POLYEXEC_CACHE_DIR`` or ``~/.cache/polyexec/xla``, a path in that folder, so a second run
    loads the executables instead of compiling them. ``cache=False`` means "do not turn ours
    on": a cache you configured yourself (``jax.config``, ``JAX_COMPILATION_CACHE_DIR``) stays
    on; ``px.disable_persistent_cache()`` turns it off.

    The loss contract, checked before anything compiles (``jax.eval_shape`` on the first two
    examples): ``loss_fn`` returns a scalar floating-point loss; a vector, an integer or a
    tuple is an `OptionError` naming ``loss_fn``, what it returned (shape and dtype) and what
    is expected. ``has_aux=True``: it returns ``(loss, aux)`` (as ``jax.value_and_grad(...,
    has_aux=True)`` takes it), ``aux`` a pytree of scalars (``{"accuracy": a}``), recorded in
    each step record's ``"aux"`` and, weighted by real tokens as the loss is, in each epoch
    record's ``"aux"`` (and its printed summary).

    The model's state: the optimiser trains the floating-point arrays (of a Flax NNX model its
    ``nnx.Param``s, as ``nnx.Optimizer(..., wrt=nnx.Param)``); what the loss call writes into
    the rest -- an ``nnx.Dropout``'s RNG count, an ``nnx.BatchNorm``'s running statistics,
    computed over the real tokens only, padded or packed -- is carried to the next step as
    ``nnx.jit`` with ``nnx.split``/``nnx.merge`` carries it, and is in ``result.model`` and
    in every checkpoint. Equinox's functional state: pass the ``(model, state)`` pair
    ``eqx.nn.make_with_state`` returns as ``model``, and give ``loss_fn`` a parameter named
    ``state``: it receives the module and the state, returns ``(loss, new_state)``, and the
    new state goes to the next step (``result.model`` is the pair). (The eval step writes
    nothing back: validation changes no state; an ``eval_fn`` asking for ``state`` reads it.)

    Non-finite steps: the train step computes whether its loss and every gradient element are
    finite, and a step that is not is never applied (parameters, optimiser and model state
    stay as they were). ``on_nonfinite="stop"`` (the default) then ends the run with
    `NonFiniteError` naming the step, the epoch and the batch's example indices (``data[i]``),
    having written no checkpoint after the last good step; ``"skip"`` goes on to the next
    batch, the step recorded with ``"skipped": True`` and left out of the epoch's train loss
    (the epoch record counts ``"skipped"``). The flag comes back with the loss, which the loop
    reads every step anyway: no extra device sync.

    Validation: after every epoch, ``eval_fn(model, batch) -> (summed loss, count)`` over
    ``validation`` (exact mean: totals over counts; the same batch form, and ``lengths`` and
    ``key`` by name as for ``loss_fn``, the key ``step_keys(seed)[1]`` every time), or without
    ``eval_fn`` the mean of ``loss_fn`` weighted by real tokens.

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
    arguments everywhere: the mesh spans all processes' devices, each process stacks only its
    share of every global batch (``batch_plan(num_shards=process_count, shard_index=...)``),
    padded to the bucket on the host, and assembles the global batch with
    ``jax.make_array_from_process_local_data``; process 0 writes checkpoints, metrics and output.
    Packed, a step is one grid whose rows (a multiple of every device of the run) are split
    over the devices, whole rows each: every process plans the same global steps
    (`PackedBatching`; ``batch_size`` and ``max_tokens`` per process) and loads only the
    examples packed into its own rows, and the grid is the one a single process would run.

    Metrics: the returned `FitResult` has ``history``, a list of dicts (``kind`` "warmup",
    "step", "epoch"), also appended as JSON lines to ``metrics_file``. Each epoch record has
    train/validation loss, tokens/s, padding efficiency (real tokens / cells of the buckets the
    steps ran at: the train step's ``stats`` over the epoch), compiles and compile seconds,
    and ``elapsed``: the seconds from the call of `fit` (in the process that ran the epoch)
    to the end of its validation -- the time to that validation loss.

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
    ...                       validation=data[:10], verbose=False)
    >>> [r["epoch"] for r in result.epochs()], result.train_step.traces
    ([0, 1, 2], 1)
    >>> result.epochs()[-1]["val_loss"] < result.epochs()[0]["val_loss"]
    True
    >>> def weighted(model, tokens, lengths):     # a triangular solve along T: no rule
    ...     n = tokens.shape[1]
    ...     w = jax.scipy.linalg.solve_triangular(2 * jnp.eye(n), jnp.ones(n), lower=True)
    ...     return loss(model, tokens, lengths) * jnp.mean(w)
    >>> training.fit(eqx.nn.Linear(1, 1, key=jax.random.PRNGKey(0)), weighted, data,
    ...              optimizer=optax.adam(0.05), batch_size=8, buckets=[8, 16, 40], verbose=False)
    Traceback (most recent call last):
    polyexec._errors.PolymorphismError: fit: loss_fn: expected a train step that padding cannot change (padding-safe), received one that is not: <doctest ...>:3: `w = jax.scipy.linalg.solve_triangular(...)`: triangular_solve: no rule for triangular_solve on a length axis...; change that line, ..., or pass train_on_padding=True to train on it anyway

    Any batch: a label per example, no mask, and dropout keyed per step.

    >>> labelled = [{"x": np.full(n, n % 3, np.float32), "label": np.int32(n % 3)}
    ...             for n in range(2, 26)]
    >>> def classify(model, batch, key):          # batch["x"]: (B, T); batch["label"]: (B,)
    ...     x = batch["x"] * jax.random.bernoulli(key, 0.9, batch["x"].shape) / 0.9
    ...     logits = jax.vmap(model)(jnp.mean(x, 1, keepdims=True))   # over each own length
    ...     return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    >>> result = training.fit(eqx.nn.Linear(1, 3, key=jax.random.PRNGKey(0)), classify, labelled,
    ...                       optimizer=optax.adam(0.1), epochs=4, batch_size=8, buckets=[25],
    ...                       verbose=False)
    >>> losses = [r["train_loss"] for r in result.epochs()]
    >>> losses[-1] < losses[0], result.train_step.traces
    (True, 1)
    """
    options = FitOptions.from_kwargs(options)
    _check_outputs(options)
    run = _prepare(loss_fn, data, optimizer, validation, eval_fn, options)
    _check_losses(run, model)
    _configure_cache(options.cache)
    # One writer per checkpoint folder, for this run only: a second run writing there is
    # refused by name instead of racing this one's pruning.
    folder = contextlib.ExitStack()
    if options.checkpoint_dir is not None and run.main:
        folder.enter_context(checkpoint_dir_lock(options.checkpoint_dir))
    with folder:
        # On the caller's own arrays, a second fit (or any use of ``model`` afterwards) would
        # read buffers the steps donated.
        state, position, history, restored = _restore(
            run, TrainState.create(copy_arrays(model), optimizer))
        state = place(state, run.dp.replicated)
        _refuse_padding(run, state, eval_fn)
        run = _settle(run, state, position, restored)
        log = MetricsLog(options.metrics_file if run.main else None, history,
                         restored=position if restored else None)
        run.display.print(run.describe())
        checkpoint, stopped = restored, False
        try:
            if position.epoch < options.epochs:
                if options.warmup:
                    _warmup(run, state, position.step, log)
                run.display.print(run.describe_trace())
            while position.epoch < options.epochs and not stopped:
                state, position, stopped, saved = _train_epoch(run, state, position, log)
                checkpoint = saved or checkpoint
        finally:
            run.display.end_epoch()
            log.close()
    return FitResult(state=state, history=log.history, train_step=run.train_step,
                     eval_step=run.eval_step, policy=run.batching.policy,
                     batch_buckets=run.batch_buckets, checkpoint=checkpoint,
                     stopped_early=stopped,
                     partial_rows=getattr(run.batching.policy, "partial_rows", "full"),
                     prediction=run.prediction, layout=run.layout)


def _signature() -> inspect.Signature:
    """`fit`'s signature: its own parameters, then `FitOptions`' fields as keyword-only
    parameters with their defaults (declared once, there)."""
    own = [p for p in inspect.signature(fit).parameters.values() if p.kind != p.VAR_KEYWORD]
    hints = typing.get_type_hints(FitOptions)
    options = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                 annotation=hints.get(f.name, inspect.Parameter.empty))
               for f in dataclasses.fields(FitOptions)]
    return inspect.signature(fit).replace(parameters=[*own, *options])


fit.__signature__ = _signature()


# -- setting up ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Run:
    """Everything a `fit` run builds before its first step; fixed for the whole run (with
    ``buckets="auto"`` the bucket fields are settled once, after resuming, by `_settle`)."""

    options: FitOptions
    train: Examples
    validation: Examples | None
    batching: Batching | PackedBatching | JointBatching | JointPackedBatching
    dp: DataParallel
    train_step: Bucketed
    eval_step: Bucketed | None
    display: RunDisplay
    auto: bool                          # buckets chosen by predicted cost (buckets="auto")
    # (rows of this process's share, length bucket) -> real tokens of one epoch at that shape
    train_shapes: dict = dataclasses.field(default_factory=dict)
    eval_shapes: dict = dataclasses.field(default_factory=dict)
    prediction: Any = None              # buckets="auto": `buckets.Prediction` of the choice
    # How loss_fn and eval_fn are called (`as_loss_call`), for the contract check.
    loss_call: Any = None
    eval_call: Any = None
    # When `fit` was called: an epoch record's ``elapsed`` counts from here, so the time to a
    # validation loss includes choosing buckets, measuring and compiling, as a user waits it.
    started: float = dataclasses.field(default_factory=time.perf_counter)

    @property
    def main(self) -> bool:
        """Process 0 writes checkpoints, metrics and output."""
        return self.dp.process_index == 0

    @property
    def layout(self) -> str:
        return ("pack" if isinstance(self.batching, (PackedBatching, JointPackedBatching))
                else "pad")

    @property
    def names(self) -> tuple[str, ...]:
        """The names of an example's lengths (``("T",)``, or several)."""
        return self.train.form.lengths

    def sizes(self, shape: tuple[int, ...]) -> dict[str, int]:
        """A batching's ``(rows, *sizes)`` as the steps' global ``{"B": rows, name: size}``."""
        return self.train.form.step_sizes(shape, self.dp.processes)

    def label(self, bucket: tuple[int, ...]) -> str:
        """``B=8 T=64``: a global bucket as the progress bar shows it."""
        return " ".join(f"{n}={v}" for n, v in zip(("B", *self.names), bucket))

    @property
    def used(self) -> tuple:
        """The length buckets the data uses (with several lengths, lists of them)."""
        return _lengths_of({**self.train_shapes, **self.eval_shapes})

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        """Rows of the global batches: every process's share."""
        return tuple(sorted({shape[0] * self.dp.processes
                             for shape in (*self.train_shapes, *self.eval_shapes)}))

    @property
    def fingerprint(self) -> dict:
        """What a checkpoint must match to resume: the data and everything deciding its order
        (auto-chosen buckets travel in the checkpoint itself, see `_settle`)."""
        return {"examples": len(self.train), "lengths": self.train.fingerprint(),
                "buckets": "auto" if self.auto else list(self.used), **self.options.fingerprint}

    def compiles(self) -> tuple[int, float]:
        """Buckets compiled so far by both steps, and their compile seconds."""
        steps = [s for s in (self.train_step, self.eval_step) if s is not None]
        return (sum(s.stats.compiles for s in steps),
                sum(s.stats.compile_seconds for s in steps))

    def describe(self) -> str:
        cache = jax.config.jax_compilation_cache_dir
        mesh = self.dp.mesh is not None
        P = self.dp.processes
        if self.train.form.several:
            b = self.batching
            shape = (("packed rows: " + f"{next(iter(b.pack_rows.values()))} rows of "
                      + " and ".join(f"{L} ({n})" for n, L in zip(b.names, b.row_lengths))
                      + ", several examples a row, an example's sequences in one row")
                     if self.layout == "pack" else
                     "buckets " + ", ".join(f"{n}={s}" for n, s in b.length_buckets.items())
                     + f" | {len(self.train_shapes)} (rows, "
                     + ", ".join(self.names) + ") shapes")
        elif self.layout == "pack":
            shape = ("packed rows: " + ", ".join(f"{r} rows of {n}" for n, r in
                                                 self.batching.pack_rows.items())
                     + ", several examples a row"
                     + (", whole rows on each device" if self.dp.size > 1 else ""))
        else:
            rows = {t: sorted({r * P for r, u in self.train_shapes if u == t})
                    for t in self.used}
            shape = (f"length buckets {list(self.used)} | rows per bucket "
                     + ", ".join(f"T={t}: B={'/'.join(map(str, r)) or self.batching.rows(t) * P}"
                                 for t, r in rows.items()))
        return (f"devices: {self.dp.size} ({jax.devices()[0].platform}"
                + (f", batch axis split over a {self.dp.size}-device mesh" if mesh else "")
                + f") | {shape} | compile cache: {cache or 'off'}")

    def describe_trace(self) -> str:
        plan = self.train_step.plan
        return (f"train step: {self.train_step.traces} Python trace(s); "
                + (f"NOT shape-polymorphic, one trace per bucket: {plan.reason}"
                   if plan.reshaping_is_impossible else
                   "shape-polymorphic (reshaping_is_impossible=False): one program for every bucket"))


def _lengths_of(shapes: dict) -> tuple:
    """The length buckets of ``(rows, *sizes)`` shapes: ints, or for several lengths lists of
    them (as a checkpoint's fingerprint reads them back from JSON)."""
    return tuple(s if isinstance(s, int) else list(s)
                 for s in sorted({s[1] if len(s) == 2 else tuple(s[1:]) for s in shapes}))


def _prepare(loss_fn: LossFn, data: Sequence[Any], optimizer: Any, validation: Any,
             eval_fn: EvalFn | None, options: FitOptions) -> _Run:
    """Check the data, choose the devices and build the two bucketed steps; with explicit
    buckets, settle them too."""
    check_callable(loss_fn, "fit: loss_fn", "a callable (model, batch) -> loss")
    check_callable(eval_fn, "fit: eval_fn", "None or a callable (model, batch) -> "
                   "(summed loss, count)", optional=True)
    train = as_examples(data, "fit: data", options.specs, also=validation, pad_id=options.pad_id)
    form = train.form
    val = (as_examples(validation, "fit: validation", form=form)
           if validation is not None else None)
    # How the loss and eval functions are called: what they ask for, by their signatures.
    loss_call = as_loss_call(loss_fn, "fit: loss_fn", one_field=form.one_field)
    eval_call = (as_loss_call(eval_fn, "fit: eval_fn", one_field=form.one_field)
                 if eval_fn is not None else None)
    buckets = options.buckets
    auto = buckets is None or (isinstance(buckets, str) and buckets == "auto")
    dp = data_parallel(options.devices)
    if form.several:
        return _prepare_several(options, train, val, dp, loss_call, eval_call, auto, optimizer)
    policy = None if auto else _resolve_policy(buckets, train, val, options.min_length)
    top = policy.largest if policy is not None else _longest(train, val, options.min_length)
    progress, console = options.progress, options.console
    display = RunDisplay(progress=_interactive(console) if progress is None else progress,
                         verbose=options.verbose and dp.process_index == 0, console=console)
    # A batch larger than the data would only be padding: with --batch-size 100000 on 200
    # examples every step and compile was sized for 100000 rows (21 GB before the kernel
    # killed it). Each process takes batch_size rows of every global batch.
    most = -(-len(train) // dp.processes)
    if options.batch_size is not None and options.batch_size > most:
        display.print(f"note: batch_size={options.batch_size} is more than the {len(train)} "
                      f"training examples" + (f" over {dp.processes} processes" if dp.processes > 1
                                              else "") + f"; using batch_size={most}")
        options = dataclasses.replace(options, batch_size=most)
    if options.max_tokens is not None and options.max_tokens < top:
        # Refused now, not by batch_plan at the first epoch: no row may exceed the budget.
        raise OptionError(f"fit: max_tokens: expected at least {top} (one row of the longest "
                          f"bucket, for the longest example), received {options.max_tokens}")
    _check_optimizer(optimizer)
    if not options.masking and dp.size > 1:
        raise OptionError(f"fit: masking=False: expected one device, received {dp.size}: split "
                          f"over devices, a batch's rows are filled up to a multiple of the "
                          f"devices (and to equal shares across processes) with rows of length "
                          f"0, which a loss that masks the padding itself counts as examples; "
                          f"pass devices=1, or masking=True (the rewrite keeps such rows out)")
    batching = Batching(policy or _buckets.Fixed([top]), options.batch_size, options.max_tokens,
                        options.shuffle, options.seed, min_length=options.min_length,
                        device_multiple=dp.local_devices, num_shards=dp.processes,
                        shard_index=dp.process_index, exact_rows=not options.masking)
    # The variables' bounds: the longest length, and the most rows any batch can have (the
    # full rows of the shortest bucket). The sizes within them are settled by `_settle`.
    shortest = options.min_length if policy is None else policy.sizes[0]
    P = dp.processes
    # Packed rows are chosen by cost among the buckets (their rows split over every device of
    # the run, whole rows each).
    packs = options.layout != "pad" and auto and options.masking and form.can_pack
    if options.layout == "pack" and not packs:
        why = ("buckets='auto' (the row length is chosen by cost)" if not auto else
               "masking=True (the rewrite keeps the sequences of a row apart)"
               if not options.masking else
               f"fields with at most one length axis (received {form.describe()})")
        raise OptionError(f"fit: layout: 'pack' needs {why}; use layout='auto' or 'pad'")
    step_args = dict(length_buckets=[top],
                     batch_buckets=[batching.rows(top) * P, batching.rows(shortest) * P],
                     min_length=options.min_length, pad_id=options.pad_id, shardings=dp.shardings,
                     masking=options.masking, layout="auto" if packs else "pad", form=form)
    run = _run_of(options, train, val, batching, dp, display, auto, loss_call, eval_call,
                  optimizer, step_args)
    return run if auto else _with_policy(run, policy)


def _run_of(options: FitOptions, train: Examples, val: Examples | None, batching: Any,
            dp: DataParallel, display: RunDisplay, auto: bool, loss_call: Any, eval_call: Any,
            optimizer: Any, step_args: dict) -> _Run:
    """The `_Run` with its train step (and eval step, with validation data) made of
    ``step_args``."""
    seed = options.seed if loss_call.wants_key else None
    train_step = make_train_step(loss_call, optimizer, seed=seed, has_aux=options.has_aux,
                                 **step_args)
    eval_step = None
    if val is not None:
        evaluation = eval_call or loss_call
        eval_step = make_eval_step(None if eval_call else loss_call, eval_call,
                                   seed=options.seed if evaluation.wants_key else None,
                                   has_aux=options.has_aux and eval_call is None, **step_args)
    return _Run(options, train, val, batching, dp, train_step, eval_step, display, auto,
                loss_call=loss_call, eval_call=eval_call if val is not None else None)


def _prepare_several(options: FitOptions, train: Examples, val: Examples | None,
                     dp: DataParallel, loss_call: Any, eval_call: Any, auto: bool,
                     optimizer: Any) -> _Run:
    """`_prepare` for examples of several lengths (`_several`): one process, its devices
    splitting the rows; padded buckets per length, or packed rows of every length."""
    names = train.form.lengths
    if dp.processes > 1:
        raise OptionError(f"fit: data: examples of several lengths ({', '.join(names)}) train "
                          f"on one process (on any number of its devices), received "
                          f"{dp.processes} processes")
    _check_optimizer(optimizer)
    if options.layout == "pack" and not (auto and options.masking):
        why = "buckets='auto'" if not auto else "masking=True"
        raise OptionError(f"fit: layout: 'pack' needs {why}; use layout='auto' or 'pad'")
    display = RunDisplay(progress=(_interactive(options.console) if options.progress is None
                                   else options.progress),
                         verbose=options.verbose, console=options.console)
    if options.batch_size is not None and options.batch_size > len(train):
        display.print(f"note: batch_size={options.batch_size} is more than the {len(train)} "
                      f"training examples; using batch_size={len(train)}")
        options = dataclasses.replace(options, batch_size=len(train))
    floor = lambda e: np.maximum(e.sizes, options.min_length)   # noqa: E731
    tops = floor(train).max(axis=0)
    if val is not None:
        tops = np.maximum(tops, floor(val).max(axis=0))
    policies = ([_buckets.Fixed([int(t)]) for t in tops] if auto else
                several_policies(options.buckets, train, tops, options.min_length))
    if options.max_tokens is not None and options.max_tokens < sum(p.largest for p in policies):
        raise OptionError(f"fit: max_tokens: expected at least "
                          f"{sum(p.largest for p in policies)} (one row of the longest bucket "
                          f"of every length), received {options.max_tokens}")
    batching = JointBatching(names, tuple(policies), options.batch_size, options.max_tokens,
                             options.shuffle, options.seed, options.min_length,
                             device_multiple=dp.local_devices, exact_rows=not options.masking)
    packs = options.layout != "pad" and auto and options.masking and train.form.can_pack
    rows = sorted({batching.rows_for(tuple(p.sizes[0] for p in policies)),
                   batching.rows_for(tuple(p.largest for p in policies))})
    step_args = dict(length_buckets={n: list(p.sizes) for n, p in zip(names, policies)},
                     batch_buckets=rows, min_length=options.min_length, pad_id=options.pad_id,
                     shardings=dp.shardings, masking=options.masking,
                     layout="auto" if packs else "pad", form=train.form)
    run = _run_of(options, train, val, batching, dp, display, auto, loss_call, eval_call,
                  optimizer, step_args)
    if auto:
        return run
    train_shapes = batching.shapes(train.sizes)
    eval_shapes = batching.shapes(val.sizes) if val is not None else {}
    B = sorted({s[0] for s in (*train_shapes, *eval_shapes)})
    repinned = lambda f: f.with_buckets({"B": B}) if f is not None else None   # noqa: E731
    return dataclasses.replace(run, train_shapes=train_shapes, eval_shapes=eval_shapes,
                               train_step=repinned(run.train_step),
                               eval_step=repinned(run.eval_step))


def _check_losses(run: _Run, model: Any) -> None:
    """The loss contract (`check_loss`), on the first two examples as a batch, before
    anything traces symbolically or compiles: what ``loss_fn`` (and ``eval_fn``) returned,
    named by shape and dtype against what is expected."""
    first = list(range(min(2, len(run.train))))   # two: a per-example loss shows as [2]
    longest = np.maximum(run.train.sizes[first].max(axis=0), run.options.min_length)
    batch, lengths = pad_batch(run.train, first, len(first),
                               {n: int(m) for n, m in zip(run.names, longest)})
    on = f" on a batch of {len(first)} example{'s' if len(first) > 1 else ''} of data"
    check_loss(run.loss_call, model, batch, lengths, has_aux=run.options.has_aux, on=on)
    if run.eval_call is not None:
        check_loss(run.eval_call, model, batch, lengths, where="fit: eval_fn", pair=True)


def _refuse_padding(run: _Run, state: TrainState, eval_fn: EvalFn | None) -> None:
    """Refuse, before either step compiles, a step that padding may change -- unless the run
    says ``train_on_padding=True`` (then the executor warns once, and it trains).

    Both verdicts count: not padding-safe (an operation on a length axis has no rule), and
    reshaping-impossible (retraced per bucket, the step runs on the padded batch as written,
    unchecked: at ``min_length=1`` a next-token loss learned to predict the padding and
    reported a loss far below the exact one). ``masking=False`` says the loss masks the
    padding itself, so its plan, not padding-safe by design, is never refused.
    """
    options = run.options
    if options.train_on_padding or not options.masking:
        return
    steps = [("loss_fn", "a train step", run.train_step, state)]
    if run.eval_step is not None:
        steps.append(("eval_fn" if eval_fn is not None else "loss_fn", "an eval step",
                      run.eval_step, state.model))
    for where, what, step, arg in steps:
        # The executor warns of the verdict as it plans; a refused step is reported by the
        # refusal alone. Recorded under "always", so that a filter turning warnings into errors
        # cannot raise the verdict's warning in the refusal's place; any other warning of the
        # trace is passed on as it came.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = step.plan_for(arg)
        refusal = _refusal(plan, what, options.min_length)
        if refusal is not None:
            raise PolymorphismError(f"fit: {where}: {refusal}")
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def _refusal(plan: Any, what: str, min_length: int) -> str | None:
    """Why ``plan`` may not train (the verdict, naming the user's line) and the fix, or None."""
    anyway = "pass train_on_padding=True to train on it anyway"
    if plan.reshaping_is_impossible:
        # A length bound JAX cannot decide at the smallest length, as `tokens[:, 10:]` gives
        # at min_length=1 ('- min(T, 10) + T' >= '1'), is decided once T's minimum is high
        # enough (polyexec raises it by itself only a little: `tokens[:, 1:]` trains).
        need = getattr(plan.verdict.raise_min, "min", 0)
        fix = (f"pass min_length={need} (JAX cannot decide that comparison for lengths down to "
               f"min_length={min_length}), or {anyway}" if need > min_length else
               f"make that line work for every length, or mask the padding by hand and pass "
               f"masking=False, or {anyway}")
        return (f"expected {what} traced once for every length (shape-polymorphic), received "
                f"one retraced per bucket, which would train on the padded batch as written, "
                f"nothing keeping the padding out of the loss: {plan.reason.rstrip('.')}; {fix}")
    if not plan.padding_safe:
        return (f"expected {what} that padding cannot change (padding-safe), received one "
                f"that is not: {plan.padding_reason.rstrip('.')}; change that line, or mask the "
                f"padding by hand and pass masking=False, or {anyway}")
    return None


def _check_optimizer(optimizer: Any) -> None:
    """Refuse an optimizer whose step is not finite or climbs the loss (``optax.adam(inf)``
    trained to a NaN loss and ended as if all were well; ``optax.adam(-1e-3)`` maximises).

    Probed on one parameter with a unit gradient, before anything else compiles. A zero step
    passes (a schedule may start at 0); an optimizer that needs the model's own tree (masks,
    labels per parameter) cannot be probed this way and is left to run.
    """
    if not isinstance(optimizer, optax.GradientTransformation):
        return                         # TrainState.create names what is wrong with it
    try:
        params = {"w": np.ones((1,), np.float32)}
        unit = lambda p: jax.tree_util.tree_map(jax.numpy.ones_like, p)   # noqa: E731
        updates, _ = jax.jit(lambda p: optimizer.update(unit(p), optimizer.init(p), p))(params)
        step = float(np.asarray(updates["w"])[0])
    except Exception:                  # noqa: BLE001 -- cannot be probed: not refused
        return
    if not np.isfinite(step):
        raise OptionError(f"fit: optimizer: expected finite updates (a finite learning rate), "
                          f"received an optimizer whose first step for a unit gradient is "
                          f"{step} (a learning rate of inf or nan?)")
    if step > 0:
        raise OptionError(f"fit: optimizer: expected a step against the gradient (a learning "
                          f"rate > 0), received an optimizer whose first step for a unit gradient "
                          f"is +{step:g} (a negative learning rate?)")


def _longest(train: Examples, validation: Examples | None, min_length: int) -> int:
    return max(int(train.lengths.max()), min_length,
               int(validation.lengths.max()) if validation is not None else 0)


def _with_policy(run: _Run, policy: Any) -> _Run:
    """``run`` batching by ``policy`` (an `Auto` brings its ``partial_rows``), its steps'
    buckets exactly the shapes its batches use (`rebucket`)."""
    batching = dataclasses.replace(run.batching, policy=policy)
    steps = (run.train_step,) + ((run.eval_step,) if run.eval_step is not None else ())
    steps, _, train_shapes, eval_shapes = rebucket(
        steps, batching, run.train.lengths,
        run.validation.lengths if run.validation is not None else None)
    return dataclasses.replace(run, batching=batching, train_shapes=train_shapes,
                               eval_shapes=eval_shapes, train_step=steps[0],
                               eval_step=steps[1] if run.eval_step is not None else None)


def _settle(run: _Run, state: TrainState, position: Position, restored: str | None) -> _Run:
    """``buckets="auto"``: the layout and bucket set with the least predicted time for the
    epochs still to run -- packed rows (`choose_layout`, when the steps can pack and ``layout``
    allows) or padded buckets (`choose_buckets`: one compile and one step measured at the
    largest bucket, then `buckets.Auto.fit`).

    A resumed run keeps the choice its checkpoint holds -- the data order depends on it --
    unless the run was extended (more ``epochs`` than the checkpoint's run planned) and
    resumes at an epoch boundary: then the rest is chosen again for the new length.
    """
    if not run.auto:
        return run
    options = run.options
    meta = read_meta(restored) if restored is not None else {}
    remaining = max(options.epochs - position.epoch, 1)
    if run.train.form.several:
        return _settle_several(run, state, meta.get("auto_several"), position, remaining)
    saved = meta.get("auto_layout") or meta.get("auto_buckets")
    known = None
    if saved is not None and (saved["epochs"] == options.epochs or position.batch > 0):
        if saved.get("layout") == "pack":
            known = saved
            run.display.print(f"layout (auto): the checkpoint's packed rows, {saved['pack_rows']}")
        else:
            known = _buckets.Auto(tuple(saved["sizes"]), tuple(saved["partial_rows"]))
            run.display.print(f"buckets (auto): the checkpoint's {list(known.sizes)}")
    elif position.epoch >= options.epochs:      # nothing to train: nothing worth measuring
        known = _buckets.Auto(_buckets.Optimal.fit(
            np.maximum(run.train.lengths, options.min_length)).sizes)
    pads = dict(batch_size=options.batch_size, max_tokens=options.max_tokens,
                eval_step=run.eval_step, eval_arg=state.model, min_length=options.min_length,
                pad_id=options.pad_id, data_parallel=run.dp, batch_of=run.train.form.zeros,
                validation_lengths=run.validation.lengths if run.validation is not None else None)
    if isinstance(known, dict) and run.train_step.layout == "pad":
        raise OptionError(f"fit: cannot resume from {restored}: its run trained packed rows, "
                          f"which this one cannot (packing needs masking=True, buckets='auto' "
                          f"and fields with at most one length axis; this run has "
                          f"masking={options.masking}, layout={options.layout!r})")
    if run.train_step.layout != "pad":
        as_known = known if isinstance(known, dict) else (
            {"layout": "pad", "policy": known} if known is not None else None)
        choose = functools.partial(choose_layout, run.train_step, state, run.train.lengths,
                                   epochs=remaining, layout=options.layout, seed=options.seed,
                                   known=as_known, **pads)
    else:
        choose = functools.partial(choose_buckets, run.train_step, state, run.train.lengths,
                                   epochs=remaining, known=known, **pads)
    choice = _chosen(run, choose, known)
    if getattr(choice, "layout", "pad") == "pack":
        if known is None:
            run.display.print(f"layout (auto, for {remaining} epoch(s)): {choice.describe()}")
        if isinstance(known, dict) and int(known.get("room", 0)) != choice.room:
            raise OptionError(f"fit: cannot resume from {restored}: its run planned packed "
                              f"rows with {known.get('room', 0)} cell(s) after each example, "
                              f"this step's program needs {choice.room} (Plan.packing_room): "
                              f"the rest of its epoch would not be the steps it planned")
        batching = PackedBatching(choice.row_lengths, choice.max_tokens, options.shuffle,
                                  options.seed, options.min_length,
                                  num_shards=run.dp.processes, shard_index=run.dp.process_index,
                                  room=choice.room, row_multiple=run.dp.size)
        val = run.validation
        return dataclasses.replace(
            run, prediction=choice.prediction, batching=batching, train_step=choice.step,
            eval_step=choice.eval_step, train_shapes=batching.shapes(run.train.lengths),
            eval_shapes=batching.shapes(val.lengths) if val is not None else {})
    if hasattr(choice, "layout"):           # choose_layout padded: its buckets' choice
        if known is None:
            run.display.print(f"layout (auto): pad, {choice.reason}")
        choice = choice.buckets
    if known is None:
        policy = choice.policy
        # Priced by choose_layout's packed measurement (said above), the buckets were not
        # measured themselves: their choice has no cost of its own.
        measured = ""
        if choice.measured_at is not None:
            (rows, top), cost = choice.measured_at, choice.cost
            measured = (f"; measured at B={rows}, T={top}: compile {cost.compile_seconds:.2f} s "
                        f"(train + eval), step {cost.step_seconds(rows, top):.3f} s")
        run.display.print(
            f"buckets (auto, for {remaining} epoch(s){measured}): T={list(policy.sizes)}"
            + (f", partial batches at their own rows for T={list(policy.partial_rows)}"
               if policy.partial_rows else "")
            + f"\n  predicted: {policy.prediction.describe()}")
    return dataclasses.replace(
        run, prediction=choice.policy.prediction,
        batching=dataclasses.replace(run.batching, policy=choice.policy),
        train_shapes=choice.train_shapes, eval_shapes=choice.eval_shapes,
        train_step=choice.steps[0], eval_step=choice.steps[1] if run.eval_step is not None else None)


def _chosen(run: _Run, choose: Any, known: Any) -> Any:
    """``choose()``: a known choice at once, a new one under a progress task (it measures)."""
    if known is not None:
        return choose()
    with run.display.task("measuring one bucket", 1) as advance:
        choice = choose()
        advance()
    return choice


def _settle_several(run: _Run, state: TrainState, saved: dict | None, position: Position,
                    remaining: int) -> _Run:
    """`_settle` for examples of several lengths: `choose_several`."""
    options = run.options
    known = None
    if saved is not None and (saved["epochs"] == options.epochs or position.batch > 0):
        known = saved
        run.display.print(f"layout (auto): the checkpoint's, {saved['layout']}")
        if saved["layout"] == "pack" and run.train_step.layout == "pad":
            raise OptionError("fit: cannot resume from a checkpoint of packed rows in a run "
                              f"that cannot pack (masking={options.masking}, "
                              f"layout={options.layout!r})")
    choose = functools.partial(
        choose_several, run.train_step, state, run.train, epochs=remaining,
        batch_size=options.batch_size, max_tokens=options.max_tokens,
        # A step made to pad (masking=False, layout="pad") is priced padded alone.
        layout="pad" if run.train_step.layout == "pad" else options.layout,
        seed=options.seed, shuffle=options.shuffle, min_length=options.min_length,
        devices=run.dp.size, exact_rows=not options.masking, eval_step=run.eval_step,
        eval_arg=state.model, validation=run.validation, known=known)
    choice = _chosen(run, choose, known)
    if known is None:
        run.display.print(f"layout (auto, for {remaining} epoch(s)): {choice.describe()}")
    val = run.validation
    return dataclasses.replace(
        run, prediction=choice.prediction, batching=choice.batching, train_step=choice.step,
        eval_step=choice.eval_step, train_shapes=choice.batching.shapes(run.train.sizes),
        eval_shapes=choice.batching.shapes(val.sizes) if val is not None else {})


def _resolve_policy(spec: Any, train: Examples, validation: Examples | None, min_length: int):
    """The bucket policy: fitted to the training lengths (an int K: ``Optimal.fit`` with K
    buckets), floored at ``min_length``, with one more bucket when the longest validation
    example is above them all."""
    if isinstance(spec, str):
        raise OptionError(f"fit: buckets: expected 'auto', an int K, a bucket policy or a list of "
                          f"sizes, received str {spec!r}")
    try:
        if is_int(spec):
            policy = _buckets.Optimal.fit(train.lengths,
                                          max_buckets=check_int(spec, "fit: buckets", min=1))
        else:
            policy = _buckets.as_policy(spec)
    except (TypeError, ValueError) as e:   # the buckets package does not depend on polyexec
        raise OptionError(f"fit: buckets: {e}") from e
    sizes = sorted({max(int(s), min_length) for s in policy.sizes})
    if validation is not None and int(validation.lengths.max()) > sizes[-1]:
        sizes.append(int(validation.lengths.max()))
    if sizes != list(policy.sizes):
        policy = _buckets.Fixed(sizes)
    for name, examples in (("data", train), ("validation", validation)):
        over = np.flatnonzero(examples.lengths > policy.largest) if examples else ()
        if len(over):
            i = int(over[0])
            raise OptionError(f"fit: {name}[{i}]: expected a length <= {policy.largest} (the "
                              f"largest bucket of {policy!r}), received length "
                              f"{int(examples.lengths[i])}; cap or truncate long examples or use "
                              f"buckets whose largest size covers them")
    return policy


def _check_outputs(options: FitOptions) -> None:
    """Every folder and file the run will write, created or test-written now: a bad path
    fails before any data is read, not at the first checkpoint an epoch later."""
    if options.checkpoint_dir is not None:
        check_output_dir(options.checkpoint_dir, "fit: checkpoint_dir")
    if isinstance(options.cache, str):
        check_output_dir(options.cache, "fit: cache")
    if options.metrics_file is not None and jax.process_index() == 0:   # process 0 writes it
        check_output_file(options.metrics_file, "fit: metrics_file")


def _configure_cache(cache: bool | str | None) -> None:
    """JAX's compile-cache configuration is process-wide: change it only when asked to."""
    if cache is True:
        enable_persistent_cache()
    elif isinstance(cache, str):
        enable_persistent_cache(cache)


def _interactive(console) -> bool:
    if console is not None:
        return bool(console.is_terminal)
    return rich.console.Console().is_terminal


# -- resume ---------------------------------------------------------------------------------------


def _restore(run: _Run, state: TrainState) -> tuple[TrainState, Position, list[dict], str | None]:
    """The newest checkpoint's state, position and epoch records (with ``resume`` and a
    ``checkpoint_dir`` holding one), else the fresh state at the start."""
    options = run.options
    path = (latest_checkpoint(options.checkpoint_dir)
            if options.checkpoint_dir is not None and options.resume else None)
    if path is None:
        return state, Position(), [], None
    # Checkpoints from before fit took a layout were padded runs.
    saved = {"layout": "pad", **read_meta(path)["fingerprint"]}
    mismatch = [f"{k}: checkpoint {saved.get(k)!r}, now {v!r}"
                for k, v in run.fingerprint.items() if saved.get(k) != v]
    if mismatch:
        raise OptionError(f"fit: cannot resume from {path}: expected a checkpoint of this run, "
                          f"received one of a different run ({'; '.join(mismatch)}); use another "
                          f"checkpoint_dir or resume=False")
    state, meta = load_checkpoint(path, like=state)
    position = Position.from_meta(meta)
    run.display.print(f"resumed from {path}: step {position.step}, epoch {position.epoch + 1}, "
                      f"batch {position.batch}")
    return state, position, [dict(r) for r in meta["history"]], path


def _save(run: _Run, state: TrainState, position: Position, log: MetricsLog) -> str | None:
    if run.options.checkpoint_dir is None or not run.main:
        return None
    meta = position.meta(log.history, run.fingerprint)
    if run.auto and run.train.form.several:
        meta["auto_several"] = run.batching.known() | {"epochs": run.options.epochs}
    elif run.auto and run.layout == "pack":
        meta["auto_layout"] = {"layout": "pack", "row_lengths": list(run.batching.row_lengths),
                               # A whole step's rows, every process's.
                               "pack_rows": {str(n): r
                                             for n, r in run.batching.pack_rows.items()},
                               # The cells a step is planned with (the grid may round up).
                               "max_tokens": run.batching.max_tokens,
                               # The plan's room: a resumed run must plan the same steps.
                               "room": run.batching.room,
                               "epochs": run.options.epochs}
    elif run.auto:
        meta["auto_buckets"] = {"sizes": list(run.batching.policy.sizes),
                                "partial_rows": list(run.batching.policy.partial_rows),
                                "epochs": run.options.epochs}
    return save_checkpoint(run.options.checkpoint_dir, state, meta,
                           keep=run.options.keep_checkpoints)


# -- the epoch loop -------------------------------------------------------------------------------


def _warmup(run: _Run, state: TrainState, step: int, log: MetricsLog) -> None:
    """Compile every (step, shape) pair the data uses on parallel threads (XLA compiles release
    the GIL) before the first step, the shapes that carry the most tokens first."""
    jobs = sorted([(tokens, run.train_step, state, shape)
                   for shape, tokens in run.train_shapes.items()]
                  + [(tokens, run.eval_step, state.model, shape)
                     for shape, tokens in run.eval_shapes.items()], key=lambda j: -j[0])
    workers = run.options.warmup_workers or os.cpu_count() or 1
    start = time.perf_counter()
    with count_compiles() as counter, run.display.task("compiling buckets", len(jobs)) as advance, \
            concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(f.warmup, arg, sizes=[run.sizes(shape)], max_workers=1)
                   for _, f, arg, shape in jobs]
        for future in concurrent.futures.as_completed(futures):
            future.result()
            advance()
    compiles, seconds = run.compiles()
    events = counter.counts().as_dict()
    record = warmup_record(step=step, compiles=compiles, compile_seconds=seconds, events=events,
                           seconds=time.perf_counter() - start)
    log.add(record)
    run.display.print(f"warmup: {compiles} buckets compiled in {record['seconds']:.1f} s "
                      f"({events['xla_compiles']} XLA compiles, {events['cache_hits']} loaded from "
                      f"the persistent cache; {seconds:.1f} s of compile time over the threads)")


def _train_epoch(run: _Run, state: TrainState, position: Position,
                 log: MetricsLog) -> tuple[TrainState, Position, bool, str | None]:
    """The rest of ``position``'s epoch; returns (state, position, stopped, checkpoint written)."""
    options = run.options
    batches = run.batching.epoch(run.train.planned, position.epoch)
    compiles_at_start, _ = run.compiles()
    checkpoint = None
    start = time.perf_counter()
    run.display.start_epoch(position.epoch, options.epochs, len(batches), position.batch)
    try:
        while position.batch < len(batches):
            state, position, stopped = _train_step(run, state, position,
                                                   batches[position.batch], log)
            every = options.checkpoint_every
            if stopped or (every and position.step % every == 0):
                checkpoint = _save(run, state, position, log) or checkpoint
            if stopped:
                return state, position, True, checkpoint
    finally:
        run.display.end_epoch()
    train_seconds = time.perf_counter() - start
    val_loss = None
    if run.eval_step is not None:
        val_loss, _ = evaluate(run.eval_step, state.model, run.validation, run.batching, run.dp)
    compiles, compile_seconds = run.compiles()
    record = epoch_record(position, val_loss=val_loss, compiles=compiles,
                          compiles_at_start=compiles_at_start, compile_seconds=compile_seconds,
                          seconds=time.perf_counter() - start, train_seconds=train_seconds,
                          elapsed=time.perf_counter() - run.started)
    log.add(record)
    run.display.epoch_summary(record)
    position = position.next_epoch()
    return state, position, False, _save(run, state, position, log) or checkpoint


def _train_step(run: _Run, state: TrainState, position: Position, batch: _buckets.Batch,
                log: MetricsLog) -> tuple[TrainState, Position, bool]:
    """One step on ``batch``; returns (state, position, whether to stop)."""
    start = time.perf_counter()
    examples, lengths = _stacked(run.batching, run.dp, run.train_step, state, run.train, batch)
    shape = run.batching.shape(batch)
    bucket = (shape[0] * run.dp.processes, *shape[1:])
    state, metrics = run.train_step.call_at_least(
        run.sizes(shape), state, *_global(run.batching, run.dp, examples, lengths))
    # The step's one read-back (the loss was read every step already): its finite flag comes
    # with it, computed inside the compiled step.
    values = jax.device_get({k: metrics[k] for k in ("loss", "grad_norm", "finite", "aux")
                             if k in metrics})
    loss, grad_norm, finite = (float(values["loss"]), float(values["grad_norm"]),
                               bool(values["finite"]))
    aux = _named(values["aux"]) if "aux" in values else None
    seconds = time.perf_counter() - start
    # The executor pads the batch to `bucket` (see Batching); across processes the other
    # shares' real tokens are estimated by this one's (a packed step holds every length).
    tokens_real = (int(sum(np.sum(v) for v in lengths.values())) if isinstance(lengths, dict)
                   else int(lengths.sum())) * (1 if run.layout == "pack" else run.dp.processes)
    if not finite and run.options.on_nonfinite == "stop":
        _stop_nonfinite(run, position, batch, loss, grad_norm)
    position = position.after_step(loss=loss, tokens=tokens_real,
                                   padded=bucket[0] * sum(bucket[1:]),
                                   seconds=seconds, skipped=not finite, aux=aux)
    compiles, _ = run.compiles()
    log.add(step_record(position, loss=loss, grad_norm=grad_norm, tokens=tokens_real,
                        bucket=bucket, seconds=seconds, compiles=compiles, skipped=not finite,
                        aux=aux))
    if not finite:
        run.display.print(f"step {position.step} (epoch {position.epoch}): loss {loss}, gradient "
                          f"norm {grad_norm}: not finite, skipped (on_nonfinite='skip'); "
                          f"examples {_listed(batch.indices)}")
    run.display.step(loss=loss, rate=position.totals.tokens_per_s, bucket=run.label(bucket),
                     compiles=compiles)
    info = StepInfo(position.step, position.epoch, position.batch, loss, bucket, state)
    try:
        for callback in run.options.callbacks:
            callback(info)
    except StopTraining:
        return state, position, True
    max_steps = run.options.max_steps
    return state, position, max_steps is not None and position.step >= max_steps


def _stop_nonfinite(run: _Run, position: Position, batch: Any, loss: float,
                    grad_norm: float) -> None:
    """Raise `NonFiniteError` for the step after ``position``: the step made no change (see
    `train_step_fn`) and is not recorded as done, so nothing after the last good step is saved."""
    step = position.step + 1
    saved = list_checkpoints(run.options.checkpoint_dir) if run.options.checkpoint_dir else []
    last = saved[-1] if saved else None
    what = ("the loss" if not np.isfinite(loss) else "the gradient")
    raise NonFiniteError(
        f"fit: expected a finite loss and gradient at every step, received {what} not finite at "
        f"step {step} (epoch {position.epoch}, batch {position.batch} of the epoch, 0-based): "
        f"loss {loss}, gradient norm {grad_norm}, on the examples data[i] for i in "
        f"{_listed(batch.indices)}; the step was not applied and training stopped"
        + (f", the last checkpoint is {last}" if last else ", no checkpoint was written")
        + "; check those examples (a NaN or inf in a field?) and the loss (log of 0? a "
        "learning rate too high?), or pass on_nonfinite='skip' to skip such steps",
        step=step, epoch=position.epoch, indices=[int(i) for i in batch.indices], loss=loss,
        grad_norm=grad_norm, checkpoint=last)


def _named(aux: Any) -> dict[str, float]:
    """A loss's aux (a pytree of scalars) as ``{name: value}`` for the records: a dict's keys
    (``{"accuracy": a}`` -> ``accuracy``), nested ones joined by dots, a bare scalar ``aux``."""
    named = {}
    for path, value in jax.tree_util.tree_flatten_with_path(aux)[0]:
        parts = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        named[".".join(parts) or "aux"] = float(value)
    return named


def _listed(indices: Sequence[int], most: int = 64) -> str:
    """``[3, 9, 14] (3 examples)``: a batch's example indices, the first ``most`` of a long
    one (all of them are in `NonFiniteError.indices`)."""
    shown = ", ".join(str(int(i)) for i in list(indices)[:most])
    more = len(indices) > most
    return (f"[{shown}{', ...' if more else ''}] ({len(indices)} examples"
            + ("; all in the error's .indices" if more else "") + ")")


def _stacked(batching: Batching | PackedBatching, dp: DataParallel, step: Bucketed, arg: Any,
             examples: Examples, batch: Any) -> tuple[Any, np.ndarray]:
    """``batch`` stacked on the host: this process's share of a padded step; a packed step's
    every length with the data of this process's rows (the rows ``step`` packs them into)."""
    if isinstance(batching, PackedBatching) and dp.processes > 1:
        return batching.stack(examples, batch,
                              rows_of=lambda lengths: step.packing_of(lengths, arg))
    return batching.stack(examples, batch)


def _global(batching: Batching | PackedBatching, dp: DataParallel, examples: Any,
            lengths: np.ndarray) -> tuple[Any, Any]:
    """The step's batch arguments: across processes a padded share becomes its global batch
    here; a packed step's host arrays (every process's are the whole step) are made global
    by the executor, from the rows each process holds, once packed."""
    if isinstance(batching, (PackedBatching, JointPackedBatching)):
        return examples, lengths
    return dp.global_batch(examples), dp.global_batch(lengths)


def evaluate(eval_step: Bucketed, model: Any, examples: Examples,
             batching: Batching | PackedBatching, dp: DataParallel) -> tuple[float, int]:
    """Mean loss over ``examples`` (exact: summed totals over summed counts) and the count.
    Each step runs at least at the (rows, length) bucket warmup compiled for its batch,
    however few real rows it holds (`Batching.stack`); a packed step chooses its own rows."""
    total, count = 0.0, 0.0
    for batch in batching.epoch(examples.planned, 0, shuffle=False, partial_rows="full"):
        stacked, lengths = _stacked(batching, dp, eval_step, model, examples, batch)
        shape = batching.shape(batch)
        sizes = examples.form.step_sizes(shape, dp.processes)
        t, c = eval_step.call_at_least(sizes, model, *_global(batching, dp, stacked, lengths))
        total += float(t)
        count += float(c)
    return (total / count if count else float("nan")), int(count)
