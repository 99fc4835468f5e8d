"""What one more bucket costs: compiling it from the exported plan vs retracing with jax.jit.

For one polymorphic function -- the CharLM train step ``jax.value_and_grad(loss_fn)`` (GRU,
embedding 64, hidden 256, batch 32) -- this measures, side by side in one process and at the same
sizes:

* **plan**: what `px.bucketed` does to add a bucket: ``jax.jit(plan.exported.call)`` lowered at
  the bucket's concrete shapes (the one serialised symbolic module, shape-refined; no Python)
  and compiled by XLA;
* **jit**: what plain ``jax.jit`` does at a new shape: trace the Python function, lower the
  jaxpr, compile.

Each size is new to both paths (jit's trace cache is keyed on the function and shapes, so a
repeated size would cost nothing: repetitions use sizes ``T + 1``, ``T + 2``, ... and the
minimum is reported), the persistent compile cache is off, and the two paths alternate which
goes first so drift from other load on the machine falls on both.

Why the plan's XLA compile is not cheaper than jit's: the exported module holds symbolic
shapes (``dynamic_broadcast_in_dim``, ``real_dynamic_slice``, shape assertions), and adding a
bucket first refines it to the concrete shapes (``mlir.refine_polymorphic_shapes``, run inside
``compile()``); what the plan saves is the Python trace and the jaxpr lowering.

It also reports, for the same function used over four buckets through `px.bucketed`, the
number of Python traces (a counter inside the function and ``f.traces``) and of compiles
(``f.stats``).

    python -m bench.core_timing                      # defaults: T = 96 192 384 768
    python -m bench.core_timing --sizes 40 80 --hidden 32 --json timing.json   # quick
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
from examples.rnn.model import CharLM, loss_fn



def _seconds(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def add_bucket_from_plan(plan, batch: int, t: int) -> dict:
    """Exactly the executor's compile of a new bucket (`Bucketed._compile`)."""
    avals = plan.segments[0].bucket_avals({"B": batch, "T": t})
    lowered, lower_s = _seconds(lambda: jax.jit(plan.exported.call).lower(*avals))
    compiled, compile_s = _seconds(lowered.compile)
    return {"trace_s": 0.0, "lower_s": lower_s, "compile_s": compile_s,
            "total_s": lower_s + compile_s, "executable": compiled, "size": t}


def add_shape_by_retracing(step, model, batch: int, t: int) -> dict:
    tokens = jax.ShapeDtypeStruct((batch, t), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    jitted = jax.jit(step)   # a fresh jit object: nothing cached from an earlier size
    traced, trace_s = _seconds(lambda: jitted.trace(model, tokens, lengths))
    lowered, lower_s = _seconds(traced.lower)
    compiled, compile_s = _seconds(lowered.compile)
    return {"trace_s": trace_s, "lower_s": lower_s, "compile_s": compile_s,
            "total_s": trace_s + lower_s + compile_s, "executable": compiled, "size": t}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[96, 192, 384, 768],
                        help="sequence lengths T at which each path adds a bucket")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--embed", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2,
                        help="measurements per size and path (at T, T+1, ...); the minimum is kept")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args(argv)

    px.disable_persistent_cache()
    t_max = max(1024, max(args.sizes))
    T = px.LengthVar("T", min=2, max=t_max)
    B = px.LengthVar("B", max=args.batch)
    model = CharLM(cell="gru", embed=args.embed, hidden=args.hidden, key=jax.random.PRNGKey(0))
    step = jax.value_and_grad(loss_fn)
    specs = (px.Spec("B T", jnp.int32), px.Spec("B", jnp.int32, lengths_of="T"))
    rng = np.random.default_rng(0)

    print(f"CharLM GRU train step (value_and_grad), embed {args.embed}, hidden {args.hidden}, "
          f"batch {args.batch}; jax {jax.__version__} on {jax.devices()[0].platform}")
    (plan, trace_once_s) = _seconds(lambda: px.trace(step, model, *specs, check_sizes=False,
                                                     buckets={T: [t_max], B: [args.batch]}))
    assert not plan.reshaping_is_impossible, plan.reason
    print(f"one symbolic trace + export (paid once, for every bucket): {trace_once_s:.2f} s\n")

    rows = []
    header = (f"{'T':>6} | {'plan: lower':>11} {'compile':>8} {'total':>7} | {'jit: trace':>10} "
              f"{'lower':>7} {'compile':>8} {'total':>7} | {'plan/jit':>8}")
    print(header)
    print("-" * len(header))
    for i, t in enumerate(args.sizes):
        result, samples, at_t = {}, {"plan": [], "jit": []}, {}
        for rep in range(args.repeat):
            # Alternate the order so slow drift on a shared machine does not favour one path.
            order = ["plan", "jit"] if (i + rep) % 2 == 0 else ["jit", "plan"]
            for path in order:
                r = (add_bucket_from_plan(plan, args.batch, t + rep) if path == "plan" else
                     add_shape_by_retracing(step, model, args.batch, t + rep))
                samples[path].append(r["total_s"])
                if rep == 0:
                    at_t[path] = r.pop("executable")
                if path not in result or r["total_s"] < result[path]["total_s"]:
                    result[path] = r
        # Both executables at size T compute the same loss on full rows (the plan's takes flat
        # inputs; jit's runs the unmasked loss, which shorter rows' padding would change).
        tokens = rng.integers(0, 256, (args.batch, t)).astype(np.int32)
        lengths = np.full(args.batch, t, np.int32)
        flat = [*jax.tree_util.tree_leaves(model), tokens, lengths, np.int32(args.batch),
                np.int32(t)]
        loss_plan = float(at_t["plan"](*flat)[0])
        loss_jit = float(at_t["jit"](model, tokens, lengths)[0])
        assert abs(loss_plan - loss_jit) <= 1e-4 * abs(loss_jit), (loss_plan, loss_jit)
        p, j = result["plan"], result["jit"]
        print(f"{t:>6} | {p['lower_s']:>11.2f} {p['compile_s']:>8.2f} {p['total_s']:>7.2f} | "
              f"{j['trace_s']:>10.2f} {j['lower_s']:>7.2f} {j['compile_s']:>8.2f} "
              f"{j['total_s']:>7.2f} | {p['total_s'] / j['total_s']:>8.2f}")
        rows.append({"T": t, **{f"plan_{k}": v for k, v in p.items() if k != "executable"},
                     **{f"jit_{k}": v for k, v in j.items() if k != "executable"},
                     "plan_samples_s": samples["plan"], "jit_samples_s": samples["jit"]})
        if args.repeat > 1:
            print(f"{'':>6}   every sample (total s): plan "
                  f"{', '.join(f'{x:.2f}' for x in samples['plan'])}; jit "
                  f"{', '.join(f'{x:.2f}' for x in samples['jit'])}")
    median_plan = statistics.median(r["plan_total_s"] for r in rows)
    median_jit = statistics.median(r["jit_total_s"] for r in rows)
    print(f"\nmedian time to add a bucket: plan {median_plan:.2f} s, jit retrace "
          f"{median_jit:.2f} s (plan/jit {median_plan / median_jit:.2f})")

    # One function over four buckets through the executor: traces and compiles, counted.
    python_traces = []

    def counted_step(model, tokens, lengths):
        python_traces.append(tokens.shape)
        return step(model, tokens, lengths)

    buckets = sorted(args.sizes)[:4]
    f = px.bucketed(counted_step, in_specs=(None, *specs),
                    buckets={T: buckets, B: [args.batch]})
    calls = [max(2, s - s // 4) for s in buckets] + list(buckets)   # two calls per bucket
    for t in calls:
        tokens = rng.integers(0, 256, (args.batch, t)).astype(np.int32)
        f(model, tokens, np.full(args.batch, t, np.int32))
    stats = f.stats
    print(f"\npx.bucketed over {len(stats.buckets)} buckets ({len(calls)} calls at T={calls}):")
    print(f"  Python traces: {len(python_traces)} (counter in the function), f.traces = "
          f"{f.traces}; compiles: {stats.compiles}")
    print("\n".join("  " + line for line in str(stats).splitlines()))

    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"config": vars(args), "trace_once_s": trace_once_s, "rows": rows,
                       "median_plan_s": median_plan, "median_jit_s": median_jit,
                       "executor": {"python_traces": len(python_traces), "traces": f.traces,
                                    "compiles": stats.compiles, "calls": stats.calls,
                                    "buckets": len(stats.buckets)}}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
