"""What a `fit` run records: where it is (`Position`, saved in checkpoints), the metrics
records (``kind`` "warmup", "step", "epoch") and the JSON-lines file they go to."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any


@dataclasses.dataclass(frozen=True)
class EpochTotals:
    """The running sums of the current epoch's train steps.

    ``padded`` counts the cells of the (B, T) bucket each step ran at (several lengths: B x
    their sum), ``tokens`` the real tokens in them: the same two numbers the executor's
    ``stats`` add up from the unpadded batches `fit` hands it, so ``padding_efficiency`` here
    is the executor's over the epoch.
    """

    loss_sum: float = 0.0      # loss x real tokens: the epoch's loss is a token-weighted mean
    tokens: int = 0
    padded: int = 0
    steps: int = 0
    seconds: float = 0.0
    # Steps not applied (``on_nonfinite="skip"``) and their tokens: counted in the cells the
    # executor ran, kept out of the loss (a NaN would make the epoch's mean NaN). Defaults, so
    # that a checkpoint written before they existed still resumes.
    skipped: int = 0
    skipped_tokens: int = 0
    # has_aux: each aux value x real tokens, weighted as the loss is ({name: sum}).
    aux_sum: dict = dataclasses.field(default_factory=dict)

    def add(self, *, loss: float, tokens: int, padded: int, seconds: float,
            skipped: bool = False, aux: dict | None = None) -> EpochTotals:
        aux_sum = dict(self.aux_sum)
        for name, value in (aux or {}).items() if not skipped else ():
            aux_sum[name] = aux_sum.get(name, 0.0) + value * tokens
        return EpochTotals(self.loss_sum + (0.0 if skipped else loss * tokens),
                           self.tokens + tokens, self.padded + padded, self.steps + 1,
                           self.seconds + seconds, self.skipped + skipped,
                           self.skipped_tokens + (tokens if skipped else 0), aux_sum)

    @property
    def trained_tokens(self) -> int:
        """The real tokens of the steps applied (skipped ones excluded)."""
        return self.tokens - self.skipped_tokens

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a run is: the epoch, the batches done in it, the steps done in the whole run and
    the epoch's totals so far. A checkpoint stores it beside the `TrainState`, so a resumed run
    continues with the same batch and the same epoch record as an uninterrupted one."""

    epoch: int = 0
    batch: int = 0
    step: int = 0
    totals: EpochTotals = EpochTotals()

    def after_step(self, **step_totals: Any) -> Position:
        return Position(self.epoch, self.batch + 1, self.step + 1, self.totals.add(**step_totals))

    def next_epoch(self) -> Position:
        return Position(self.epoch + 1, 0, self.step)

    def meta(self, history: list[dict], fingerprint: dict) -> dict:
        """The checkpoint header (``position`` is the batch within the epoch)."""
        return {"step": self.step, "epoch": self.epoch, "position": self.batch,
                "totals": dataclasses.asdict(self.totals),
                "history": [r for r in history if r["kind"] == "epoch"], "fingerprint": fingerprint}

    @classmethod
    def from_meta(cls, meta: dict) -> Position:
        return cls(meta["epoch"], meta["position"], meta["step"], EpochTotals(**meta["totals"]))


def warmup_record(*, step: int, compiles: int, compile_seconds: float, events: dict,
                  seconds: float) -> dict:
    return {"kind": "warmup", "step": step, "compiles": compiles,
            "compile_seconds": compile_seconds, "xla_compiles": events["xla_compiles"],
            "cache_hits": events["cache_hits"], "seconds": seconds}


def step_record(position: Position, *, loss: float, grad_norm: float, tokens: int,
                bucket: tuple[int, ...], seconds: float, compiles: int,
                skipped: bool = False, aux: dict | None = None) -> dict:
    record = {"kind": "step", "step": position.step, "epoch": position.epoch,
              "position": position.batch, "loss": loss, "grad_norm": grad_norm, "tokens": tokens,
              "bucket": list(bucket), "seconds": seconds, "compiles": compiles}
    if aux is not None:  # has_aux: the loss's aux, {name: value}
        record["aux"] = aux
    if skipped:          # on_nonfinite="skip": the loss or gradient was not finite
        record["skipped"] = True
    return record


def epoch_record(position: Position, *, val_loss: float | None, compiles: int,
                 compiles_at_start: int, compile_seconds: float, seconds: float,
                 train_seconds: float, elapsed: float) -> dict:
    totals = position.totals
    return {"kind": "epoch", "epoch": position.epoch, "step": position.step,
            "steps": totals.steps, "skipped": totals.skipped,
            # Every step skipped: no loss to report (nan), not the 0 of an epoch with no steps.
            "train_loss": (totals.loss_sum / max(totals.trained_tokens, 1)
                           if totals.trained_tokens > 0 or not totals.skipped else float("nan")),
            "val_loss": val_loss, "tokens": totals.tokens, "tokens_per_s": totals.tokens_per_s,
            "padding_efficiency": totals.tokens / max(totals.padded, 1),
            "compiles": compiles, "compiles_epoch": compiles - compiles_at_start,
            "compile_seconds": compile_seconds, "seconds": seconds,
            "train_seconds": train_seconds, "elapsed": elapsed,
            **({"aux": {name: value / max(totals.trained_tokens, 1)
                        for name, value in totals.aux_sum.items()}} if totals.aux_sum else {})}


class MetricsLog:
    """The run's records: kept in ``history`` and appended as JSON lines to ``path``.

    On resume, the file's records after the checkpoint (written by the interrupted run past its
    last checkpoint) are dropped, so the file reads as one run.
    """

    def __init__(self, path: str | None, history: list[dict], *, restored: Position | None):
        self.history = history
        self._file = None
        if path is None:
            return
        kept = _lines_up_to(path, restored) if restored is not None else []
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "w")
        self._file.writelines(kept)
        self._file.flush()

    def add(self, record: dict) -> None:
        self.history.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _lines_up_to(path: str, restored: Position) -> list[str]:
    if not os.path.exists(path):
        return []
    kept = []
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue   # a line torn by the kill
            if r.get("step", 0) > restored.step:
                continue
            if r.get("kind") == "epoch" and r.get("epoch", -1) >= restored.epoch:
                continue
            kept.append(line if line.endswith("\n") else line + "\n")
    return kept
