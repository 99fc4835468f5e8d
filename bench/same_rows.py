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

    python -m bench.same_rows                                     # GRU, 32 rows of 1,024
    python -m bench.same_rows --model attention --cap 512 --rounds 7
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
from bench.workloads import MODELS, Config, build_step, load_data


def programs(cfg: Config):
    """``(run polyexec, run the peer, real tokens)`` of the peer's first batch: each run
    returns its step's loss, computed from the initial weights."""
    data = load_data(cfg)
    first = packing.pack_epoch(cfg, data, 0)[0]
    peer = packing.build_packed_step(cfg)
    step = build_step(cfg, masked=False)
    T = px.LengthVar("T", min=2, max=cfg.cap)
    B = px.LengthVar("B", max=cfg.batch_size * cfg.cap)
    f = px.bucketed(step.fn, in_specs=(None, step.batch_spec(B, T),
                                       px.Spec((B,), jnp.int32, lengths_of=T)),
                    buckets={T: [cfg.cap]}, layout="pack", pack_rows={cfg.cap: cfg.batch_size},
                    name="polyexec-pack")
    tokens, lengths = strategies.batch_arrays(data, np.concatenate(first.examples))

    def ours():
        return step.loss_and_state(f(step.state, step.batch(tokens), lengths), step.state)[0]

    def theirs():
        return peer(peer.state, first)[0]
    return ours, theirs, first.real_tokens


def timed(run) -> float:
    start = time.perf_counter()
    jax.block_until_ready(run())
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=[m for m in MODELS if m != "filter-mlp"],
                        default="gru")
    parser.add_argument("--cap", type=int, default=1024, help="the rows' length")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--embed", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=9, help="alternating calls of each")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds: expected an int >= 1, received {args.rounds}")

    px.disable_persistent_cache()
    cfg = Config(model=args.model, cap=args.cap, batch_size=args.rows, hidden=args.hidden,
                 embed=args.embed)
    ours, theirs, real = programs(cfg)
    losses = {"polyexec": float(ours()), "peer": float(theirs())}    # compiles both
    print(f"{args.model} train step, {args.rows} rows of {args.cap} ({real:,} real tokens); "
          f"jax {jax.__version__} on {jax.devices()[0].platform}")
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
            json.dump({"model": args.model, "rows": args.rows, "cap": args.cap,
                       "real_tokens": real, "losses": losses, **result, "ratio": ratio}, fh,
                      indent=1)
    if not np.isclose(losses["polyexec"], losses["peer"], rtol=1e-4):
        print("the two programs' losses differ: they did not run the same examples")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
