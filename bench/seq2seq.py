"""Sequence to sequence: an encoder-decoder packed by polyexec from unchanged model code, side
by side with the peer seqio/T5X and MaxText users write -- inputs and targets packed first-fit
by Grain into parallel rows, segment ids and positions threaded by hand into every mask.

The task, from the bundled corpus (`pydoc_data.topics`): each paragraph's bytes are the
source (``S``), its first sentence the target (``T``); both lengths are long-tailed. The model:
a byte embedding with learned positions, one bidirectional self-attention encoder layer, one
decoder layer (causal self-attention, then cross-attention into the encoder), next-byte loss
over the target. The same parameters, optimiser (optax Adam) and example order for every
strategy:

* ``peer``: Grain's ``FirstFitPackIterDataset`` packs ``{"inputs", "targets"}`` into rows of
  the cap (``rows`` bins), and `peer_loss` masks by hand: each encoder cell attends its own
  segment, each decoder cell its own segment's earlier cells and its own example's source,
  and the loss counts predictions inside a segment. One ``jax.jit`` step, one compile.
* ``polyexec-pack``: `loss` as written (no mask, no segment id) through ``px.bucketed(...,
  layout="pack")`` on each of the peer's batches' examples: polyexec packs them into rows of
  the cap of each length (an example's source and target in the same row of each grid).
* ``polyexec``: the same batches padded one example a row, in power-of-two buckets of the
  examples, ``S`` and ``T``.
* ``polyexec-fit``: `polyexec.training.fit` on the pairs as a user runs it, `loss` unchanged:
  its own plan of steps at the peer's cells a step (``max_tokens``), layout and buckets
  chosen by cost. Its cold epoch counts from the call (plan, measurement, compiles).

Every strategy but ``polyexec-fit`` trains on the same examples in the same steps, and each
is exact, so their losses agree (`run` checks it); they differ in cells computed and
compiles. Epoch 1 is cold (its compiles included), later epochs warm.

    python -m bench.seq2seq                    # 1,024 examples, cap 256, 8 rows a step
    polyexec-bench --model seq2seq --cap 256 --epochs 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import polyexec as px

from .packing import in_batches


def load_pairs(cap: int, num_examples: int | None = None) -> list[tuple[bytes, bytes]]:
    """(paragraph, its first sentence) byte pairs of `pydoc_data.topics`, each cut to ``cap``
    bytes; a paragraph of one sentence is its own target. In corpus order.

    >>> pairs = load_pairs(64, 3)
    >>> len(pairs), all(1 <= len(s) <= 64 and 2 <= len(t) <= 64 for s, t in pairs)
    (3, True)
    """
    from pydoc_data.topics import topics

    pairs = []
    for name in sorted(topics):
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            text = " ".join(paragraph.split()).encode()
            first = re.split(rb"(?<=[.:;!?]) ", text, maxsplit=1)[0]
            if len(text) >= 1 and len(first) >= 2:
                pairs.append((text[:cap], first[:cap]))
    return pairs[:num_examples] if num_examples else pairs


def init_params(key, hidden: int, cap: int) -> dict[str, jax.Array]:
    names = ["enc_q", "enc_k", "enc_v", "enc_o", "self_q", "self_k", "self_v", "self_o",
             "cross_q", "cross_k", "cross_v", "cross_o"]
    keys = jax.random.split(key, len(names) + 3)
    params = {n: jax.random.normal(k, (hidden, hidden)) / np.sqrt(hidden)
              for n, k in zip(names, keys)}
    params["embed"] = jax.random.normal(keys[-3], (256, hidden)) * 0.1
    params["positions"] = jax.random.normal(keys[-2], (cap, hidden)) * 0.1
    params["out"] = jax.random.normal(keys[-1], (hidden, 256)) / np.sqrt(hidden)
    return params


def _norm(x):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)


def _attend(p, name, q, kv, mask=None):
    scores = jnp.einsum("bqd,bkd->bqk", q @ p[f"{name}_q"], kv @ p[f"{name}_k"])
    scores = scores / np.sqrt(q.shape[-1])
    if mask is not None:
        scores = jnp.where(mask, scores, -1e9)
    return (jax.nn.softmax(scores, axis=-1) @ (kv @ p[f"{name}_v"])) @ p[f"{name}_o"]


# -- the model as written once (polyexec runs it padded or packed) ------------------------------

def loss(p, src, tgt, src_lengths, tgt_lengths):
    """Mean next-byte loss over the target: ``src`` ``(B, S)``, ``tgt`` ``(B, T)``, no masks."""
    x = p["embed"][src] + p["positions"][:src.shape[1]]
    x = _norm(x + _attend(p, "enc", x, x))
    y = p["embed"][tgt[:, :-1]] + p["positions"][:tgt.shape[1] - 1]
    causal = jnp.tri(y.shape[1], dtype=bool)
    y = _norm(y + _attend(p, "self", y, y, causal))
    y = _norm(y + _attend(p, "cross", y, x))
    logits = y @ p["out"]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tgt[:, 1:, None], -1)[..., 0]
    return jnp.sum(nll) / nll.size


# -- the peer: packed by Grain, masked by hand --------------------------------------------------

def peer_loss(p, inputs, inputs_segment_ids, inputs_positions, targets, targets_segment_ids,
              targets_positions):
    """`loss` on packed rows, every mask written by hand from the segment ids (0: padding)."""
    same = lambda a, b: (a[:, :, None] == b[:, None, :]) & (a[:, :, None] > 0)  # noqa: E731
    x = p["embed"][inputs] + p["positions"][inputs_positions]
    x = _norm(x + _attend(p, "enc", x, x, same(inputs_segment_ids, inputs_segment_ids)))
    y = p["embed"][targets] + p["positions"][targets_positions]
    causal = jnp.tri(y.shape[1], dtype=bool)[None]
    y = _norm(y + _attend(p, "self", y, y,
                          same(targets_segment_ids, targets_segment_ids) & causal))
    y = _norm(y + _attend(p, "cross", y, x, same(targets_segment_ids, inputs_segment_ids)))
    logits = (y @ p["out"])[:, :-1]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, 1:, None], -1)[..., 0]
    # A cell predicts the next one only inside its own target.
    real = (targets_segment_ids[:, 1:] == targets_segment_ids[:, :-1]) & (
        targets_segment_ids[:, :-1] > 0)
    return jnp.sum(jnp.where(real, nll, 0.0)) / jnp.maximum(jnp.sum(real), 1)


def _train_step(loss_fn, optimiser):
    def step(params, opt_state, *batch):
        value, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = optimiser.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state
    return step


def peer_batches(pairs, order, cap: int, rows: int, seed: int) -> Iterator[dict[str, Any]]:
    """Grain's first-fit packing of ``{"inputs", "targets"}`` into ``rows`` bins of ``cap``
    cells each, as seqio users pack: a batch of ``rows`` rows and each row's example indices
    (the last batch filled with empty rows)."""
    import grain  # the bench extra: only the peer needs it

    def example(i):
        i = int(i)
        source, target = pairs[i]
        return {"inputs": np.frombuffer(source, np.uint8).astype(np.int32),
                "targets": np.frombuffer(target, np.uint8).astype(np.int32), "index": i}

    stream = grain.MapDataset.source(np.asarray(order).tolist()).map(example).to_iter_dataset(
        grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    packed = grain.experimental.FirstFitPackIterDataset(
        stream, length_struct={"inputs": cap, "targets": cap}, num_packing_bins=rows,
        seed=seed, meta_features=("index",))
    keys = ["inputs", "inputs_segment_ids", "inputs_positions", "targets",
            "targets_segment_ids", "targets_positions"]

    def batch(chunk):
        empty = [np.zeros(cap, np.int32)] * (rows - len(chunk))
        out = {k: np.stack([np.asarray(r[k], np.int32) for r in chunk] + empty) for k in keys}
        out["examples"] = [int(i) for r in chunk for i in r["index"]]
        return out

    for chunk in in_batches(packed, rows):
        yield batch(chunk)


def padded_examples(pairs, indices) -> tuple[np.ndarray, ...]:
    """``(src, tgt, src_lengths, tgt_lengths)`` of the examples ``indices``, padded with 0."""
    sources = [np.frombuffer(pairs[i][0], np.uint8) for i in indices]
    targets = [np.frombuffer(pairs[i][1], np.uint8) for i in indices]
    out = []
    for seqs in (sources, targets):
        arr = np.zeros((len(seqs), max(len(s) for s in seqs)), np.int32)
        for r, s in enumerate(seqs):
            arr[r, :len(s)] = s
        out.append(arr)
    return (*out, np.array([len(s) for s in sources], np.int32),
            np.array([len(t) for t in targets], np.int32))


def run(*, cap: int = 256, hidden: int = 64, rows: int = 8, epochs: int = 2,
        num_examples: int | None = 1024, seed: int = 0, lr: float = 1e-3,
        strategies: tuple[str, ...] = ("peer", "polyexec-pack", "polyexec", "polyexec-fit")
        ) -> dict[str, Any]:
    """Train each strategy ``epochs`` epochs on the same batches; per strategy and epoch:
    seconds, real tokens a second (source + target bytes), padding efficiency (real cells /
    computed cells), compiles, and the mean loss (weighted by predictions). Raises when the
    strategies' losses disagree: each is exact, so they must not."""
    if epochs < 2:
        raise px.OptionError(f"bench.seq2seq.run: epochs: expected >= 2 (the first is cold), "
                             f"received {epochs}")
    pairs = load_pairs(cap, num_examples)
    params = init_params(jax.random.key(seed), hidden, cap)
    optimiser = optax.adam(lr)
    orders = [np.random.default_rng([seed, e]).permutation(len(pairs)) for e in range(epochs)]
    batches = [list(peer_batches(pairs, order, cap, rows, seed + e))
               for e, order in enumerate(orders)]
    tokens = sum(len(s) + len(t) for s, t in pairs)
    predictions = sum(len(t) - 1 for _, t in pairs)

    B = px.LengthVar("B", max=rows * cap)
    S, T = px.LengthVar("S", min=1, max=cap), px.LengthVar("T", min=2, max=cap)
    specs = (None, None, px.Spec("B S", jnp.int32), px.Spec("B T", jnp.int32),
             px.Spec("B", jnp.int32, lengths_of="S"), px.Spec("B", jnp.int32, lengths_of="T"))
    def pow2(var):      # powers of two from the variable's min up to its max, and the max
        sizes = [2 ** k for k in range(int(np.log2(var.max)) + 1) if 2 ** k >= var.min]
        return sizes + ([var.max] if var.max not in sizes else [])

    def polyexec_step(layout):
        buckets = ({B: [rows, 2 * rows], S: [cap], T: [cap]} if layout == "pack" else
                   {B: pow2(B), S: pow2(S), T: pow2(T)})
        return px.bucketed(_train_step(loss, optimiser), specs, buckets=buckets,
                           layout=layout, strict=True)

    results: dict[str, Any] = {}
    for name in strategies:
        if name == "polyexec-fit":
            results[name] = _fit_epochs(pairs, params, optimiser, 2 * rows * cap, epochs, seed,
                                        tokens)
            continue
        state = (params, optimiser.init(params))
        if name == "peer":
            step = jax.jit(_train_step(peer_loss, optimiser))
            compiles = lambda: step._cache_size()  # noqa: E731
        else:
            step = polyexec_step("pack" if name == "polyexec-pack" else "pad")
            compiles = lambda: step.stats.compiles  # noqa: E731
        per_epoch = []
        for e, epoch in enumerate(batches):
            start, total, cells = time.perf_counter(), 0.0, 0
            # The peer packs as it trains (Grain's iterator, timed); polyexec gets each of the
            # same batches' examples, and pads or packs them itself (timed too).
            for b in (peer_batches(pairs, orders[e], cap, rows, seed + e) if name == "peer"
                      else epoch):
                if name == "peer":
                    args = [b[k] for k in ("inputs", "inputs_segment_ids", "inputs_positions",
                                           "targets", "targets_segment_ids",
                                           "targets_positions")]
                    cells += 2 * rows * cap
                    count = int(np.sum((b["targets_segment_ids"][:, 1:]
                                        == b["targets_segment_ids"][:, :-1])
                                       & (b["targets_segment_ids"][:, :-1] > 0)))
                else:
                    args = padded_examples(pairs, b["examples"])
                    count = int(np.sum(args[3] - 1))
                value, *state = step(*state, *args)
                total += float(value) * count
            seconds = time.perf_counter() - start
            if name != "peer":
                cells = None
            per_epoch.append({"seconds": round(seconds, 3),
                              "tokens_per_s": round(tokens / seconds, 1),
                              "loss": total / predictions, "compiles": compiles()})
            if cells is not None:
                per_epoch[-1]["efficiency"] = round(tokens / cells, 3)
        if name != "peer":
            eff = step.stats.padding_efficiency
            for e in per_epoch:
                e["efficiency"] = round(eff, 3)
        results[name] = per_epoch
    _check_losses_agree({n: r for n, r in results.items() if n != "polyexec-fit"})
    return {"workload": {"cap": cap, "hidden": hidden, "rows": rows, "epochs": epochs,
                         "examples": len(pairs), "seed": seed, "lr": lr,
                         "steps_per_epoch": len(batches[0]),
                         "median_source": int(np.median([len(s) for s, _ in pairs])),
                         "median_target": int(np.median([len(t) for _, t in pairs]))},
            "strategies": results}


def _fit_epochs(pairs, params, optimiser, max_tokens: int, epochs: int, seed: int,
                tokens: int) -> list[dict[str, Any]]:
    """``polyexec-fit``: `polyexec.training.fit` on the pairs, per epoch as `run` reports the
    others (the cold epoch from the call, its choice, measurement and compiles included; the
    loss fit's mean over its steps)."""
    from polyexec import training

    data = [{"src": np.frombuffer(s, np.uint8).astype(np.int32),
             "tgt": np.frombuffer(t, np.uint8).astype(np.int32)} for s, t in pairs]
    result = training.fit(params, lambda p, batch: loss(p, batch["src"], batch["tgt"], None, None),
                          data, optimizer=optimiser, epochs=epochs, max_tokens=max_tokens,
                          seed=seed, cache=False, verbose=False, progress=False)
    out = []
    for k, e in enumerate(result.epochs()):
        seconds = e["elapsed"] if k == 0 else e["seconds"]
        out.append({"seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
                    "loss": e["train_loss"], "compiles": result.train_step.stats.compiles,
                    "efficiency": round(e["padding_efficiency"], 3), "layout": result.layout})
    return out


def _check_losses_agree(results: dict[str, list[dict]]) -> None:
    """Each strategy is exact on the same batches: their epoch losses must agree (up to
    float reassociation through training)."""
    names = list(results)
    for e in range(len(results[names[0]])):
        losses = {n: results[n][e]["loss"] for n in names}
        spread = max(losses.values()) - min(losses.values())
        if spread > 1e-3 * max(abs(v) for v in losses.values()):
            raise AssertionError(f"bench.seq2seq: epoch {e + 1}'s losses disagree: {losses}")


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per strategy: cold (epoch 1) and warm (the median later epoch) tokens a second,
    each as a ratio to the peer's, efficiency, compiles, last loss."""
    rows, runs = [], result["strategies"]
    peer = runs.get("peer")
    for name, epochs in runs.items():
        warm = float(np.median([e["tokens_per_s"] for e in epochs[1:]]))
        row = {"strategy": name, "cold tok/s": epochs[0]["tokens_per_s"], "warm tok/s": warm,
               "efficiency": epochs[-1]["efficiency"], "compiles": epochs[-1]["compiles"],
               "loss": round(epochs[-1]["loss"], 4),
               "seconds": round(sum(e["seconds"] for e in epochs), 2)}
        if peer is not None:
            row["cold / peer"] = round(row["cold tok/s"] / peer[0]["tokens_per_s"], 2)
            row["warm / peer"] = round(warm / float(np.median(
                [e["tokens_per_s"] for e in peer[1:]])), 2)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.seq2seq", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--cap", type=int, default=256)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--rows", type=int, default=8, help="packed rows a step (the peer's bins)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--num-examples", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    result = run(cap=args.cap, hidden=args.hidden, rows=args.rows, epochs=args.epochs,
                 num_examples=args.num_examples, seed=args.seed)
    print_result(result)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
    return 0


def print_result(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    w = result["workload"]
    table = Table(title=f"seq2seq: {w['examples']} paragraph -> first sentence pairs (median "
                        f"{w['median_source']} -> {w['median_target']} bytes), cap {w['cap']}, "
                        f"{w['rows']} rows a step, {w['steps_per_epoch']} steps an epoch",
                  title_justify="left")
    rows = summary(result)
    for c in rows[0]:
        table.add_column(c, justify="left" if c == "strategy" else "right")
    for r in rows:
        table.add_row(*(str(v) for v in r.values()))
    Console(width=max(Console().width, 140)).print(table)


if __name__ == "__main__":
    raise SystemExit(main())
