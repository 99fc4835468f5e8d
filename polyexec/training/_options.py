"""`FitOptions`: how a `fit` run trains, checked before any data is read or anything compiles."""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Callable, Sequence
from typing import Any, Literal

from .._errors import OptionError, check_bool, check_int, check_option

# What a step whose loss or gradient is not finite does (see `fit`).
OnNonfinite = Literal["stop", "skip"]


def _optional_path(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise OptionError(f"{where}: expected None or a path, received {value!r}")
    return os.fspath(value)


@dataclasses.dataclass(frozen=True)
class FitOptions:
    """Every keyword option of `fit`, declared once: `fit` takes exactly these fields as
    keyword arguments (its signature is built from them) and checks them here, before any data
    is read or anything compiles. Every bad value raises `OptionError` naming the argument.
    Normalised: ``batch_size`` is 32 when neither it nor ``max_tokens`` is given; paths are
    strings; ``callbacks`` is a tuple. What each option does is in `fit`'s docstring.

    >>> FitOptions(max_tokens=4096).batch_size is None
    True
    >>> FitOptions(epochs=-1)
    Traceback (most recent call last):
    polyexec._errors.OptionError: fit: epochs: expected an int >= 0, received -1
    >>> FitOptions.from_kwargs({"epoch": 3})
    Traceback (most recent call last):
    polyexec._errors.OptionError: fit: expected keyword arguments among optimizer, validation, eval_fn, epochs, ..., received unknown 'epoch'
    """

    epochs: int = 1
    batch_size: int | None = None
    max_tokens: int | None = None
    buckets: Any = None
    min_length: int = 2
    pad_id: int = 0
    seed: int = 0
    shuffle: bool = True
    devices: int | Sequence[Any] | None = None
    cache: bool | str | os.PathLike | None = None
    warmup: bool = True
    warmup_workers: int | None = None
    checkpoint_dir: str | os.PathLike | None = None
    checkpoint_every: int | None = None
    keep_checkpoints: int = 3
    resume: bool = True
    max_steps: int | None = None
    metrics_file: str | os.PathLike | None = None
    callbacks: Sequence[Callable[[Any], None]] = ()
    progress: bool | None = None
    verbose: bool = True
    console: Any = None
    masking: bool = True
    layout: str = "auto"
    train_on_padding: bool = False
    specs: Any = None
    on_nonfinite: OnNonfinite = "stop"
    has_aux: bool = False

    @classmethod
    def from_kwargs(cls, kwargs: dict, *, also: Sequence[str] = ("optimizer", "validation",
                                                                   "eval_fn")) -> "FitOptions":
        """The options of a `fit` call's keyword arguments; an unknown keyword is an
        `OptionError` listing the known ones (``also``: `fit`'s own keywords, for the list)."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            listed = ", ".join([*also, *names])
            raise OptionError(f"fit: expected keyword arguments among {listed}, received unknown "
                              f"{', '.join(map(repr, unknown))}")
        return cls(**kwargs)

    def __post_init__(self):
        def normalise(name, value):  # frozen: fields are set once, here, before anyone sees them
            object.__setattr__(self, name, value)

        if self.batch_size is not None and self.max_tokens is not None:
            raise OptionError(f"fit: expected one of batch_size= or max_tokens=, received both "
                              f"(batch_size={self.batch_size!r}, max_tokens={self.max_tokens!r})")
        for name, low, optional in (("epochs", 0, False), ("min_length", 1, False),
                                    ("pad_id", None, False), ("seed", 0, False),
                                    ("keep_checkpoints", 1, False), ("batch_size", 1, True),
                                    ("max_tokens", 1, True), ("checkpoint_every", 1, True),
                                    ("max_steps", 1, True), ("warmup_workers", 1, True)):
            normalise(name, check_int(getattr(self, name), f"fit: {name}", min=low,
                                      optional=optional))
        if self.batch_size is None and self.max_tokens is None:
            normalise("batch_size", 32)
        for name in ("shuffle", "masking", "warmup", "resume", "verbose", "train_on_padding",
                     "has_aux"):
            check_bool(getattr(self, name), f"fit: {name}")
        if self.progress is not None:
            check_bool(self.progress, "fit: progress")
        if not isinstance(self.cache, (bool, str, os.PathLike, type(None))):
            raise OptionError(f"fit: cache: expected None, True, False or a path, received "
                              f"{self.cache!r}")
        if not isinstance(self.cache, bool):
            normalise("cache", _optional_path(self.cache, "fit: cache"))
        normalise("checkpoint_dir", _optional_path(self.checkpoint_dir, "fit: checkpoint_dir"))
        normalise("metrics_file", _optional_path(self.metrics_file, "fit: metrics_file"))
        if not isinstance(self.callbacks, Sequence) or not all(map(callable, self.callbacks)):
            raise OptionError(f"fit: callbacks: expected a sequence of callables "
                              f"(StepInfo) -> None, received {self.callbacks!r}")
        normalise("callbacks", tuple(self.callbacks))
        check_option(self.on_nonfinite, typing.get_args(OnNonfinite), "fit: on_nonfinite")
        if self.layout not in ("auto", "pad", "pack"):
            raise OptionError(f"fit: layout: expected one of 'auto', 'pad', 'pack', received "
                              f"{self.layout!r}")

    @property
    def fingerprint(self) -> dict:
        """The options a checkpoint only resumes under: they decide the order of the batches."""
        return {"batch_size": self.batch_size, "max_tokens": self.max_tokens,
                "shuffle": self.shuffle, "seed": self.seed, "layout": self.layout}


def check_callable(value: Any, where: str, what: str, *, optional: bool = False) -> None:
    if not (callable(value) or (optional and value is None)):
        raise OptionError(f"{where}: expected {what}, received {type(value).__name__}")
