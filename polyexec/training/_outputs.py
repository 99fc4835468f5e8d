"""Output paths checked before any work starts: a run that can only fail at its first
checkpoint, metrics line or JSON file should fail before it trains or measures anything."""

from __future__ import annotations

import os
import uuid

from .._errors import OptionError


def _test_write(folder: str, where: str, path: str) -> None:
    probe = os.path.join(folder, f".polyexec-write-test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(probe, "w", encoding="utf-8") as fh:
            fh.write("ok")
    except OSError as e:
        raise OptionError(f"{where}: expected a writable location, received {path!r} "
                          f"({e.strerror or e})") from None
    finally:
        try:
            os.remove(probe)
        except OSError:
            pass


def check_output_dir(path: str | os.PathLike, where: str) -> str:
    """``path`` as a folder to write into: created when missing, then test-written; else an
    `OptionError` naming ``where`` (a flag or an argument), e.g. when ``path`` is a file.

    >>> import tempfile, os
    >>> from polyexec.training import check_output_dir
    >>> folder = os.path.join(tempfile.mkdtemp(), "checkpoints")
    >>> check_output_dir(folder, "--checkpoint-dir") == folder and os.path.isdir(folder)
    True
    >>> check_output_dir(__file__, "--checkpoint-dir")
    Traceback (most recent call last):
    polyexec._errors.OptionError: --checkpoint-dir: expected a folder (created if missing), received ... which is a file
    """
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise OptionError(f"{where}: expected a folder (created if missing), received {path!r} "
                          f"which is a file")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise OptionError(f"{where}: expected a folder that can be created, received {path!r} "
                          f"({e.strerror or e})") from None
    _test_write(path, where, path)
    return path


def check_output_file(path: str | os.PathLike, where: str) -> str:
    """``path`` as a file to write (or append to) later: its folder must exist and take a
    test write, and ``path`` must not be a folder; else an `OptionError` naming ``where``.
    Nothing is written at ``path`` itself.

    >>> import tempfile, os
    >>> from polyexec.training import check_output_file
    >>> folder = tempfile.mkdtemp()
    >>> check_output_file(os.path.join(folder, "out.json"), "--json").endswith("out.json")
    True
    >>> check_output_file(folder, "--json")
    Traceback (most recent call last):
    polyexec._errors.OptionError: --json: expected a file path, received ... which is a folder
    >>> check_output_file(os.path.join(folder, "missing", "out.json"), "--json")
    Traceback (most recent call last):
    polyexec._errors.OptionError: --json: expected a file in an existing folder, received ... (no folder ...)
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise OptionError(f"{where}: expected a file path, received {path!r} which is a folder")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise OptionError(f"{where}: expected a file in an existing folder, received {path!r} "
                          f"(no folder {folder!r})")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise OptionError(f"{where}: expected a writable file, received {path!r} (not writable)")
    _test_write(folder, where, path)
    return path
