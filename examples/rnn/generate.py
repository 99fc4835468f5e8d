"""Sampling sentences: a bounded ``lax.while_loop`` whose output length depends on the data.

The loop writes into a fixed buffer of ``max_len`` bytes and stops at a sentence end ('.' or a
newline, after the prompt) or when the buffer is full; it returns the buffer and the count of
bytes written. One compile serves every prompt and every output length — the caller slices
``buffer[:count]`` on the host (the bounded-buffer + count pattern).
"""

from __future__ import annotations

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import polyexec as px

STOP_BYTES = (ord("."), ord("\n"))


@eqx.filter_jit
def sample(model, prompts, prompt_lengths, keys, *, max_len: int = 200, temperature: float = 0.8):
    """Continue each prompt until a sentence end; ``(buffers (N, max_len) int32, counts (N,))``.

    ``prompts``: (N, max_len) int32 padded prompt bytes, ``prompt_lengths``: (N,) >= 1,
    ``keys``: (N, 2) PRNG keys. ``temperature=0`` is greedy.

    >>> import jax, numpy as np
    >>> from examples.rnn.model import CharLM
    >>> model = CharLM(hidden=16, embed=8, key=jax.random.PRNGKey(0))
    >>> buf, n = sample(model, np.zeros((2, 32), np.int32) + 65, np.array([3, 1]),
    ...                 jax.random.split(jax.random.PRNGKey(1), 2), max_len=32)
    >>> buf.shape, bool((n >= np.array([3, 1])).all()), bool((n <= 32).all())
    ((2, 32), True, True)
    """
    stop = jnp.asarray(STOP_BYTES, jnp.int32)

    def one(prompt, plen, key):
        def cond(carry):
            i, _, _, _, _, done = carry
            return (i < max_len - 1) & ~done

        def body(carry):
            i, state, token, buf, key, _ = carry
            state, logits = model.step(state, token)
            key, sub = jax.random.split(key)
            if temperature == 0:
                drawn = jnp.argmax(logits).astype(jnp.int32)
            else:
                drawn = jax.random.categorical(sub, logits / temperature).astype(jnp.int32)
            forced = i + 1 < plen            # still reading the prompt
            nxt = jnp.where(forced, buf[i + 1], drawn)
            buf = buf.at[i + 1].set(nxt)
            done = ~forced & jnp.any(nxt == stop)
            return i + 1, state, nxt, buf, key, done

        init = (jnp.int32(0), model.initial_state(), prompt[0], prompt, key, jnp.bool_(False))
        i, _, _, buf, _, _ = jax.lax.while_loop(cond, body, init)
        return buf, i + 1

    return jax.vmap(one)(prompts, prompt_lengths, keys)


def generate(model, prompts: Sequence[bytes], *, seed: int = 0, max_len: int = 200,
             temperature: float = 0.8) -> list[bytes]:
    """Sampled continuations of ``prompts`` (bytes), each ending at a sentence end or at
    ``max_len`` bytes, prompt included."""
    if not prompts or any(not 1 <= len(p) < max_len for p in prompts):
        raise px.OptionError(f"generate: prompts: expected 1 to {max_len - 1} bytes each, "
                             f"received lengths {[len(p) for p in prompts]}")
    buf = np.zeros((len(prompts), max_len), np.int32)
    for r, p in enumerate(prompts):
        buf[r, :len(p)] = np.frombuffer(p, np.uint8)
    lengths = np.array([len(p) for p in prompts], np.int32)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(prompts))
    out, counts = sample(model, buf, lengths, keys, max_len=max_len, temperature=temperature)
    out, counts = np.asarray(out), np.asarray(counts)
    return [bytes(out[r, :counts[r]].astype(np.uint8)) for r in range(len(prompts))]
