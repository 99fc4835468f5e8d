"""What a run shows while it trains: a rich progress bar and per-epoch summary lines."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)


def _rate(x: float) -> str:
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


class RunDisplay:
    """Progress bar (epoch, step, loss, tokens/s, bucket, compiles) and summary lines.

    ``progress=False`` keeps the summaries but no live bar (logs, CI); ``verbose=False`` shows
    nothing at all.
    """

    def __init__(self, *, progress: bool, verbose: bool, console: Console | None = None):
        self.console = console or Console(stderr=False, highlight=False)
        self.verbose = verbose
        self.enabled = progress and verbose
        self._progress: Progress | None = None
        self._task = None

    def print(self, *objects: Any) -> None:
        if self.verbose:
            self.console.print(*objects)

    @contextlib.contextmanager
    def task(self, description: str, total: int) -> Iterator[Callable[[], None]]:
        """A transient bar for ``total`` units of work; yields the function that advances it."""
        if not self.enabled:
            yield lambda: None
            return
        bar = Progress(TextColumn(description), BarColumn(bar_width=24), MofNCompleteColumn(),
                       TimeElapsedColumn(), console=self.console, transient=True)
        task = bar.add_task(description, total=total)
        with bar:
            yield lambda: bar.advance(task)

    def start_epoch(self, epoch: int, epochs: int, total: int, done: int) -> None:
        if not self.enabled:
            return
        self._progress = Progress(
            TextColumn("[bold]epoch {task.fields[epoch]}"),
            BarColumn(bar_width=24), MofNCompleteColumn(),
            TextColumn("loss [cyan]{task.fields[loss]}"),
            TextColumn("{task.fields[rate]} tok/s"),
            TextColumn("bucket {task.fields[bucket]}"),
            TextColumn("compiles {task.fields[compiles]}"),
            TimeElapsedColumn(), TimeRemainingColumn(),
            console=self.console, transient=True)
        self._task = self._progress.add_task(
            "train", total=total, completed=done, epoch=f"{epoch + 1}/{epochs}", loss="-",
            rate="-", bucket="-", compiles="-")
        self._progress.start()

    def step(self, *, loss: float, rate: float, bucket: str, compiles: int) -> None:
        if self._progress is None:
            return
        self._progress.update(self._task, advance=1, loss=f"{loss:.4f}", rate=_rate(rate),
                              bucket=bucket, compiles=str(compiles))

    def end_epoch(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def epoch_summary(self, record: dict) -> None:
        val = record.get("val_loss")
        text = (f"epoch {record['epoch'] + 1}: train loss {record['train_loss']:.4f}"
                + (f", validation loss {val:.4f}" if val is not None else "")
                + "".join(f", {name} {value:.4g}" for name, value in record.get("aux", {}).items())
                + (f" | {record['skipped']} step(s) skipped (not finite)"
                   if record.get("skipped") else "")
                + f" | {record['steps']} steps, {_rate(record['tokens_per_s'])} tok/s, "
                f"padding efficiency {record['padding_efficiency']:.3f} | "
                f"compiles {record['compiles_epoch']} this epoch ({record['compiles']} total, "
                f"{record['compile_seconds']:.1f} s) | {record['seconds']:.1f} s")
        self.print(text)
