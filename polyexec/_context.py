"""What a function being traced by polyexec may ask about its lengths.

The executor binds, per trace, each LengthVar to the real (pre-padding) size as a traced int32
scalar, and — only on the slow per-bucket path — to the concrete bucket size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import linecache
import os
import site
import sys
import sysconfig
import threading
import traceback
from collections.abc import Iterator, Mapping
from typing import Any


from ._errors import PolyexecError
from ._jax_internals import jax_user_frames
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


# Packages whose frames are JAX's own machinery (with polyexec and the standard library): a
# size comparison made there is a cache key or a shape rule. Found where they are installed
# (not imported: a package imported after polyexec counts as much as one imported before).
_INTERNAL = ("jax", "jaxlib", "numpy")
# Model libraries found the same way, for a checkout of one put on sys.path: a library
# anywhere else is found by where it is installed (`_install_dirs`).
_LIBRARIES = ("equinox", "optax")
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep


def _package_dirs(names) -> list[str]:
    dirs = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        dirs += (spec.submodule_search_locations or []) if spec is not None else []
    return dirs


def _install_dirs(path: tuple[str, ...]) -> list[str]:
    """Where packages are installed: this interpreter's site-packages (its venv's, the
    user's, the system's) and any ``site-packages``/``dist-packages`` folder on ``path``
    (another environment's, a ``pip install --target``). The user's project is on sys.path
    too (the script's folder, PYTHONPATH, an editable install's source), never in them."""
    dirs = list(getattr(site, "getsitepackages", list)())
    if site.ENABLE_USER_SITE and hasattr(site, "getusersitepackages"):
        dirs.append(site.getusersitepackages())
    dirs += [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
    dirs += [p for p in path
             if os.path.basename(os.path.normpath(p)) in ("site-packages", "dist-packages")]
    return dirs


def _as_prefixes(dirs) -> tuple[str, ...]:
    # A frame's file name is the path it was imported by; a symlinked install has two.
    return tuple({p + os.sep for d in dirs if d
                  for p in (os.path.abspath(d), os.path.realpath(d))})


@functools.cache
def _internal_dirs() -> tuple[str, ...]:
    return _as_prefixes([os.path.dirname(os.path.abspath(__file__))]
                        + _package_dirs(_INTERNAL))


@functools.lru_cache(maxsize=4)     # keyed by sys.path: a folder added later is seen
def _library_dirs(path: tuple[str, ...]) -> tuple[str, ...]:
    return _internal_dirs() + _as_prefixes(_package_dirs(_LIBRARIES) + _install_dirs(path))


def is_library(filename: str) -> bool:
    """A frame that is never the user's line: polyexec, the standard library, or any
    installed package (JAX, equinox, Flax, ...). Verdicts name the innermost frame outside
    them: the user's line that called into Flax, not ``flax/nnx/nn/stochastic.py``."""
    path = os.path.abspath(filename)
    return path.startswith(_library_dirs(tuple(sys.path))) or _is_stdlib(path, filename)


def is_jax_internal(filename: str) -> bool:
    """Frames of JAX, NumPy, polyexec and the standard library: a size comparison made there
    is a cache key or a shape rule, never a branch of the user's model (one made by the code
    of any other library the user calls, equinox's or optax's, is: a pooling layer choosing
    its padding)."""
    path = os.path.abspath(filename)
    return path.startswith(_internal_dirs()) or _is_stdlib(path, filename)


def _is_stdlib(path: str, filename: str) -> bool:
    # A system Python's site-packages sits inside the standard library's folder, yet the
    # packages installed there (Flax) are no part of it: their size comparisons are branches.
    return ((path.startswith(_STDLIB_DIR) and "site-packages" not in path
             and "dist-packages" not in path) or filename.startswith("<frozen"))


def equation_line(eqn) -> str | None:
    """``file:line: `code``` of the user's line that made an equation: the innermost frame
    of its traceback outside JAX and every other library (`is_library`), which JAX's own
    ``user_frame`` would name when it is a library's."""
    frame = next((f for f in jax_user_frames(eqn.source_info.traceback)
                  if not is_library(f.file_name)), None)
    if frame is None:
        return None
    line = linecache.getline(frame.file_name, frame.start_line).strip()
    return f"{frame.file_name}:{frame.start_line}" + (f": `{line}`" if line else "")


def user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of user code in an exception's traceback; else in the traceback of
    the JAX operation it came from: an error raised while JAX lowers or transforms an equation
    (a ``scan`` unrolled over a symbolic length) has no user frame of its own, and JAX chains
    the equation's source traceback as its ``__cause__``."""
    error: BaseException | None = exc
    while error is not None:
        frames = [f for f in traceback.extract_tb(error.__traceback__)
                  if not is_library(f.filename)]
        if frames:
            return frames[-1]
        error = error.__cause__
    return None


def describe_frame(frame: traceback.FrameSummary | None) -> str:
    if frame is None:
        return "<unknown location>"
    line = f": `{frame.line.strip()}`" if frame.line else ""
    return f"{frame.filename}:{frame.lineno} in {frame.name}{line}"
