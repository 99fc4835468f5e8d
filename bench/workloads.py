"""What the benchmark runs: the examples (lengths and byte ids), the model, and its step.

Everything here is deterministic from a `Config`, so the orchestrating process and every
strategy's worker process rebuild exactly the same examples and the same initial weights.

>>> cfg = Config(source="uniform", num_examples=50, cap=64, batch_size=8, seed=1)
>>> data = load_data(cfg)
>>> data.tokens.shape, int(data.lengths.max()) <= 64, data.n_capped
((50, 64), True, 0)
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from collections.abc import Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import polyexec as px
from examples.rnn.model import CharLM, lm_loss, masked_loss_fn
from polyexec.training import TrainState, as_loss_call, train_step_fn

Model = Literal["gru", "lstm", "attention", "filter-mlp", "seq2seq"]
Mode = Literal["train", "infer"]
Source = Literal["pydoc", "file", "lognormal", "uniform", "bimodal"]
Dist = Literal["lognormal", "uniform", "bimodal"]
Warmup = Literal["background", "blocking"]
Layout = Literal["auto", "pad", "pack"]

MODELS: tuple[str, ...] = typing.get_args(Model)
MODES: tuple[str, ...] = typing.get_args(Mode)
SOURCES: tuple[str, ...] = typing.get_args(Source)
DISTS: tuple[str, ...] = typing.get_args(Dist)
WARMUPS: tuple[str, ...] = typing.get_args(Warmup)
LAYOUTS: tuple[str, ...] = typing.get_args(Layout)

# The padded time axis is never below 2: ``lm_loss`` predicts byte t+1 from byte t, so it slices
# ``tokens[:, :-1]`` and needs T >= 2 (a 1-byte example is padded to 2 and contributes no
# prediction). Real-token counts always use the true lengths.
MIN_T = 2


def _check_option(value: Any, options: Sequence[Any], where: str) -> Any:
    """``value`` if it is one of ``options`` (by type as well as value), else `px.OptionError`
    listing them."""
    if not any(value is o or (type(value) is type(o) and value == o) for o in options):
        raise px.OptionError(f"{where}: expected one of {', '.join(map(repr, options))}, "
                             f"received {value!r}")
    return value


def _check_int(value: Any, where: str, *, min: int, optional: bool = False) -> int | None:
    """``value`` as an int >= ``min`` (or None when ``optional``), else `px.OptionError`.

    >>> _check_int(0, "Config: epochs", min=2)
    Traceback (most recent call last):
    polyexec._errors.OptionError: Config: epochs: expected an int >= 2, received 0
    """
    if value is None and optional:
        return None
    if (not isinstance(value, (int, np.integer)) or isinstance(value, bool)
            or value < min):
        raise px.OptionError(f"{where}: expected an int >= {min}"
                             f"{' or None' if optional else ''}, received {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class Config:
    """One benchmark workload; `to_dict`/`from_dict` carry it to worker processes as JSON.

    ``steps`` (optional) shrinks the workload to about ``steps`` batches per epoch by keeping the
    first examples of a seeded shuffle -- the same examples for every strategy.
    """

    model: str = "gru"
    mode: str = "train"
    source: str = "pydoc"
    lengths_file: str | None = None
    num_examples: int = 3000          # synthetic distributions only
    cap: int = 1024
    batch_size: int | None = 32
    max_tokens: int | None = None
    steps: int | None = None
    epochs: int = 2
    seed: int = 0
    hidden: int = 256
    embed: int = 64
    heads: int = 4
    learning_rate: float = 1e-3
    buckets: int | str = "auto"       # polyexec: "auto" (chosen by cost) or Optimal.fit's K
    limit_rounds: int = 3             # timed chunks per limit shape; the fastest one counts
    limit_seconds: float = 1.0        # the chunks of a shape last this long together
    warmup: str = "background"        # polyexec: "background" or "blocking" warmup
    layout: str = "auto"              # polyexec: "auto" (pad or pack, by cost), "pad", "pack"
    devices: int = 1                  # pack and polyexec: rows split over a Mesh of this many

    def __post_init__(self):
        for name, options in (("model", MODELS), ("mode", MODES), ("source", SOURCES),
                              ("warmup", WARMUPS), ("layout", LAYOUTS)):
            _check_option(getattr(self, name), options, f"Config: {name}")
        if self.source == "file" and not self.lengths_file:
            raise px.OptionError(f"Config: lengths_file: expected a path with source='file', "
                                 f"received {self.lengths_file!r}")
        if (self.batch_size is None) == (self.max_tokens is None):
            raise px.OptionError(f"Config: expected exactly one of batch_size / max_tokens, received "
                                 f"batch_size={self.batch_size!r}, max_tokens={self.max_tokens!r}")
        for name, minimum, optional in (
                ("cap", MIN_T, False), ("epochs", 2, False), ("num_examples", 1, False),
                ("hidden", 1, False), ("embed", 1, False), ("heads", 1, False),
                ("limit_rounds", 1, False), ("seed", 0, False), ("devices", 1, False),
                ("batch_size", 1, True), ("max_tokens", 1, True), ("steps", 1, True)):
            _check_int(getattr(self, name), f"Config: {name}", min=minimum, optional=optional)
        if self.buckets != "auto":
            _check_int(self.buckets, "Config: buckets (or 'auto')", min=1)
        if not (isinstance(self.learning_rate, (int, float)) and math.isfinite(self.learning_rate)
                and self.learning_rate > 0):
            raise px.OptionError(f"Config: learning_rate: expected a finite number > 0, received "
                                 f"{self.learning_rate!r}")
        if not self.limit_seconds >= 0:
            raise px.OptionError(f"Config: limit_seconds: expected a number >= 0, received "
                                 f"{self.limit_seconds!r}")
        if self.max_tokens is not None and self.max_tokens < self.cap:
            raise px.OptionError(f"Config: max_tokens: expected at least cap={self.cap} (a batch "
                                 f"must hold one capped example), received {self.max_tokens}")
        if self.devices > 1 and (self.batch_size is None or self.batch_size % self.devices):
            raise px.OptionError(f"Config: batch_size: expected a multiple of devices="
                                 f"{self.devices} (every device holds whole rows), received "
                                 f"batch_size={self.batch_size!r}, max_tokens={self.max_tokens!r}")
        if self.model == "attention" and self.hidden % self.heads:
            raise px.OptionError(f"Config: hidden: expected a multiple of heads={self.heads} for "
                                 f"attention, received {self.hidden}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        return cls(**d)


# ------------------------------------------------------------------------------------- data


@dataclasses.dataclass(frozen=True)
class Data:
    """The examples: row i of ``tokens`` holds example i's byte ids, zeros after its length."""

    tokens: np.ndarray          # (N, cap) int32
    lengths: np.ndarray         # (N,) int64, after the cap
    n_capped: int               # examples the cap truncated
    n_source: int               # examples in the source before --steps selected a subset
    description: str

    @property
    def padded_lengths(self) -> np.ndarray:
        """Lengths floored at `MIN_T`: what bucket policies and padded shapes are built from."""
        return np.maximum(self.lengths, MIN_T)

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())


def read_lengths_file(path: str) -> np.ndarray:
    """One positive integer per line (blank lines and ``#`` comments ignored)."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            try:
                value = int(text)
            except ValueError:
                raise px.OptionError(f"--lengths-file {path}: line {number}: expected an integer "
                                     f"length, received {text!r}") from None
            if value < 1:
                raise px.OptionError(f"--lengths-file {path}: line {number}: expected a length >= 1, "
                                     f"received {value}")
            out.append(value)
    if not out:
        raise px.OptionError(f"--lengths-file {path}: expected at least one length, received none")
    return np.asarray(out, np.int64)


def synthetic_lengths(dist: str, n: int, cap: int, rng: np.random.Generator) -> np.ndarray:
    """Raw (uncapped) lengths >= 1 from a named distribution.

    - ``lognormal``: median 100, sigma 1.0 -- a long tail like natural-language sentences.
    - ``uniform``: every length in 1..cap equally likely (bucketing gains the least).
    - ``bimodal``: 70% short (normal, mean 32, sd 8), 30% long (normal, mean cap/2, sd cap/10):
      padding short examples to the long mode is what pad-to-max pays.
    """
    _check_option(dist, DISTS, "synthetic_lengths: dist")
    if dist == "lognormal":
        raw = np.rint(rng.lognormal(mean=math.log(100.0), sigma=1.0, size=n))
    elif dist == "uniform":
        raw = rng.integers(1, cap + 1, size=n)
    else:
        short = rng.random(n) < 0.7
        raw = np.where(short, rng.normal(32, 8, size=n), rng.normal(cap / 2, cap / 10, size=n))
        raw = np.rint(raw)
    return np.maximum(raw, 1).astype(np.int64)


def load_data(cfg: Config) -> Data:
    """The workload's examples, capped at ``cfg.cap``, optionally cut to ``cfg.steps`` batches."""
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 7]))
    sentences = None
    if cfg.source == "pydoc":
        from buckets import corpus
        sentences = corpus.pydoc_sentences()
        raw = np.fromiter((len(s) for s in sentences), np.int64, count=len(sentences))
        what = f"pydoc_data.topics sentences ({len(sentences)})"
    elif cfg.source == "file":
        raw = read_lengths_file(cfg.lengths_file)
        what = f"lengths from {cfg.lengths_file} ({raw.size}), random byte ids"
    else:
        raw = synthetic_lengths(cfg.source, cfg.num_examples, cfg.cap, rng)
        what = f"{cfg.source} lengths ({raw.size}), random byte ids"
    n_source = raw.size

    keep = np.arange(raw.size)
    if cfg.steps is not None:
        # The same subset for every strategy: the first examples of one seeded shuffle, enough
        # for `steps` batches (by count, or by real tokens under a token budget).
        order = np.random.default_rng(np.random.SeedSequence([cfg.seed, 11])).permutation(raw.size)
        if cfg.batch_size is not None:
            n = cfg.steps * cfg.batch_size
        else:
            budget = cfg.steps * cfg.max_tokens
            n = int(np.searchsorted(np.cumsum(np.minimum(raw[order], cfg.cap)), budget)) + 1
        keep = np.sort(order[:min(n, raw.size)])
    raw = raw[keep]
    lengths = np.minimum(raw, cfg.cap)
    n_capped = int((raw > cfg.cap).sum())

    tokens = np.zeros((keep.size, cfg.cap), np.int32)
    if sentences is not None:
        for row, i in enumerate(keep):
            s = sentences[i][:cfg.cap]
            tokens[row, :len(s)] = np.frombuffer(s, np.uint8)
    else:
        ids = rng.integers(1, 256, size=tokens.shape, dtype=np.int32)
        tokens = np.where(np.arange(cfg.cap)[None, :] < lengths[:, None], ids, 0).astype(np.int32)
    if cfg.steps is not None:
        what += f", {keep.size} of them kept for --steps {cfg.steps}"
    return Data(tokens, lengths, n_capped, n_source, what)


# ------------------------------------------------------------------------------ the models


class AttentionLM(eqx.Module):
    """One pre-LayerNorm causal transformer encoder layer over bytes; (T,) -> (T, 256).

    Causal attention means a real position never sees a later (padding) position, so
    padding the end of a sequence changes no real logit: the loss's mask (or polyexec's
    ragged rows) is all the masking it needs. Attention scores are (heads, T, T): cost quadratic in length.
    Positions are sinusoidal, computed from the input's own length (no table of a
    maximum length, which would make the trace reshaping-impossible).
    """

    embed: eqx.nn.Embedding
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear
    ln_f: eqx.nn.LayerNorm
    head: eqx.nn.Linear
    dim: int = eqx.field(static=True)

    def __init__(self, *, dim: int, heads: int, key):
        k = jax.random.split(key, 5)
        self.dim = dim
        self.embed = eqx.nn.Embedding(256, dim, key=k[0])
        self.ln1, self.ln2, self.ln_f = (eqx.nn.LayerNorm(dim) for _ in range(3))
        self.attn = eqx.nn.MultiheadAttention(heads, dim, key=k[1])
        self.mlp_in = eqx.nn.Linear(dim, 4 * dim, key=k[2])
        self.mlp_out = eqx.nn.Linear(4 * dim, dim, key=k[3])
        self.head = eqx.nn.Linear(dim, 256, key=k[4])

    def __call__(self, tokens):
        pos = px.arange_like(tokens)
        return self.logits(tokens, pos, pos[:, None] >= pos[None, :])

    def logits(self, tokens, positions, mask):
        """The forward pass with the positions the sinusoidal encoding reads and the attention
        mask given: `__call__` is one causal sequence; the packing peer gives each packed
        segment its own positions and a mask within the segment (`bench.packing`)."""
        pos = positions.astype(jnp.float32)
        half = self.dim // 2
        freq = jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / half)
        angle = pos[:, None] * freq[None, :]
        enc = jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], axis=-1)
        x = jax.vmap(self.embed)(tokens)
        x = x.at[:, :2 * half].add(enc)
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h, mask=mask)
        h = jax.vmap(self.ln2)(x)
        x = x + jax.vmap(lambda v: self.mlp_out(jax.nn.gelu(self.mlp_in(v))))(h)
        return jax.vmap(lambda v: self.head(self.ln_f(v)))(x)


def build_model(cfg: Config):
    """The initial model for ``cfg`` (the same weights in every process: key from the seed)."""
    key = jax.random.PRNGKey(cfg.seed)
    if cfg.model in ("gru", "lstm"):
        return CharLM(cell=cfg.model, embed=cfg.embed, hidden=cfg.hidden, key=key)
    if cfg.model == "attention":
        return AttentionLM(dim=cfg.hidden, heads=cfg.heads, key=key)
    raise px.OptionError(f"build_model: model: expected one of 'gru', 'lstm', 'attention', "
                         f"received {cfg.model!r}")


@dataclasses.dataclass(frozen=True)
class Step:
    """The benchmarked step ``fn(state, batch, lengths)``.

    Train: `polyexec.training.train_step_fn` -- the very step `polyexec.training.fit` runs
    (value_and_grad + an optax Adam update) -- over a `TrainState`, returning ``(new state,
    metrics)``. Infer: ``state`` is the model and ``fn`` the loss. ``batch`` is `fit`'s form,
    ``{"tokens": (B, T)}``, for the model as written (``fields``), else the bare tokens the
    hand-masked loss takes, as plain ``jax.jit`` runs it; `batch` and `batch_spec` give
    either from the tokens.
    """

    fn: Any
    state: Any
    updates_state: bool
    fields: bool = False

    def batch(self, tokens: Any) -> Any:
        """The step's batch argument holding ``tokens (B, T)``."""
        return {"tokens": tokens} if self.fields else tokens

    def batch_spec(self, B: px.LengthVar, T: px.LengthVar) -> Any:
        """The batch argument's Specs for `px.bucketed`."""
        spec = px.Spec((B, T), jnp.int32)
        return {"tokens": spec} if self.fields else spec

    def loss_and_state(self, out: Any, state: Any) -> tuple[Any, Any]:
        """The loss and the state after a call that returned ``out`` and was given ``state``."""
        if self.updates_state:
            new_state, metrics = out
            return metrics["loss"], new_state
        return out, state


def build_step(cfg: Config, state_file: str | None = None, *, masked: bool = True) -> Step:
    """The step of ``cfg`` and its initial state; its loss masked by hand (``masked``, for
    plain jax.jit of padded batches) or as the model is written, without a mask (for
    polyexec, whose ragged rows make every row its own length).

    With ``state_file``: the state is read from it when it exists (no eager random ops: under
    load each costs an XLA compile of ~0.2-1.5 s, ~10 s per process in all), and otherwise
    created and written there, so every worker process starts from the very same weights.
    """
    optimizer = optax.adam(cfg.learning_rate)

    def initial_state():
        model = build_model(cfg)
        return model if cfg.mode == "infer" else TrainState.create(model, optimizer)

    if state_file is not None and os.path.exists(state_file):
        state = eqx.tree_deserialise_leaves(state_file, eqx.filter_eval_shape(initial_state))
    else:
        state = initial_state()
        if state_file is not None:
            eqx.tree_serialise_leaves(state_file, state)
    # The model as written takes fit's batch and no lengths: called as fit calls it (the
    # lengths still reach the program, making T ragged along B).
    loss = masked_loss_fn if masked else as_loss_call(lm_loss, "lm_loss", one_field=False)
    if cfg.mode == "infer":
        return Step(loss, state, updates_state=False, fields=not masked)
    return Step(train_step_fn(loss, optimizer), state, updates_state=True, fields=not masked)
