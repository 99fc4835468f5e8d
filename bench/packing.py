"""The packing peer: what a JAX user builds today instead of bucketing.

Sequences are packed first-fit into rows of one length (the cap) with Grain's own packing
(``grain.experimental.FirstFitPackIterDataset``, as Grain's users pack), and the model is
written by hand against the segment ids: the recurrent state is reset to its initial value at
every segment start, attention is restricted to the same segment (and causal), and the loss
takes only predictions within a segment. Every packed batch has the same shape
``(batch_size, cap)``, so the train step is one plain ``jax.jit``: one compile.

Interface (all the ``pack`` strategy needs):

- ``pack_epoch(cfg, data, epoch) -> list[PackedBatch]``: one epoch's packed batches. Every
  example exactly once; deterministic from ``cfg.seed`` and ``epoch``; a partial last batch is
  padded with empty rows (segment id 0 everywhere).
- ``PackedBatch``: ``tokens``, ``segment_ids`` (0 = padding, k = the k-th sequence of the row),
  ``positions`` (within the segment), all ``(rows, cap)`` int32 numpy; ``examples[r]`` the
  example indices of row r in segment order; ``real_tokens``, ``cells``, ``efficiency``.
- ``row_efficiency(batches)``: real tokens / computed cells (padding rows included).
- ``build_packed_step(cfg, state_file=None) -> PackedStep``: ``step(state, batch) -> (loss,
  new state)`` (the `bench.strategies.ExactJit` convention: the state as arrays only, starting
  at ``step.state``); the same initial state, optimiser and learning rate as
  `bench.workloads.build_step`, and the same update (`polyexec.training.train_step_fn`); in
  infer mode the loss alone. ``step.compiles`` counts its XLA compiles, ``compile_seconds``
  their seconds.
- ``iter_pack_epoch(cfg, data, epoch)``: `pack_epoch`'s batches one at a time, as Grain packs
  them (what the ``pack`` strategy's timed epoch iterates: packing overlaps the steps).
- ``packed_loss(model, tokens, segment_ids, positions)``: mean next-byte cross-entropy over the
  real predictions of the packed batch -- the same number `examples.rnn.model.loss_fn` gives on
  the same examples padded one per row (sum of nats / number of predictions; a sequence of
  length n gives n - 1 predictions), up to float reassociation. Batches differ from the other
  strategies' (packing groups other examples), so compare per-epoch totals:
  ``packed_loss_and_count`` gives (summed nats, predictions), like ``loss_and_count``.
- ``packed_logits(model, tokens, segment_ids, positions)``: one row's logits, ``(cap, 256)``,
  for `examples.rnn.model.CharLM` (GRU/LSTM) and `bench.workloads.AttentionLM`, with their own
  weights (their cells and layers are called; no new parameters).

>>> from bench.workloads import Config, load_data
>>> cfg = Config(source="uniform", num_examples=40, cap=32, batch_size=4, seed=1)
>>> batches = pack_epoch(cfg, load_data(cfg), epoch=0)
>>> batches[0].tokens.shape, sorted(i for b in batches for r in b.examples for i in r) == list(range(40))
((4, 32), True)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from examples.rnn.model import CharLM
from polyexec import OptionError
from polyexec.training import train_step_fn

from .workloads import AttentionLM, Config, Data, build_step


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """One batch of packed rows; arrays ``(rows, cap)`` int32.

    ``segment_ids[r, t]`` is 0 on padding and k on the k-th sequence of row r (k = 1, 2, ...);
    ``positions[r, t]`` is t's offset within its sequence (0 on padding); ``examples[r][k - 1]``
    is the example index (row of `bench.workloads.Data`) of segment k of row r.
    """

    tokens: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    examples: tuple[tuple[int, ...], ...]

    @property
    def real_tokens(self) -> int:
        return int(np.count_nonzero(self.segment_ids))

    @property
    def cells(self) -> int:
        return int(self.tokens.size)

    @property
    def efficiency(self) -> float:
        return self.real_tokens / self.cells

    @property
    def predictions(self) -> int:
        """Next-byte predictions the loss counts: (length - 1) per sequence."""
        seg = self.segment_ids
        return int(np.count_nonzero((seg[:, :-1] != 0) & (seg[:, 1:] == seg[:, :-1])))


def epoch_order(cfg: Config, data: Data, epoch: int) -> np.ndarray:
    """The order examples enter the packer: the shuffle the random-batch strategies use
    (`bench.strategies.random_batches`: ``SeedSequence([seed, 1000 + epoch])``), so packing
    sees the same stream of examples as pad-max, exact and pow2 do."""
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 1000 + epoch]))
    return rng.permutation(data.lengths.size)


def iter_pack_examples(data: Data, order, *, cap: int, batch_size: int,
                       num_bins: int | None = None, seed: int = 0) -> Iterator[PackedBatch]:
    """`pack_examples`, batch by batch as Grain emits rows: a training loop that steps while
    the next rows are packed (JAX dispatches a step and returns) overlaps packing with
    compute, as a Grain input pipeline does."""
    import grain  # the bench extra: only the pack peer needs it

    order = np.asarray(order, np.int64)
    num_bins = batch_size if num_bins is None else num_bins
    lengths = np.minimum(data.lengths, cap)

    def example(i):
        i = int(i)
        return {"tokens": data.tokens[i, :lengths[i]].astype(np.int32), "index": i}

    # In-memory source: no reader threads (Grain's advice for data already in memory).
    source = grain.MapDataset.source(order.tolist()).map(example)
    stream = source.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    packed = grain.experimental.FirstFitPackIterDataset(
        stream, length_struct={"tokens": cap}, num_packing_bins=num_bins, seed=seed,
        meta_features=("index",))   # "index" is not packed: each row gets its list of indices

    def batch(chunk):
        empty = batch_size - len(chunk)

        def stack(key):
            arr = np.stack([np.asarray(r[key], np.int32) for r in chunk])
            return np.concatenate([arr, np.zeros((empty, cap), np.int32)]) if empty else arr

        return PackedBatch(
            tokens=stack("tokens"), segment_ids=stack("tokens_segment_ids"),
            positions=stack("tokens_positions"),
            examples=tuple(tuple(int(i) for i in r["index"]) for r in chunk) + ((),) * empty)

    for chunk in in_batches(packed, batch_size):
        yield batch(chunk)


def in_batches(rows, size: int) -> Iterator[list]:
    """``rows`` (an iterator, Grain's packed rows as it emits them) in lists of ``size``, the
    last one shorter (the caller fills it with empty rows)."""
    chunk = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def pack_examples(data: Data, order, *, cap: int, batch_size: int,
                  num_bins: int | None = None, seed: int = 0) -> list[PackedBatch]:
    """Examples ``order`` (indices into ``data``) packed first-fit by Grain into rows of
    ``cap``, grouped ``batch_size`` rows a batch, the last batch padded with empty rows.

    Grain's first-fit packer keeps ``num_bins`` rows open (default ``batch_size``: one batch),
    puts each example into the first row it fits, and emits all of them when an example fits
    none; more bins pack tighter. ``seed`` seeds Grain's shuffle of the rows it emits.
    """
    return list(iter_pack_examples(data, order, cap=cap, batch_size=batch_size,
                                   num_bins=num_bins, seed=seed))


def pack_epoch(cfg: Config, data: Data, epoch: int, *,
               num_bins: int | None = None) -> list[PackedBatch]:
    """One epoch of the ``pack`` strategy: `epoch_order`'s stream packed into rows of
    ``cfg.cap``, ``cfg.batch_size`` rows a batch (Grain's bins: ``num_bins``, default one
    batch); deterministic from ``cfg.seed`` and ``epoch``."""
    return list(iter_pack_epoch(cfg, data, epoch, num_bins=num_bins))


def iter_pack_epoch(cfg: Config, data: Data, epoch: int, *,
                    num_bins: int | None = None) -> Iterator[PackedBatch]:
    """`pack_epoch`'s batches, one at a time as Grain packs them (`iter_pack_examples`)."""
    if cfg.batch_size is None:
        raise OptionError("pack_epoch: cfg.batch_size: expected a number of rows (packing fills "
                         "rows of cfg.cap, so a token budget is rows x cap), received None")
    return iter_pack_examples(data, epoch_order(cfg, data, epoch), cap=cfg.cap,
                              batch_size=cfg.batch_size, num_bins=num_bins,
                              seed=int(np.random.SeedSequence([cfg.seed, 2000 + epoch])
                                       .generate_state(1)[0]))


def row_efficiency(batches: list[PackedBatch]) -> float:
    """Real tokens / computed cells over ``batches`` (empty padding rows count as cells)."""
    return sum(b.real_tokens for b in batches) / sum(b.cells for b in batches)


# ------------------------------------------------------------------- the model, by hand


def _charlm_logits(model: CharLM, tokens, positions):
    """The scan of `CharLM.__call__`, with the state reset to ``model.initial_state()`` where
    a segment starts (position 0; padding is position 0 too, harmlessly)."""
    init = model.initial_state()

    def step(state, xs):
        token, start = xs
        state = jax.tree_util.tree_map(lambda i, s: jnp.where(start, i, s), init, state)
        return model.step(state, token)

    _, logits = jax.lax.scan(step, init, (tokens, positions == 0))
    return logits


def _attention_logits(model: AttentionLM, tokens, segment_ids, positions):
    """`AttentionLM` with each segment's own positions in the sinusoidal encoding and
    attention restricted to earlier positions of the same segment. Padding attends to
    padding (never an empty softmax row); no real position sees padding or another segment."""
    index = jnp.arange(tokens.shape[0])
    mask = (index[:, None] >= index[None, :]) & (segment_ids[:, None] == segment_ids[None, :])
    return model.logits(tokens, positions, mask)


def packed_logits(model, tokens, segment_ids, positions):
    """One packed row ``(cap,)`` -> logits ``(cap, 256)``; position t predicts byte t + 1 of
    its own segment."""
    if isinstance(model, CharLM):
        return _charlm_logits(model, tokens, positions)
    if isinstance(model, AttentionLM):
        return _attention_logits(model, tokens, segment_ids, positions)
    raise TypeError(f"packed_logits: model: expected a CharLM or an AttentionLM, received "
                    f"{type(model).__name__}")


def packed_loss_and_count(model, tokens, segment_ids, positions):
    """Summed nats of the real next-byte predictions of a packed batch, and their number.

    Position t predicts t + 1 only where both are in the same (real) segment: no prediction
    across a boundary, none from or into padding -- `loss_fn`'s ``lengths - 1`` per sequence.
    """
    # As loss_fn: the last position predicts nothing, so it is not computed.
    logits = jax.vmap(lambda t, s, p: packed_logits(model, t, s, p))(
        tokens[:, :-1], segment_ids[:, :-1], positions[:, :-1])
    targets = tokens[:, 1:]
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    mask = (segment_ids[:, :-1] != 0) & (segment_ids[:, 1:] == segment_ids[:, :-1])
    return jnp.sum(jnp.where(mask, nll, 0.0)), jnp.sum(mask)


def packed_loss(model, tokens, segment_ids, positions):
    """Mean next-byte cross-entropy in nats over the batch's real predictions: what
    `examples.rnn.model.loss_fn` gives on the same examples padded one per row."""
    total, count = packed_loss_and_count(model, tokens, segment_ids, positions)
    return total / jnp.maximum(count, 1)


# ------------------------------------------------------------------------- the train step


class PackedStep:
    """The packed step, ``jax.jit`` once: ``step(state, batch) -> (loss, new state)``.

    Train (``cfg.mode == "train"``): ``state`` is the arrays of a
    `polyexec.training.TrainState` (``step.state`` to start; the rest is closed over, as
    `bench.strategies.ExactJit` does, so non-array leaves never become jit inputs). The update
    is `polyexec.training.train_step_fn` -- value_and_grad + the optax update, exactly what
    polyexec's strategies run -- of `packed_loss`; ``segment_ids`` and ``positions`` travel in
    train_step_fn's ``lengths`` argument. Infer: ``state`` is the model's arrays, the step is
    `packed_loss` alone and returns the state unchanged (what `bench.workloads.build_step`'s
    infer step does with `loss_fn`).

    Every packed batch has the shape ``(batch_size, cap)``: one trace, one compile. The compile
    is jit's ahead-of-time ``lower(...).compile()`` so its seconds are measured
    (``compile_seconds``); ``compiles`` counts the executables built.
    """

    def __init__(self, cfg: Config, state_file: str | None = None, *, state: Any = None,
                 data_parallel: Any = None):
        if cfg.mode not in ("train", "infer"):
            raise OptionError(f"build_packed_step: cfg.mode: expected 'train' or 'infer', "
                              f"received {cfg.mode!r}")
        self.updates_state = cfg.mode == "train"
        # build_step's own initial state (same weights, same optax.adam(cfg.learning_rate)
        # state; read from state_file when given, as every strategy's worker does), unless the
        # caller passes that state (``state``: build_step(cfg, ...).state).
        initial = build_step(cfg, state_file).state if state is None else state
        self.state, self._static = eqx.partition(initial, eqx.is_array)
        # ``data_parallel`` (a `polyexec.training.DataParallel` with a mesh): the rows of every
        # batch split along the mesh's batch axis, whole rows a device, the state replicated --
        # as `polyexec.training.fit` runs with ``devices=N``; XLA all-reduces the gradients.
        mesh = data_parallel is not None and data_parallel.mesh is not None
        self.devices = data_parallel.size if mesh else 1
        if mesh and cfg.batch_size % self.devices:
            raise OptionError(f"build_packed_step: cfg.batch_size: expected a multiple of the "
                              f"{self.devices} devices (each holds whole rows), received "
                              f"{cfg.batch_size}")
        self.traces = 0
        self.compile_seconds = 0.0
        self._executables: dict[tuple, Any] = {}
        if self.updates_state:
            self.fn = train_step_fn(lambda model, tokens, meta: packed_loss(model, tokens, *meta),
                                    optax.adam(cfg.learning_rate))
        else:
            self.fn = None
        if mesh:
            repl, rows = data_parallel.replicated, data_parallel.batch
            self.state = jax.device_put(self.state, repl)
            self._jitted = jax.jit(self._call, in_shardings=(repl, rows, rows, rows),
                                   out_shardings=(repl, repl))
        else:
            self._jitted = jax.jit(self._call)

    def _call(self, state, tokens, segment_ids, positions):
        self.traces += 1                 # Python runs only when jit traces
        full = eqx.combine(state, self._static)
        if not self.updates_state:
            return packed_loss(full, tokens, segment_ids, positions), state
        new_state, metrics = self.fn(full, tokens, (segment_ids, positions))
        return metrics["loss"], eqx.filter(new_state, eqx.is_array)

    @property
    def compiles(self) -> int:
        """Executables built: one per distinct input shape (one for a whole run)."""
        return len(self._executables)

    def model(self, state) -> Any:
        """The model of a state this step returned."""
        full = eqx.combine(state, self._static)
        return full.model if self.updates_state else full

    def __call__(self, state, batch: PackedBatch):
        args = (state, batch.tokens, batch.segment_ids, batch.positions)
        key = batch.tokens.shape
        executable = self._executables.get(key)
        if executable is None:
            start = time.perf_counter()
            executable = self._jitted.lower(*args).compile()
            self.compile_seconds += time.perf_counter() - start
            self._executables[key] = executable
        return executable(*args)


def build_packed_step(cfg: Config, state_file: str | None = None, *,
                      state: Any = None, data_parallel: Any = None) -> PackedStep:
    """The ``pack`` strategy's step for ``cfg`` (see `PackedStep`)."""
    return PackedStep(cfg, state_file, state=state, data_parallel=data_parallel)
