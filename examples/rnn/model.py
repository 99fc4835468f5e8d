"""Byte-level recurrent language model, written once for every length.

Nothing here knows a maximum length or masks anything: shapes come from the inputs, and
polyexec makes every row of a padded batch its own length (the batch's lengths are a
``lengths_of`` input), so a batch padded to any bucket gives the same loss and gradients.
`masked_loss_fn` is the same loss masked by hand, for plain ``jax.jit`` of padded batches.
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


def loss_fn(model: CharLM, tokens, lengths):
    """Mean next-byte cross-entropy in nats: plain code, no mask.

    ``tokens: (B, T)``; ``lengths: (B,)`` is not read here: under polyexec it is the input with
    ``lengths_of="T"`` that makes T ragged along B, so every row is seen at its own length --
    ``tokens[:, :-1]`` is each row's first n-1 bytes, the scan stops at each row's end and the
    mean counts the real predictions only (a sequence of length n contributes n-1). Under
    plain ``jax.jit`` of a padded batch the padding would count: use `masked_loss_fn` there.
    """
    total, count = loss_and_count(model, tokens, lengths)
    return total / jnp.maximum(count, 1)


def loss_and_count(model: CharLM, tokens, lengths):
    """Summed nats and the number of predictions, for exact averages across batches."""
    logits = jax.vmap(model)(tokens[:, :-1])                       # (B, T-1, 256)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.sum(nll), nll.size


def masked_loss_fn(model: CharLM, tokens, lengths):
    """`loss_fn` written by hand for padded batches: the padding masked by ``lengths``. Right
    under plain ``jax.jit`` too, and (the masks being ordinary code) under polyexec."""
    total, count = masked_loss_and_count(model, tokens, lengths)
    return total / jnp.maximum(count, 1)


def masked_loss_and_count(model: CharLM, tokens, lengths):
    """`loss_and_count` with the padding masked by hand."""
    logits = jax.vmap(model)(tokens[:, :-1])
    targets = tokens[:, 1:]
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    mask = px.sequence_mask(lengths - 1, targets, axis=1)
    return jnp.sum(jnp.where(mask, nll, 0.0)), jnp.sum(mask)
