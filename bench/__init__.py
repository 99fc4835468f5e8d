"""The sequence-length benchmark behind ``polyexec-bench`` (also ``python -m bench``).

One workload -- the examples/rnn GRU or LSTM character LM or one causal attention layer, as a
train step (value_and_grad + optax Adam) or inference, on the pydoc corpus, a lengths file or a
synthetic length distribution -- runs under several padding strategies, each reported as a
fraction of the limit measured in the same run:

- ``pad-max``: random batches padded to the cap (one compile);
- ``exact``: random batches, plain ``jax.jit`` at each batch's exact longest length (one
  compile per distinct length);
- ``pow2`` / ``fixed:S1,S2,...``: random batches, ``px.bucketed`` with power-of-two or given
  buckets;
- ``pack``: the peer a JAX user builds instead of bucketing (``bench.packing``): the shared
  random order packed first-fit into rows of the cap by Grain, a hand-written segment-id
  model, one compile; packing is timed with the epoch, and it takes fewer, fuller steps;
- ``polyexec``: ``buckets.Optimal.fit`` buckets, length-grouped batches from
  ``buckets.batch_plan``, buckets compiled ahead of need (in the background by default);
- ``polyexec-cached``: the same in a second process that finds every bucket in the
  persistent compile cache the ``polyexec`` process filled.
- ``polyexec-nomask``: ``polyexec`` with the executor's logical-length rewrite off
  (``px.bucketed(..., masking=False)``), so what the rewrite costs shows side by side.

Every strategy runs every example once per epoch, random-batch strategies in one shared
order; grouped strategies visit the same examples in length-grouped batches, ``pack`` in
packed rows. Each epoch's loss is its summed nats over its predictions, so strategies that
batch differently compare at equal data. Each strategy
runs in its own worker process (its own peak RSS, no shared in-memory compile caches).

**The limit** is the same step at padding efficiency 1.0 with nothing to compile. The
examples are split into length groups (``Optimal.fit`` with ``--buckets`` groups); a group of
n examples with mean length m is stood in for by batches of rows that are all of length m
(every row real, the same real tokens as the group): ``batch-size`` rows, and as many rows as
a batch of the cap holds tokens (``batch-size * cap // m``). Packed rows run that many tokens
a step, and a larger step costs less per token, so a limit of ``batch-size`` rows alone was
beaten by packing (1.04 of it on pydoc): the limit is the fastest all-real step measured. The
step is compiled with plain ``jax.jit`` at each shape, then timed in chunks of back-to-back
calls; the fastest chunk gives the shape's rate, the faster shape the group's, and the limit
is total real tokens over the time all groups take at their rates. It is measured twice, before and after the strategies (the
second pass loads its programs from its own compile cache), and the faster rate per group
counts: on a shared machine other processes only ever slow a measurement down. Why this
choice: equal-length rows keep the per-row cost of each part of the length distribution
(quadratic for attention: m^2 is close to the mean of l^2 within a tight group), while a
packed stream of one fixed length would not; timing at fixed shapes after compiling removes
compile cost by construction.

>>> from bench.cli import main
>>> main(["--quick", "--strategies", "pad-max,polyexec", "--no-progress"])  # doctest: +SKIP
0
"""

from .cli import main

__all__ = ["main"]
