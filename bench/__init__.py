"""The sequence-length benchmark behind ``polyexec-bench`` (also ``python -m bench``).

One workload (a GRU/LSTM character LM or a causal attention layer, train step or inference, on
the pydoc corpus or synthetic lengths) runs under several padding strategies -- pad to the cap,
exact-shape jit, power-of-two buckets, fixed buckets, polyexec (fitted buckets + length-grouped
batches + warmup) and polyexec from the persistent compile cache -- and each is reported as a
fraction of the limit measured in the same run: the same step with every row real and nothing
left to compile.

>>> from bench.cli import main
>>> main(["--quick", "--strategies", "pad-max,polyexec", "--no-progress"])  # doctest: +SKIP
0
"""

from .cli import main

__all__ = ["main"]
