"""The one exception hierarchy, and the validators that raise it.

Every error polyexec raises for bad input or misuse derives from `PolyexecError`; the ones about
a bad value are also `ValueError` (and `OptionError` also `TypeError`), so ``except ValueError``
keeps working. One wording everywhere: ``<where>: expected <what>, received <value>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class PolyexecError(Exception):
    """Base class of every error raised by polyexec."""


class SpecError(PolyexecError, ValueError):
    """An input does not match its `Spec`: wrong rank, dtype, size, or disagreeing lengths.

    The message names the argument path and axis (``args[1].shape[1]``), what was expected and
    what was received. Raised before anything is traced or compiled.
    """


class OptionError(PolyexecError, ValueError, TypeError):
    """A bad argument to a polyexec call (an option, a dataset, a flag), not an input array."""


class LengthOverflowError(SpecError):
    """A length variable's size is above its declared ``max``."""


class PolymorphismError(PolyexecError):
    """The function cannot be traced once for all sizes, or padding could change its result
    (``strict=True`` turns the fallback into this error). ``.reason`` names the user's line."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class CompileError(PolyexecError):
    """Something compiled inside `forbid_compiles`, or a bucket failed to compile."""


def is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_int(value: Any, where: str, *, min: int | None = None, optional: bool = False,
              error: type[PolyexecError] = OptionError) -> int | None:
    """``value`` as an int, else ``error`` saying what was expected and received.

    >>> check_int(3, "fit: epochs", min=1)
    3
    >>> check_int(0, "fit: epochs", min=1)
    Traceback (most recent call last):
    polyexec._errors.OptionError: fit: epochs: expected an int >= 1, received 0
    """
    if value is None and optional:
        return None
    if not is_int(value) or (min is not None and value < min):
        wanted = "an int" + ("" if min is None else f" >= {min}") + (" or None" if optional else "")
        raise error(f"{where}: expected {wanted}, received {value!r}")
    return int(value)


def check_option(value: Any, options: Sequence[Any], where: str) -> Any:
    """``value`` if it is one of ``options``, else an `OptionError` listing them.

    Matched by type as well as value: ``1`` is not ``True``, ``1.0`` is not ``1``.
    """
    if not any(value is o or (type(value) is type(o) and value == o) for o in options):
        raise OptionError(f"{where}: expected one of {', '.join(map(repr, options))}, "
                          f"received {value!r}")
    return value


def check_bool(value: Any, where: str) -> bool:
    return check_option(value, (True, False), where)
