"""The one exception hierarchy: every error polyexec raises derives from `PolyexecError`."""

from __future__ import annotations


class PolyexecError(Exception):
    """Base class of every error raised by polyexec."""


class SpecError(PolyexecError, ValueError):
    """An input does not match its `Spec`: wrong rank, dtype, size, or disagreeing lengths.

    The message names the argument path and axis (``args[1].shape[1]``), what was expected and
    what was received. Raised before anything is traced or compiled.
    """


class LengthOverflowError(SpecError):
    """A length variable's size is above its declared ``max``."""


class PolymorphismError(PolyexecError):
    """The function cannot be traced once for all sizes (``strict=True`` turns the fallback
    into this error). ``.reason`` says which line of user code needs a concrete size."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class CompileError(PolyexecError):
    """Something compiled inside `forbid_compiles`, or a bucket failed to compile."""
