"""Train the byte-level GRU/LSTM language model on the pydoc corpus through polyexec.

    python -m examples.rnn.train                       # the default run (a few minutes, 2 cores)
    python -m examples.rnn.train --cell lstm --epochs 5 --buckets pow2
    python -m examples.rnn.train --limit 300 --epochs 1 --hidden 32 --cap 128   # seconds

Prints the corpus and what the length cap did, the bucket table, the polymorphism verdict of
the loss, training progress with per-epoch padding efficiency / compiles / tokens per second,
the validation loss in nats per byte (= per character: the corpus is ASCII), each epoch's
validation loss with the wall time at which it was known (the time to a loss; ``--target-loss``
names one to report) and sampled sentences. The model is written once against length
variables (``model.py``); polyexec compiles its train step once per length bucket. The
examples are ``{"tokens": (T,)}`` and the loss ``lm_loss(model, batch)``, `fit`'s form.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from rich.console import Console

import buckets
import polyexec as px
from polyexec import training

from . import data as corpus_data
from .generate import generate
from .model import CharLM, lm_loss, lm_loss_and_count, masked_lm_loss, masked_lm_loss_and_count

# Defaults, measured on 2 idle CPU cores (docs/benchmarks.md): packed rows of 256 and 1,024 (the
# layout chosen by cost) train at ~26k tokens/s, so three epochs of the ~400k training bytes
# take ~56 s with 4 compiles; 1.65 nats/char on validation (padded buckets: 68 s, 1.51).
DEFAULTS = dict(cell="gru", epochs=3, hidden=256, embed=64, max_tokens=8192, lr=3e-3,
                buckets="auto", layout="auto", cap=1024, seed=0)
PROMPTS = [b"The ", b"A ", b"If ", b"In "]


def _int_flag(minimum: int, *, zero: str | None = None) -> Callable[[str], int]:
    """An argparse type: an int >= ``minimum``, or 0 where ``zero`` says what 0 means."""
    wanted = f"an int >= {minimum}" + (f" or 0 ({zero})" if zero else "")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not (value >= minimum or (zero and value == 0)):
            raise argparse.ArgumentTypeError(f"expected {wanted}, received {text!r}")
        return value

    return parse


def _coordinator(text: str) -> str:
    """An argparse type: ``HOST:PORT``, checked before JAX sees it (``bad:addr`` crashed its
    runtime)."""
    try:
        training.parse_coordinator(text, "--coordinator")
    except px.OptionError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--coordinator: ")) from None
    return text


def _positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (``--lr inf`` trained to a NaN loss)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, received {text!r}")
    return value


def buckets_flag(text: str) -> Callable[[np.ndarray], Any]:
    """``auto``, ``optimal[:K]``, ``pow2``, ``fixed:64,128,...`` or ``multiple:K`` -> a function
    from the training lengths to a bucket policy, or to ``"auto"`` (`fit` chooses by cost)
    -- the argparse type of ``--buckets``."""
    kind, _, arg = text.partition(":")
    if text == "auto":
        return lambda lengths: "auto"
    if kind == "pow2" and not arg:
        return lambda lengths: buckets.Geometric(2, int(lengths.max()), ratio=2.0)
    if kind in ("optimal", "multiple") and (arg or kind == "optimal"):
        if not (arg.isdigit() and int(arg) >= 1) and arg:
            raise argparse.ArgumentTypeError(f"{text!r}: expected K an int >= 1, received {arg!r}")
        k = int(arg or 8)
        if kind == "optimal":
            return lambda lengths: buckets.Optimal.fit(lengths, max_buckets=k)
        return lambda lengths: buckets.MultipleOf(k, int(lengths.max()))
    if kind == "fixed":
        try:
            policy = buckets.Fixed([int(s) for s in arg.split(",") if s])
        except (TypeError, ValueError) as e:     # buckets' own message names the bad size
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
        return lambda lengths: policy
    raise argparse.ArgumentTypeError(f"expected one of auto, optimal[:K], pow2, fixed:S1,S2,..., "
                                     f"multiple:K, received {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.rnn.train", description=__doc__.split("\n")[0])
    p.add_argument("--cell", choices=["gru", "lstm"], default=DEFAULTS["cell"])
    p.add_argument("--epochs", type=_int_flag(0), default=DEFAULTS["epochs"])
    p.add_argument("--hidden", type=_int_flag(1), default=DEFAULTS["hidden"])
    p.add_argument("--embed", type=_int_flag(1), default=DEFAULTS["embed"])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--batch-size", type=_int_flag(1), help="sentences per batch (every bucket)")
    size.add_argument("--max-tokens", type=_int_flag(1),
                      help=f"per bucket T, the largest power-of-two B with B*T <= this "
                           f"(default {DEFAULTS['max_tokens']})")
    p.add_argument("--lr", type=_positive_float, default=DEFAULTS["lr"], help="Adam learning rate")
    p.add_argument("--buckets", type=buckets_flag, default=DEFAULTS["buckets"],
                   help="auto (default: the (length x rows) set with the least predicted time for "
                        "this run, from one measured compile and step), optimal[:K] (K buckets "
                        "fitted to the training lengths), pow2, fixed:64,128,..., multiple:K")
    p.add_argument("--layout", choices=["auto", "pad", "pack"], default=DEFAULTS["layout"],
                   help="auto (default, with --buckets auto): packed rows -- several sentences "
                        "a row, the model unchanged -- when they are predicted faster, else "
                        "padded buckets; pack: always packed rows; pad: never")
    p.add_argument("--cap", type=_int_flag(2, zero="no cap"), default=DEFAULTS["cap"],
                   help="truncate sentences to this many bytes (0: no cap)")
    p.add_argument("--limit", type=_int_flag(2), help="use only this many sentences (quick runs)")
    p.add_argument("--checkpoint-dir", help="save checkpoints here and resume from the newest")
    p.add_argument("--checkpoint-every", type=_int_flag(1), help="also checkpoint every N steps")
    p.add_argument("--devices", type=_int_flag(1),
                   help="data-parallel over this many local devices (default: all)")
    multi = p.add_argument_group("more than one process (jax.distributed; see docs/guides/distributed.md)")
    multi.add_argument("--coordinator", metavar="HOST:PORT", type=_coordinator,
                       help="process 0's address; every process passes the same one")
    multi.add_argument("--coordinator-timeout", type=_int_flag(1), default=60, metavar="SECONDS",
                       help="seconds to reach the coordinator and for every process to join; "
                            "then the run fails with a message (default 60)")
    multi.add_argument("--num-processes", type=_int_flag(1), help="processes in the run")
    multi.add_argument("--process-id", type=_int_flag(0), help="this process's index, from 0")
    multi.add_argument("--heartbeat-timeout", type=_int_flag(1), default=100,
                       help="seconds after which a silent process counts as dead and the others "
                            "exit (default 100)")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--no-cache", action="store_true",
                       help="no persistent compile cache at all (also not one configured for JAX, "
                            "e.g. with JAX_COMPILATION_CACHE_DIR)")
    cache.add_argument("--cache-dir",
                       help="persistent compile cache folder (default ~/.cache/polyexec/xla)")
    p.add_argument("--no-masking", action="store_true",
                   help="turn off the executor's logical-length rewrite (px.bucketed(masking=False)): "
                        "the loss masks by the lengths itself, so only the speed changes")
    p.add_argument("--train-on-padding", action="store_true",
                   help="train even a loss the rewrite cannot keep padding out of (not "
                        "padding-safe, or retraced per bucket), which is refused otherwise: "
                        "padding may then change the loss (fit(train_on_padding=True))")
    p.add_argument("--on-nonfinite", choices=("stop", "skip"), default="stop",
                   help="a step whose loss or gradient is not finite: stop the run, naming the "
                        "step and its examples (default), or skip it (fit(on_nonfinite=...))")
    p.add_argument("--seed", type=_int_flag(0), default=DEFAULTS["seed"])
    p.add_argument("--target-loss", type=_positive_float, metavar="NATS",
                   help="also report the wall time at which validation first reached this loss "
                        "(nats/char; e.g. another run's final one)")
    p.add_argument("--metrics", help="append metrics as JSON lines to this file")
    p.add_argument("--samples", type=_int_flag(0), default=len(PROMPTS),
                   help="sentences to sample at the end")
    p.add_argument("--sample-len", type=_int_flag(max(map(len, PROMPTS)) + 1), default=200,
                   help="longest sample, in bytes (prompt included)")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")
    return p


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    distributed = [args.coordinator, args.num_processes, args.process_id]
    if any(x is not None for x in distributed) and None in distributed:
        parser.error("--coordinator, --num-processes and --process-id go together: give all "
                     "three, or none (then a cluster environment jax.distributed detects, if any)")
    # What argparse cannot check alone (a fixed bucket below the longest sentence, more
    # devices than there are, a checkpoint of another run) is a px.OptionError from the code
    # that finds out, and a model edited into one padding may change a px.PolymorphismError
    # (fit's refusal, naming the line): a one-line usage error too, never a traceback.
    processes = 1
    try:
        processes = training.initialize_distributed(
            args.coordinator, args.num_processes, args.process_id,
            heartbeat_timeout=args.heartbeat_timeout, timeout=args.coordinator_timeout)
        check_outputs(args)
        return run(args)
    except (px.OptionError, px.PolymorphismError) as e:
        parser.error(str(e))
    except training.NonFiniteError as e:
        # Not a usage error: the run itself went wrong. One line, the checkpoint kept.
        print(f"{parser.prog}: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except jax.errors.JaxRuntimeError as e:
        if processes == 1:
            raise
        # A collective whose peer died: say so in one line; JAX's coordination service then
        # ends this process too (its own log lines follow).
        print(f"{parser.prog}: error: process {jax.process_index()} of {processes}: a "
              f"collective failed ({str(e).splitlines()[0]}); another process of the run has "
              f"probably died: see its output", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def check_outputs(args: argparse.Namespace) -> None:
    """Create or test-write every output path before the corpus is read or anything compiles
    (a bad --checkpoint-dir used to fail after the first epoch)."""
    if args.checkpoint_dir:
        training.check_output_dir(args.checkpoint_dir, "--checkpoint-dir")
    if args.cache_dir:
        training.check_output_dir(args.cache_dir, "--cache-dir")
    if args.metrics and jax.process_index() == 0:     # process 0 writes the metrics
        training.check_output_file(args.metrics, "--metrics")


def time_to_loss(history: list[dict], before_fit: float, target: float | None) -> str:
    """Each epoch's validation loss with the wall time, since the command started, at which
    it was known, and (with ``target``) when validation first reached ``target``: packing
    changes the optimiser steps an epoch, so tokens/s alone can mislead. Epochs restored from
    a checkpoint ran in another process and are left out.

    >>> history = [{"kind": "step", "epoch": 1},
    ...            {"kind": "epoch", "epoch": 1, "val_loss": 2.0, "elapsed": 30.0},
    ...            {"kind": "epoch", "epoch": 2, "val_loss": 1.5, "elapsed": 50.0}]
    >>> time_to_loss(history, 5.0, 1.8)
    'validation loss by wall time: 2.0000 at 35.0 s, 1.5000 at 55.0 s | 1.8000 first reached at 55.0 s'
    """
    first_here = min((r["epoch"] for r in history if r["kind"] == "step"), default=math.inf)
    known = [(r["val_loss"], before_fit + r["elapsed"]) for r in history
             if r["kind"] == "epoch" and r["epoch"] >= first_here and r.get("val_loss") is not None]
    text = "validation loss by wall time: " + ", ".join(f"{v:.4f} at {t:.1f} s" for v, t in known)
    if target is None:
        return text
    reached = next((t for v, t in known if v <= target), None)
    return text + (f" | {target:.4f} first reached at {reached:.1f} s" if reached is not None else
                   f" | {target:.4f} not reached in the {len(known)} epoch(s) run here")


def run(args: argparse.Namespace) -> dict:
    # One voice: in a multi-process run only process 0 reports (errors still reach stderr).
    console = Console(highlight=False, quiet=jax.process_index() != 0)
    started = time.perf_counter()

    corpus = corpus_data.load(cap=args.cap or None, limit=args.limit)
    console.print(corpus.describe())
    train_lengths = np.array([len(s) for s in corpus.train])
    policy = args.buckets(train_lengths)
    if policy != "auto" and policy.largest < train_lengths.max():
        raise px.OptionError(f"--buckets: expected a largest bucket >= the longest training sentence "
                             f"({train_lengths.max()} bytes), received {policy.largest}; add a bucket "
                             f"or lower --cap")
    max_tokens = None if args.batch_size else (args.max_tokens or DEFAULTS["max_tokens"])

    model = CharLM(cell=args.cell, embed=args.embed, hidden=args.hidden,
                   key=jax.random.PRNGKey(args.seed))
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(model) if hasattr(x, "size"))
    console.print(f"model: {args.cell.upper()} byte LM, embed {args.embed}, hidden {args.hidden}, "
                  f"{n_params:,} parameters")

    # The polymorphism verdict of the loss, from its one symbolic trace (plus the two-size check),
    # over the run's own B and T.
    masking = not args.no_masking
    # The loss has no mask: the logical rewrite makes every row its own length. Without the
    # rewrite the padding would count, so --no-masking trains the same loss masked by hand.
    loss, eval_loss = (lm_loss, lm_loss_and_count) if masking else (masked_lm_loss,
                                                                   masked_lm_loss_and_count)
    longest = max(train_lengths.max(), max(map(len, corpus.validation)))
    T = px.LengthVar("T", min=2, max=int(longest if policy == "auto" else max(policy.largest, longest)))
    B = px.LengthVar("B", max=args.batch_size or buckets.batch_size_for(2, max_tokens))
    # Traced as fit calls it: the batch {"tokens": (B, T)} and the lengths that make T ragged
    # along B, handed on to the loss only if it asks for them (`training.as_loss_call`).
    # px.trace takes each Spec'd input as an argument of its own, so the batch is built inside.
    call = training.as_loss_call(loss, "loss", one_field=False)
    plan = px.trace(lambda model, tokens, lengths: call(model, {"tokens": tokens}, lengths),
                    model, px.Spec((B, T), jnp.int32), px.Spec((B,), jnp.int32, lengths_of=T),
                    masking=masking)
    console.print(f"polymorphism: plan.reshaping_is_impossible = {plan.reshaping_is_impossible}"
                  + (f"; reason: {plan.reason}" if plan.reshaping_is_impossible else
                     f" — {loss.__name__} traced once over symbolic B, T in [2, {T.max}] "
                     f"({len(plan.jaxpr.eqns)} top-level equations), compiled per bucket")
                  + ("" if masking else " | logical-length rewrite off (--no-masking)"))

    if args.no_cache:
        px.disable_persistent_cache()   # asked for on the command line: off, whoever turned it on
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(args.lr))
    fit_called = time.perf_counter()
    result = training.fit(
        model, loss, corpus_data.examples(corpus.train), specs=corpus_data.SPECS,
        optimizer=optimizer, epochs=args.epochs,
        validation=corpus_data.examples(corpus.validation), eval_fn=eval_loss,
        batch_size=args.batch_size,
        max_tokens=max_tokens, buckets=policy, seed=args.seed, devices=args.devices,
        cache=False if args.no_cache else (args.cache_dir or True), masking=masking,
        layout=args.layout if masking else "pad", train_on_padding=args.train_on_padding,
        on_nonfinite=args.on_nonfinite,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        metrics_file=args.metrics, progress=False if args.no_progress else None, console=console)

    if result.layout == "pack":
        console.print(f"packed rows of {' and '.join(map(str, result.policy.sizes))} bytes, "
                      f"several sentences a row: padding efficiency "
                      f"{result.train_step.stats.padding_efficiency:.3f} (real bytes / cells "
                      f"of the rows)")
    else:
        console.print(buckets.report(train_lengths, result.policy, batch_size=args.batch_size,
                                     max_tokens=max_tokens,
                                     partial_rows=result.partial_rows).rich_table())
    epochs = result.epochs()
    val = result.val_loss
    warm = [r for r in result.history if r["kind"] == "warmup"]
    if val is not None:
        console.print(f"validation loss: {val:.4f} nats/char ({val / math.log(2):.4f} bits/char) "
                      f"after {len(epochs)} epoch(s)")
        console.print(time_to_loss(result.history, fit_called - started, args.target_loss))
    train_stats, eval_stats = result.train_step.stats, result.eval_step.stats
    console.print("train step buckets (calls, compiles, and real tokens / padded cells as the "
                  "executor padded them):")
    console.print(str(train_stats))
    rate = (sum(r["tokens"] for r in epochs) / sum(r["train_seconds"] for r in epochs)
            if epochs else float("nan"))
    if result.prediction is not None and epochs:
        # The prediction prices every step and compile of the epochs run here (the fastest
        # of three timed calls a measured shape: one was one noisy sample); the epochs' train
        # seconds are their clock. Their ratio is how far the choice was priced off.
        took = sum(r["train_seconds"] for r in epochs)
        console.print(f"training steps took {took:.1f} s; predicted "
                      f"{result.prediction.seconds:.1f} s ({result.prediction.seconds / took:.2f}x)")
    console.print(f"summary: {rate:,.0f} tokens/s over training | compiles: train "
                  f"{train_stats.compiles} + eval {eval_stats.compiles} buckets, "
                  f"{train_stats.compile_seconds + eval_stats.compile_seconds:.1f} compile-seconds"
                  + (f" (warmup {warm[0]['seconds']:.1f} s wall, {warm[0]['xla_compiles']} XLA "
                     f"compiles, {warm[0]['cache_hits']} persistent-cache hits)" if warm else "")
                  + f" | wall {time.perf_counter() - started:.1f} s")

    samples = []
    if args.samples:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.samples)]
        samples = generate(result.model, prompts, seed=args.seed, max_len=args.sample_len)
        console.print("samples (each stops at '.' or a newline, or at --sample-len bytes):")
        for s in samples:
            console.print("  " + repr(s.decode("utf-8", errors="replace")), markup=False)
    return {"val_loss": val, "tokens_per_s": rate, "history": result.history, "samples": samples}


if __name__ == "__main__":
    main(sys.argv[1:])
