"""What a function being traced by polyexec may ask about its lengths.

The executor binds, per trace, each LengthVar to the real (pre-padding) size as a traced int32
scalar, and — only on the slow per-bucket path — to the concrete bucket size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import traceback
from collections.abc import Iterator, Mapping
from typing import Any

from ._errors import PolyexecError
from ._spec import LengthVar

_STATE = threading.local()


@dataclasses.dataclass(frozen=True)
class _Binding:
    valid: Mapping[str, Any]             # name -> traced int32 scalar: the real size
    bucket: Mapping[str, int] | None     # name -> concrete bucket size; None while symbolic


@contextlib.contextmanager
def binding(valid: Mapping[str, Any], bucket: Mapping[str, int] | None) -> Iterator[None]:
    previous = getattr(_STATE, "binding", None)
    _STATE.binding = _Binding(valid, bucket)
    try:
        yield
    finally:
        _STATE.binding = previous


def define_length(name: str, value) -> None:
    """Bind a data-dependent length (``px.compact(..., length=K)``) for the rest of the
    current binding, so ``valid_length(K)`` answers its count; no-op outside a binding."""
    b = getattr(_STATE, "binding", None)
    if b is not None:
        _STATE.binding = _Binding({**b.valid, name: value}, b.bucket)


def _current(fn_name: str, name: str) -> _Binding:
    b = getattr(_STATE, "binding", None)
    if b is None or name not in b.valid:
        where = "" if b is None else f" (this function's variables: {', '.join(b.valid) or 'none'})"
        raise PolyexecError(
            f"px.{fn_name}({name!r}) is only defined inside a function run by px.bucketed or "
            f"px.trace whose specs use {name!r}{where}")
    return b


def _name(var: LengthVar | str) -> str:
    return var.name if isinstance(var, LengthVar) else str(var)


def valid_length(var: LengthVar | str):
    """The real, pre-padding size of ``var`` inside a bucketed function, as a traced int32.

    Use it to mask reductions over a padded axis, so padding never changes the result:

    >>> import jax.numpy as jnp, numpy as np, polyexec as px
    >>> T = px.LengthVar("T", max=16)
    >>> def mean_over_time(x):  # x: (T,)
    ...     mask = px.arange_like(x) < px.valid_length(T)
    ...     return jnp.sum(jnp.where(mask, x, 0)) / px.valid_length(T)
    >>> f = px.bucketed(mean_over_time, in_specs=(px.Spec("T"),))
    >>> float(f(np.array([1.0, 2.0, 3.0], np.float32)))  # padded to 4 inside, same answer
    2.0
    """
    name = _name(var)
    return _current("valid_length", name).valid[name]


class ConcreteSizeRequested(Exception):
    """Raised by `max_length` during the symbolic trace: the plan cannot be size-independent."""

    def __init__(self, name: str, filename: str, lineno: int):
        super().__init__(f"px.max_length({name!r}) at {filename}:{lineno} asks for a concrete size")
        self.name = name
        self.filename = filename
        self.lineno = lineno


def max_length(var: LengthVar | str) -> int:
    """The concrete bucket size of ``var``, for code that insists on a Python int.

    Calling it makes the plan *reshaping-impossible* (Wolfram's ``GetDynamicMaxLength``): the
    function is retraced and compiled once per bucket instead of traced once. Prefer
    `valid_length`, `arange_like` and friends, which stay symbolic.
    """
    name = _name(var)
    b = _current("max_length", name)
    if b.bucket is None:
        caller = sys._getframe(1)
        raise ConcreteSizeRequested(name, caller.f_code.co_filename, caller.f_lineno)
    return b.bucket[name]


# Frames inside these directories are never "the user's line".
_LIBRARY_DIRS = tuple(
    os.path.dirname(m.__file__) + os.sep
    for m in [sys.modules.get(n) for n in ("jax", "jaxlib", "numpy", "equinox")]
    if m is not None and getattr(m, "__file__", None)
) + (os.path.dirname(os.path.abspath(__file__)) + os.sep,)
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep


def is_library(filename: str) -> bool:
    path = os.path.abspath(filename)
    in_stdlib = path.startswith(_STDLIB_DIR) and "site-packages" not in path
    return path.startswith(_LIBRARY_DIRS) or in_stdlib or filename.startswith("<frozen")


def user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of user code in an exception's traceback."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not is_library(f.filename)]
    return frames[-1] if frames else None


def describe_frame(frame: traceback.FrameSummary | None) -> str:
    if frame is None:
        return "<unknown location>"
    line = f": `{frame.line.strip()}`" if frame.line else ""
    return f"{frame.filename}:{frame.lineno} in {frame.name}{line}"
