"""What one more shape costs to compile: polyexec's executor against plain ``jax.jit``.

The step is the benchmark's (`bench.workloads.build_step`: the GRU CharLM train step,
value_and_grad and an optax Adam update, embedding 64, hidden 256, 32 rows), measured side by
side in one process at the same (rows, T):

* **polyexec, per layout** (``pad``, ``pack``): exactly what the executor does for a new
  shape (`Bucketed.warmup` at it; the seconds are the executor's own ``stats``, as the bench
  reports them): lower the plan's one exported program (``jax.jit(Exported.call)``: no Python,
  no retrace) at the shape's avals, refine its symbolic shapes and compile it with XLA. Split
  into ``xla`` (XLA's backend compile, from JAX's compile events) and ``rest`` (everything
  else: placing, lowering, shape refinement). The pad layout runs the unmasked model through
  the logical rewrite; the pack layout packs one sequence of T a row;
* **jit**: a fresh ``jax.jit`` of the hand-masked step (what the bench's ``jax.jit``
  strategies and its limit compile): trace, lower, compile (``xla`` again from the events).

Every measurement is at a size new to both (T, T - 1, ... for the repeats; the persistent
compile cache is off), the paths rotate which goes first so drift from other load on the
machine falls on all, and the median over ``--repeat`` rounds is reported. Each layout's
loss at T is checked against jit's on the same full rows.

It also prints each layout's plan, made once before any compile (`Plan.seconds`: trace, the
logical rewrite, the packed rewrite), and the plan of the bench's ``layout="auto"`` step, and
counts Python traces (a counter inside the step) against compiles.

    python -m bench.core_timing                          # T = 256 1024, 3 rounds
    python -m bench.core_timing --sizes 48 --hidden 32 --repeat 1 --json timing.json   # quick
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
from bench.workloads import Config, build_step

LAYOUTS = ("pad", "pack")


def _counted(fn, calls: list):
    def step(*args):
        calls.append(1)
        return fn(*args)
    return step


def bucketed(step, layout: str, sizes: list[int], rows: int, traces: list):
    """The bench's bucketed step (`bench.strategies.bucketed_step`'s Specs) in one layout,
    with a bucket at every size measured."""
    T = px.LengthVar("T", min=2, max=max(sizes))
    B = px.LengthVar("B", max=rows)
    return px.bucketed(_counted(step.fn, traces), name=f"train_step_{layout}",
                       in_specs=(None, step.batch_spec(B, T),
                                 px.Spec((B,), jnp.int32, lengths_of=T)),
                       buckets={T: sorted(set(sizes)), B: [rows]}, layout=layout)


def add_shape_polyexec(f, state, rows: int, t: int) -> dict:
    """The executor compiling one new shape: its own seconds, XLA's part of them."""
    before = f.stats.compile_seconds
    with px.count_compiles() as events:
        f.warmup(state, sizes=[{"B": rows, "T": t}], max_workers=1)
    total = f.stats.compile_seconds - before
    assert events.xla_compiles == 1, events
    return {"total_s": total, "xla_s": events.backend_seconds,
            "rest_s": total - events.backend_seconds}


def add_shape_jit(step, rows: int, t: int) -> dict:
    """Plain jax.jit at a new shape: trace, lower, compile."""
    tokens = step.batch(jax.ShapeDtypeStruct((rows, t), jnp.int32))
    lengths = jax.ShapeDtypeStruct((rows,), jnp.int32)
    jitted = jax.jit(step.fn)      # a fresh jit object: nothing cached from an earlier size
    with px.count_compiles() as events:
        start = time.perf_counter()
        traced = jitted.trace(step.state, tokens, lengths)
        lowered = traced.lower()
        compiled = lowered.compile()
        total = time.perf_counter() - start
    return {"total_s": total, "xla_s": events.backend_seconds,
            "rest_s": total - events.backend_seconds, "executable": compiled}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024],
                        help="sequence lengths T at which each path compiles a new shape")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--embed", type=int, default=64)
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--repeat", type=int, default=3,
                        help="rounds (at T, T-1, ...); medians are reported")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args(argv)
    if min(args.sizes) - args.repeat < 2:
        parser.error(f"--sizes: every T must be at least {args.repeat + 2} (--repeat "
                     f"{args.repeat} rounds at T, T-1, ...)")

    px.disable_persistent_cache()
    cfg = Config(hidden=args.hidden, embed=args.embed, batch_size=args.rows)
    ours = build_step(cfg, masked=False)      # the model as written, as polyexec runs it
    theirs = build_step(cfg, masked=True)     # hand-masked, as the bench's jax.jit runs it
    all_sizes = [t - r for t in args.sizes for r in range(args.repeat)]
    traces: dict[str, list] = {layout: [] for layout in args.layouts}
    fns = {layout: bucketed(ours, layout, all_sizes, args.rows, traces[layout])
           for layout in args.layouts}
    print(f"the bench's train step (GRU, embed {args.embed}, hidden {args.hidden}), {args.rows} "
          f"rows; jax {jax.__version__} on {jax.devices()[0].platform}")
    plans = {}
    for name, f in [*fns.items(), ("auto (the bench's)", bucketed(ours, "auto", all_sizes,
                                                                  args.rows, []))]:
        start = time.perf_counter()
        plan = f.plan_for(ours.state)
        plans[name] = {"total_s": time.perf_counter() - start, **plan.seconds}
        stages = ", ".join(f"{k} {v:.2f} s" for k, v in plan.seconds.items())
        print(f"plan, layout {name}: {plans[name]['total_s']:.2f} s ({stages})")

    paths = [*args.layouts, "jit"]
    header = (f"\n{'T':>6} | " + " | ".join(f"{p + ': total':>11} {'xla':>5} {'rest':>5}"
                                             for p in paths)
              + " | " + " ".join(f"{p + '/jit':>8}" for p in args.layouts))
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(0)
    rows, ratios = [], {layout: [] for layout in args.layouts}
    for i, t in enumerate(args.sizes):
        for rep in range(args.repeat):
            size = t - rep
            # Rotate the order so slow drift on a shared machine does not favour one path.
            k = (i * args.repeat + rep) % len(paths)
            result = {}
            for path in paths[k:] + paths[:k]:
                result[path] = (add_shape_jit(theirs, args.rows, size) if path == "jit" else
                                add_shape_polyexec(fns[path], ours.state, args.rows, size))
            executable = result["jit"].pop("executable")
            if rep == 0:
                # The compiled programs agree: full rows (every length T), one step each.
                tokens = rng.integers(1, 256, (args.rows, size)).astype(np.int32)
                lengths = np.full(args.rows, size, np.int32)
                want = float(theirs.loss_and_state(
                    executable(theirs.state, theirs.batch(tokens), lengths), theirs.state)[0])
                for layout, f in fns.items():
                    got = float(ours.loss_and_state(
                        f(ours.state, ours.batch(tokens), lengths), ours.state)[0])
                    assert abs(got - want) <= 1e-4 * abs(want), (layout, got, want)
            for layout in args.layouts:
                ratios[layout].append(result[layout]["total_s"] / result["jit"]["total_s"])
            print(f"{size:>6} | " + " | ".join(
                f"{result[p]['total_s']:>11.2f} {result[p]['xla_s']:>5.2f} "
                f"{result[p]['rest_s']:>5.2f}" for p in paths) + " | " + " ".join(
                f"{ratios[layout][-1]:>8.2f}" for layout in args.layouts))
            rows.append({"T": size, **{p: r for p, r in result.items()}})

    print()
    for path in paths:
        medians = {k: statistics.median(r[path][k] for r in rows)
                   for k in ("total_s", "xla_s", "rest_s")}
        line = (f"median {path:>4}: {medians['total_s']:.2f} s a shape (xla "
                f"{medians['xla_s']:.2f} s, rest {medians['rest_s']:.2f} s)")
        if path != "jit":
            line += (f"; {statistics.median(ratios[path]):.2f}x jit's (each round's ratio: "
                     f"{', '.join(f'{x:.2f}' for x in ratios[path])})")
        print(line)
    for layout, f in fns.items():
        print(f"layout {layout}: {len(traces[layout])} Python trace(s) of the step (a counter "
              f"inside it; f.traces = {f.traces}) for {f.stats.compiles} compiles")

    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"config": vars(args), "plans": plans, "rows": rows,
                       "ratios": ratios,
                       "median_ratio": {k: statistics.median(v) for k, v in ratios.items()},
                       "traces": {k: len(v) for k, v in traces.items()},
                       "compiles": {k: f.stats.compiles for k, f in fns.items()}}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
