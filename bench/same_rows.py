"""The generated packed program against the hand-written one, at the same rows.

`polyexec-bench`'s ``polyexec-pack`` strategy and its ``pack`` peer run the same packed rows,
but one after the other in separate processes, where the drift of a shared machine (10-15% a
run on 2 CPU cores) falls on one of them. This compiles both steps in one process at the
peer's first batch (Grain's rows of the cap; polyexec packs the same examples itself, into
the same number of rows), checks that both give the same loss from the same weights, then
calls them alternately, the first of each round taking turns, and reports each one's fastest
and median step and their ratio (polyexec's seconds / the peer's: below 1 is faster).

The step is the bench's (`bench.workloads.build_step`: value_and_grad and an optax Adam
update; the model as written for polyexec, `bench.packing`'s segment-id step for the peer).
``--part gradient`` compares value_and_grad of the loss alone, ``--part loss`` the loss alone
(the model as written against `bench.packing.packed_loss`): where a gap between the steps
comes from.

    python -m bench.same_rows                                     # GRU, 32 rows of 1,024
    python -m bench.same_rows --model attention --cap 512 --rounds 7
    python -m bench.same_rows --part gradient
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import polyexec as px
from bench import packing, strategies
from bench.workloads import MODELS, Config, build_model, build_step, load_data
from examples.rnn.model import lm_loss

PARTS = ("step", "gradient", "loss")


def programs(cfg: Config, part: str = "step"):
    """``(run polyexec, run the peer, real tokens)`` of the peer's first batch: each run
    returns the loss of ``part`` (the train step, value_and_grad of the loss, or the loss),
    computed from the initial weights, and the rest of what the program returned."""
    data = load_data(cfg)
    first = packing.pack_epoch(cfg, data, 0)[0]
    T = px.LengthVar("T", min=2, max=cfg.cap)
    B = px.LengthVar("B", max=cfg.batch_size * cfg.cap)
    tokens, lengths = strategies.batch_arrays(data, np.concatenate(first.examples))
    lengths_spec = px.Spec((B,), jnp.int32, lengths_of=T)
    packed = dict(buckets={T: [cfg.cap]}, layout="pack", pack_rows={cfg.cap: cfg.batch_size},
                  name="polyexec-pack")
    if part == "step":
        peer = packing.build_packed_step(cfg)
        step = build_step(cfg, masked=False)
        f = px.bucketed(step.fn, in_specs=(None, step.batch_spec(B, T), lengths_spec), **packed)

        def ours():
            out = f(step.state, step.batch(tokens), lengths)
            return step.loss_and_state(out, step.state)[0], out

        def theirs():
            return peer(peer.state, first)
        return ours, theirs, first.real_tokens
    model = build_model(cfg)

    def loss(model, tokens, lengths):       # the lengths make T ragged along B
        return lm_loss(model, {"tokens": tokens})
    peer_loss = packing.packed_loss
    if part == "gradient":
        loss, peer_loss = jax.value_and_grad(loss), jax.value_and_grad(peer_loss)
    f = px.bucketed(loss, in_specs=(None, px.Spec((B, T), jnp.int32), lengths_spec), **packed)
    peer_jit = jax.jit(peer_loss)
    layout = [jnp.asarray(a) for a in (first.tokens, first.segment_ids, first.positions)]

    def ours():
        out = f(model, tokens, lengths)
        return (out[0] if part == "gradient" else out), out

    def theirs():
        out = peer_jit(model, *layout)
        return (out[0] if part == "gradient" else out), out
    return ours, theirs, first.real_tokens


def timed(run) -> float:
    start = time.perf_counter()
    jax.block_until_ready(run())
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=[m for m in MODELS if m not in ("filter-mlp", "seq2seq")],
                        default="gru")
    parser.add_argument("--cap", type=int, default=1024, help="the rows' length")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--embed", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=9, help="alternating calls of each")
    parser.add_argument("--part", choices=PARTS, default="step",
                        help="the train step (default), value_and_grad of the loss, or the loss")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds: expected an int >= 1, received {args.rounds}")

    px.disable_persistent_cache()
    cfg = Config(model=args.model, cap=args.cap, batch_size=args.rows, hidden=args.hidden,
                 embed=args.embed)
    ours, theirs, real = programs(cfg, args.part)
    losses = {"polyexec": float(ours()[0]), "peer": float(theirs()[0])}    # compiles both
    what = {"step": "train step", "gradient": "value_and_grad of the loss", "loss": "loss"}
    print(f"{args.model} {what[args.part]}, {args.rows} rows of {args.cap} ({real:,} real "
          f"tokens); jax {jax.__version__} on {jax.devices()[0].platform}")
    print(f"loss from the same weights: polyexec {losses['polyexec']:.6f}, the peer "
          f"{losses['peer']:.6f}")
    seconds: dict[str, list[float]] = {"polyexec": [], "peer": []}
    runs = {"polyexec": ours, "peer": theirs}
    for r in range(args.rounds):
        for name in (("polyexec", "peer") if r % 2 == 0 else ("peer", "polyexec")):
            seconds[name].append(timed(runs[name]))
    result = {name: {"fastest_s": min(s), "median_s": statistics.median(s), "seconds": s}
              for name, s in seconds.items()}
    ratio = {k: result["polyexec"][k] / result["peer"][k] for k in ("fastest_s", "median_s")}
    for name, r in result.items():
        print(f"{name:>8}: fastest {r['fastest_s']:.4f} s, median {r['median_s']:.4f} s "
              f"({args.rounds} rounds)")
    print(f"polyexec / peer seconds: fastest {ratio['fastest_s']:.3f}x, median "
          f"{ratio['median_s']:.3f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "part": args.part, "rows": args.rows, "cap": args.cap,
                       "real_tokens": real, "losses": losses, **result, "ratio": ratio}, fh,
                      indent=1)
    if not np.isclose(losses["polyexec"], losses["peer"], rtol=1e-4):
        print("the two programs' losses differ: they did not run the same examples")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
