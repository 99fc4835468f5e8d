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
from typing import Any, Literal

import numpy as np

Model = Literal["gru", "lstm", "attention", "filter-mlp"]
Mode = Literal["train", "infer"]
Source = Literal["pydoc", "file", "lognormal", "uniform", "bimodal"]
Dist = Literal["lognormal", "uniform", "bimodal"]
Warmup = Literal["background", "blocking"]

MODELS: tuple[str, ...] = typing.get_args(Model)
MODES: tuple[str, ...] = typing.get_args(Mode)
DISTS: tuple[str, ...] = typing.get_args(Dist)
WARMUPS: tuple[str, ...] = typing.get_args(Warmup)

# The padded time axis is never below 2: ``loss_fn`` predicts byte t+1 from byte t, so it slices
# ``tokens[:, :-1]`` and needs T >= 2 (a 1-byte example is padded to 2 and contributes no
# prediction). Real-token counts always use the true lengths.
MIN_T = 2


def check_option(where: str, name: str, value: Any, options: tuple[str, ...]) -> str:
    """``value`` if it is one of ``options``; else a ValueError that lists them."""
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"{where}: {name} must be one of {', '.join(map(repr, options))}; "
                         f"got {value!r}")
    return value


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
    buckets: int = 8                  # polyexec's Optimal.fit max_buckets
    limit_rounds: int = 3             # timed chunks per limit shape; the fastest one counts
    limit_seconds: float = 1.0        # the chunks of a shape last this long together
    warmup: str = "background"        # polyexec: "background" or "blocking" warmup

    def __post_init__(self):
        check_option("Config", "model", self.model, MODELS)
        check_option("Config", "mode", self.mode, MODES)
        check_option("Config", "source", self.source, typing.get_args(Source))
        if self.source == "file" and not self.lengths_file:
            raise ValueError("Config: source='file' needs lengths_file")
        if (self.batch_size is None) == (self.max_tokens is None):
            raise ValueError(f"Config: give exactly one of batch_size / max_tokens; got "
                             f"batch_size={self.batch_size!r}, max_tokens={self.max_tokens!r}")
        for name, minimum in (("cap", MIN_T), ("epochs", 2), ("num_examples", 1), ("hidden", 1),
                              ("embed", 1), ("heads", 1), ("buckets", 1), ("limit_rounds", 1)):
            _check_int(name, getattr(self, name), minimum)
        for name, minimum in (("batch_size", 1), ("max_tokens", 1), ("steps", 1)):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum)
        _check_int("seed", self.seed, 0)
        check_option("Config", "warmup", self.warmup, WARMUPS)
        if not self.limit_seconds >= 0:
            raise ValueError(f"Config: limit_seconds must be >= 0, got {self.limit_seconds}")
        if self.max_tokens is not None and self.max_tokens < self.cap:
            raise ValueError(f"Config: max_tokens={self.max_tokens} is below cap={self.cap}: a "
                             f"batch must hold at least one capped example")
        if self.model == "attention" and self.hidden % self.heads:
            raise ValueError(f"Config: attention needs hidden divisible by heads; got "
                             f"hidden={self.hidden}, heads={self.heads}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        return cls(**d)


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"Config: {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"Config: {name} must be >= {minimum}, got {value}")
    return int(value)


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
                raise ValueError(f"--lengths-file {path}: line {number}: expected an integer "
                                 f"length, got {text!r}") from None
            if value < 1:
                raise ValueError(f"--lengths-file {path}: line {number}: lengths must be >= 1, "
                                 f"got {value}")
            out.append(value)
    if not out:
        raise ValueError(f"--lengths-file {path}: no lengths in the file")
    return np.asarray(out, np.int64)


def synthetic_lengths(dist: str, n: int, cap: int, rng: np.random.Generator) -> np.ndarray:
    """Raw (uncapped) lengths >= 1 from a named distribution.

    - ``lognormal``: median 100, sigma 1.0 -- a long tail like natural-language sentences.
    - ``uniform``: every length in 1..cap equally likely (bucketing gains the least).
    - ``bimodal``: 70% short (normal, mean 32, sd 8), 30% long (normal, mean cap/2, sd cap/10):
      padding short examples to the long mode is what pad-to-max pays.
    """
    check_option("synthetic_lengths", "dist", dist, DISTS)
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


def _attention_lm():
    """Build the AttentionLM class lazily: the orchestrating process never imports JAX."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import polyexec as px

    class AttentionLM(eqx.Module):
        """One pre-LayerNorm causal transformer encoder layer over bytes; (T,) -> (T, 256).

        Causal attention means a real position never sees a later (padding) position, so
        padding the end of a sequence changes no real logit: `loss_fn`'s mask is all the
        masking it needs. Attention scores are (heads, T, T): cost quadratic in length.
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
            pos = px.arange_like(tokens).astype(jnp.float32)
            half = self.dim // 2
            freq = jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / half)
            angle = pos[:, None] * freq[None, :]
            enc = jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], axis=-1)
            x = jax.vmap(self.embed)(tokens)
            x = x.at[:, :2 * half].add(enc)
            causal = pos[:, None] >= pos[None, :]
            h = jax.vmap(self.ln1)(x)
            x = x + self.attn(h, h, h, mask=causal)
            h = jax.vmap(self.ln2)(x)
            x = x + jax.vmap(lambda v: self.mlp_out(jax.nn.gelu(self.mlp_in(v))))(h)
            return jax.vmap(lambda v: self.head(self.ln_f(v)))(x)

    return AttentionLM


def build_model(cfg: Config):
    """The initial model for ``cfg`` (the same weights in every process: key from the seed)."""
    import jax

    from examples.rnn.model import CharLM

    key = jax.random.PRNGKey(cfg.seed)
    if cfg.model in ("gru", "lstm"):
        return CharLM(cell=cfg.model, embed=cfg.embed, hidden=cfg.hidden, key=key)
    if cfg.model == "attention":
        return _attention_lm()(dim=cfg.hidden, heads=cfg.heads, key=key)
    raise ValueError(f"build_model: {cfg.model!r} is not a sequence model")


@dataclasses.dataclass
class Step:
    """The benchmarked step ``fn(state, tokens, lengths)``.

    Train: ``state = (model, adam_state)``, returns ``(loss, new_state)`` (value_and_grad + an
    optax Adam update). Infer: ``state = model``, returns the loss only.
    """

    fn: Any
    state: Any
    updates_state: bool


def build_step(cfg: Config, state_file: str | None = None) -> Step:
    """The step of ``cfg`` and its initial state.

    With ``state_file``: the state is read from it when it exists (no eager random ops: under
    load each costs an XLA compile of ~0.2-1.5 s, ~10 s per process in all), and otherwise
    created and written there, so every worker process starts from the very same weights.
    """
    import equinox as eqx
    import optax

    from examples.rnn.model import loss_fn

    optimizer = optax.adam(cfg.learning_rate)

    def initial_state():
        model = build_model(cfg)
        if cfg.mode == "infer":
            return model
        return model, optimizer.init(eqx.filter(model, eqx.is_array))

    if state_file is not None and os.path.exists(state_file):
        state = eqx.tree_deserialise_leaves(state_file, eqx.filter_eval_shape(initial_state))
    else:
        state = initial_state()
        if state_file is not None:
            eqx.tree_serialise_leaves(state_file, state)

    if cfg.mode == "infer":
        def infer_step(model, tokens, lengths):
            return loss_fn(model, tokens, lengths)

        return Step(infer_step, state, updates_state=False)

    def train_step(state, tokens, lengths):
        model, opt_state = state
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens, lengths)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return loss, (eqx.apply_updates(model, updates), opt_state)

    return Step(train_step, state, updates_state=True)
