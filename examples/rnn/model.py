"""Byte-level recurrent language model, written once for every length.

Nothing here knows a maximum length or masks anything: shapes come from the inputs, and
polyexec makes every row of a padded batch its own length (the batch's lengths are a
``lengths_of`` input), so a batch padded to any bucket gives the same loss and gradients.
`masked_lm_loss` is the same loss masked by hand, for plain ``jax.jit`` of padded batches.
The losses take `fit`'s batch, ``{"tokens": (B, T)}``; `loss_fn` and its kin are the same over
bare token arrays, as `px.bucketed` and ``jax.jit`` call them.
"""

from __future__ import annotations

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp

import polyexec as px

VOCAB = 256  # bytes


class CharLM(eqx.Module):
    """Embedding -> GRU or LSTM cell scanned over time -> logits over the next byte.

    >>> import jax, jax.numpy as jnp
    >>> model = CharLM(cell="gru", hidden=32, key=jax.random.PRNGKey(0))
    >>> model(jnp.array([72, 105, 33])).shape
    (3, 256)
    """

    embed: eqx.nn.Embedding
    cell: eqx.Module
    head: eqx.nn.Linear
    kind: str = eqx.field(static=True)

    def __init__(self, *, cell: Literal["gru", "lstm"] = "gru", embed: int = 64,
                 hidden: int = 256, key):
        if cell not in ("gru", "lstm"):
            raise px.OptionError(f"CharLM: cell: expected one of 'gru', 'lstm', received {cell!r}")
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, embed, key=k1)
        cls = eqx.nn.GRUCell if cell == "gru" else eqx.nn.LSTMCell
        self.cell = cls(embed, hidden, key=k2)
        self.head = eqx.nn.Linear(hidden, VOCAB, key=k3)
        self.kind = cell

    @property
    def hidden_size(self) -> int:
        return self.cell.hidden_size

    def initial_state(self):
        zeros = jnp.zeros((self.hidden_size,))
        return (zeros, zeros) if self.kind == "lstm" else zeros

    def step(self, state, token):
        """One byte in, the next state and the logits for the byte after it."""
        state = self.cell(self.embed(token), state)
        hidden = state[0] if self.kind == "lstm" else state
        return state, self.head(hidden)

    def __call__(self, tokens):
        """Logits for every position of one sequence ``tokens: (T,)`` -> ``(T, 256)``."""
        # A closure, not the bound method: scan hashes its function, and a module holds arrays.
        _, logits = jax.lax.scan(lambda s, t: self.step(s, t), self.initial_state(), tokens)
        return logits


def lm_loss(model: CharLM, batch):
    """Mean next-byte cross-entropy in nats: plain code, no mask -- `fit`'s form.

    ``batch = {"tokens": (B, T)}``, the examples' pytree with a leading ``B``. The loss asks
    for no ``lengths``: under polyexec the batch's lengths (an input with ``lengths_of="T"``,
    which `fit` always passes to its step) make T ragged along B, so every row is seen at its
    own length -- ``tokens[:, :-1]`` is each row's first n-1 bytes, the scan stops at each
    row's end and the mean counts the real predictions only (a sequence of length n
    contributes n-1). Under plain ``jax.jit`` of a padded batch the padding would count: use
    `masked_lm_loss` there.

    >>> import jax, jax.numpy as jnp
    >>> model = CharLM(hidden=8, key=jax.random.PRNGKey(0))
    >>> float(lm_loss(model, {"tokens": jnp.array([[72, 105, 33]])})) > 0
    True
    """
    total, count = lm_loss_and_count(model, batch)
    return total / jnp.maximum(count, 1)


def lm_loss_and_count(model: CharLM, batch):
    """Summed nats and the number of predictions, for exact averages across batches (`fit`'s
    ``eval_fn``)."""
    tokens = batch["tokens"]
    logits = jax.vmap(model)(tokens[:, :-1])                       # (B, T-1, 256)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.sum(nll), nll.size


def masked_lm_loss(model: CharLM, batch, lengths):
    """`lm_loss` written by hand for padded batches: the padding masked by ``lengths`` (`fit`
    passes a parameter of that name the real lengths). Right under plain ``jax.jit`` too,
    and (the masks being ordinary code) under polyexec."""
    total, count = masked_lm_loss_and_count(model, batch, lengths)
    return total / jnp.maximum(count, 1)


def masked_lm_loss_and_count(model: CharLM, batch, lengths):
    """`lm_loss_and_count` with the padding masked by hand."""
    tokens = batch["tokens"]
    logits = jax.vmap(model)(tokens[:, :-1])
    targets = tokens[:, 1:]
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    mask = px.sequence_mask(lengths - 1, targets, axis=1)
    return jnp.sum(jnp.where(mask, nll, 0.0)), jnp.sum(mask)


# The same losses over bare token arrays ``(model, tokens (B, T), lengths (B,))``: the
# positional form `px.bucketed` and ``jax.jit`` call directly, and `fit`'s shorthand for
# examples that are bare 1-D token arrays.

def loss_fn(model: CharLM, tokens, lengths):
    """`lm_loss` of ``{"tokens": tokens}``; ``lengths`` is not read (see `lm_loss`)."""
    return lm_loss(model, {"tokens": tokens})


def loss_and_count(model: CharLM, tokens, lengths):
    """`lm_loss_and_count` of ``{"tokens": tokens}``."""
    return lm_loss_and_count(model, {"tokens": tokens})


def masked_loss_fn(model: CharLM, tokens, lengths):
    """`masked_lm_loss` of ``{"tokens": tokens}``."""
    return masked_lm_loss(model, {"tokens": tokens}, lengths)


def masked_loss_and_count(model: CharLM, tokens, lengths):
    """`masked_lm_loss_and_count` of ``{"tokens": tokens}``."""
    return masked_lm_loss_and_count(model, {"tokens": tokens}, lengths)
