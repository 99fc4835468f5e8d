"""Checkpoints: one file per save holding a JSON header, a checksum and the equinox-serialised state.

A file (format v2) is::

    polyexec-checkpoint-v2\\n
    <one line of JSON: step, data-order position, metrics so far, the run's fingerprint>\\n
    sha256 <64 hex digits> <payload bytes, 16 decimal digits>\\n
    <eqx.tree_serialise_leaves of the TrainState>

The SHA-256 covers the header line and the payload, so a flipped weight, an edited step or a
file cut short is found on load instead of resuming silently to a different run. The payload
length is stored as well so that a truncated file is reported as such.

A save writes a temporary ``.step-*.tmp`` in the same folder and moves it into place with
``os.replace`` (atomic): a run killed while saving leaves the previous checkpoint intact, and
the next `latest_checkpoint` or `save_checkpoint` removes the orphaned temp file.

`latest_checkpoint` returns the newest checkpoint whose checksum holds; each damaged newer one
is reported with a `CheckpointWarning` naming the file and what is wrong. When every checkpoint
is damaged it raises `CorruptCheckpointError` rather than starting afresh: a fresh run would
silently throw away all progress, and its own low-step checkpoints would be the first ones
pruned next to the damaged high-step files.

One run writes to a folder at a time: the first save takes an exclusive ``fcntl.flock`` on
``<folder>/.lock`` (recording pid, host and command) and the process keeps it until it exits
or calls `release_checkpoint_dir`; a second process saving there gets a `CheckpointError`
naming the folder and the holder. (Two runs sharing a folder would prune each other's
checkpoints and resume from each other's state.) ``with checkpoint_dir_lock(folder):`` takes
it for a block instead, e.g. for the length of one `fit`.

Files of format v1 (``polyexec-checkpoint-v1``, no checksum) still load; they cannot be
verified, so damage in their arrays shows only as a structure mismatch on load.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import re
import socket
import sys
import tempfile
import threading
import time
import warnings
from typing import Any

import equinox as eqx
import jax

from .._errors import OptionError

try:
    import fcntl
except ImportError:   # not POSIX: no folder lock (saves are still atomic and verified)
    fcntl = None

MAGIC = b"polyexec-checkpoint-v2"
MAGIC_V1 = b"polyexec-checkpoint-v1"
_NAME = re.compile(r"^step-(\d{9})\.ckpt$")
_TEMP = re.compile(r"^\.step-\d{9}\..*\.tmp$")
_LOCK = ".lock"
_DIGEST = re.compile(rb"^sha256 ([0-9a-f]{64}) (\d{16})$")
_CHUNK = 1 << 20


# OptionError, not a bare PolyexecError: callers (the example CLI among them) already turn an
# OptionError into a one-line usage error, and a damaged or busy checkpoint_dir is a bad
# argument to that run.
class CheckpointError(OptionError):
    """A checkpoint cannot be written or read: no space left, folder in use by another run,
    a file that is not a readable checkpoint."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is damaged: truncated, checksum mismatch, unreadable header."""


class CheckpointWarning(UserWarning):
    """A damaged newest checkpoint was skipped in favour of an older intact one."""


def _path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:09d}.ckpt")


def list_checkpoints(directory: str | os.PathLike) -> list[str]:
    """The checkpoint files in ``directory``, oldest step first (named like one; not verified)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return []
    names = sorted(n for n in os.listdir(directory) if _NAME.match(n))
    return [os.path.join(directory, n) for n in names]


def latest_checkpoint(directory: str | os.PathLike) -> str | None:
    """The newest intact checkpoint file in ``directory``, or None when there is none.

    Removes temp files left by interrupted saves (when no other process is saving there).
    Each newer checkpoint that fails verification is reported with a `CheckpointWarning`;
    when checkpoints exist but none is intact, raises `CorruptCheckpointError` listing them.
    """
    directory = os.fspath(directory)
    _remove_stale_temps(directory)
    found = list_checkpoints(directory)
    damaged = []
    for path in reversed(found):
        try:
            verify_checkpoint(path)
        except CorruptCheckpointError as e:
            damaged.append(str(e))
            continue
        for why in damaged:
            warnings.warn(f"{why}; using the previous intact checkpoint {path}",
                          CheckpointWarning, stacklevel=2)
        return path
    if damaged:
        raise CorruptCheckpointError(
            f"{directory}: expected at least one intact checkpoint to resume from, found "
            f"{len(damaged)} and every one is damaged: {'; '.join(damaged)}. Move them away, "
            f"or use another checkpoint_dir or resume=False")
    return None


# -- saving ---------------------------------------------------------------------------------------


class _HashingWriter:
    """A write-only file wrapper hashing what goes through it and keeping the first OSError:
    equinox wraps exceptions raised inside its tree walk, so the cause (ENOSPC) is read from
    here rather than from what reaches `save_checkpoint`."""

    def __init__(self, f, digest):
        self.f, self.digest, self.size, self.error = f, digest, 0, None

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise
        self.digest.update(data)
        self.size += memoryview(data).nbytes
        return n

    def flush(self):
        self.f.flush()


def save_checkpoint(directory: str | os.PathLike, state: Any, meta: dict, *, keep: int | None = 3) -> str:
    """Write ``state`` (any pytree, usually a `TrainState`) and ``meta`` atomically; return the
    path. ``meta['step']`` names the file. Only the newest ``keep`` checkpoints are kept.

    Raises `CheckpointError` (the previous checkpoint kept, no temp file left) when the disk is
    full or the write fails, and when another process holds the folder.

    >>> import tempfile, equinox as eqx, jax, optax
    >>> from polyexec.training import TrainState, save_checkpoint, load_checkpoint
    >>> state = TrainState.create(eqx.nn.Linear(2, 1, key=jax.random.PRNGKey(0)), optax.adam(1e-3))
    >>> d = tempfile.mkdtemp()
    >>> path = save_checkpoint(d, state, {"step": 0, "epoch": 0, "position": 0})
    >>> restored, meta = load_checkpoint(path, like=state)
    >>> meta["position"], bool((restored.model.weight == state.model.weight).all())
    (0, True)
    """
    directory = os.fspath(directory)
    step = int(meta["step"])
    header = json.dumps(meta, sort_keys=True).encode() + b"\n"   # one line: dumps escapes \n
    target = _path(directory, step)
    try:
        os.makedirs(directory, exist_ok=True)
        _hold(directory)
    except CheckpointError:
        raise
    except OSError as e:   # a read-only folder: the lock file cannot even be created
        raise _write_error(directory, step, e) from None
    with _thread_lock:
        _remove_stale_temps(directory)
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".step-{step:09d}.", suffix=".tmp", dir=directory)
        except OSError as e:
            raise _write_error(directory, step, e) from None
        writer = None
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + b"\n" + header)
                digest_at = f.tell()
                f.write(_digest_line("0" * 64, 0))   # placeholder, same width, filled in below
                digest = hashlib.sha256(header)
                writer = _HashingWriter(f, digest)
                eqx.tree_serialise_leaves(writer, _keys_as_data(state))
                f.seek(digest_at)
                f.write(_digest_line(digest.hexdigest(), writer.size))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            cause = (writer.error if writer is not None else None) or _os_error(e)
            if cause is not None:
                raise _write_error(directory, step, cause) from None
            raise
        if keep is not None:
            _prune(directory, keep, target)
    return target


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _keys_as_data(tree: Any) -> Any:
    """Typed PRNG keys (an NNX ``nnx.Dropout``'s or ``nnx.RNN``'s stream) as their uint32
    data: numpy, which ``eqx.tree_serialise_leaves`` writes with, cannot hold a key, and the
    save of any NNX model that kept one failed. Other leaves are written as before, byte for
    byte, so older checkpoints still load."""
    return jax.tree_util.tree_map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _data_as_keys(tree: Any, like: Any) -> Any:
    """`_keys_as_data` undone: each leaf that is a key in ``like`` wrapped again, by its impl."""
    return jax.tree_util.tree_map(
        lambda x, k: jax.random.wrap_key_data(x, impl=jax.random.key_impl(k)) if _is_key(k)
        else x, tree, like)


def _digest_line(hexdigest: str, size: int) -> bytes:
    return f"sha256 {hexdigest} {size:016d}\n".encode()


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind ``e``, following the chain (equinox re-raises with a tree path)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _write_error(directory: str, step: int, e: OSError) -> CheckpointError:
    previous = [p for p in list_checkpoints(directory) if p != _path(directory, step)]
    kept = f"the previous checkpoint {previous[-1]} is kept" if previous else "no earlier checkpoint"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on device"
    else:
        what = f"{e.strerror or e} (errno {e.errno})"
    return CheckpointError(f"{directory}: expected to save the checkpoint of step {step}, "
                           f"failed: {what}; {kept}, no temp file left")


def _prune(directory: str, keep: int, target: str) -> None:
    """Delete all but the newest ``keep`` checkpoint files; never ``target``, never a directory
    (one named like a checkpoint is the user's, reported by `latest_checkpoint`)."""
    files = [p for p in list_checkpoints(directory) if os.path.isfile(p)]
    for old in files[:-keep]:
        if old != target:
            with contextlib.suppress(FileNotFoundError):   # removed by hand meanwhile
                os.unlink(old)


def _remove_stale_temps(directory: str) -> None:
    """Remove ``.step-*.tmp`` files of interrupted saves. A live save holds the folder lock for
    as long as its temp file exists, so with the lock held here every temp file is orphaned;
    when another process holds it (it may be saving right now), leave them."""
    if not os.path.isdir(directory):
        return
    with _thread_lock:
        held = _key(directory) in _held
        if not (held or _try_lock_briefly(directory)):
            return
        try:
            for name in os.listdir(directory):
                if _TEMP.match(name):
                    with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                        os.unlink(os.path.join(directory, name))
        finally:
            if not held:
                _unlock_brief(directory)


# -- the folder lock ------------------------------------------------------------------------------

_thread_lock = threading.RLock()
_held: dict[str, int] = {}    # real folder path -> descriptor of its flocked .lock file
_brief: dict[str, int] = {}   # the same, taken just to remove temp files


def _key(directory: str) -> str:
    return os.path.realpath(directory)


def _open_lock(directory: str) -> int:
    return os.open(os.path.join(directory, _LOCK), os.O_RDWR | os.O_CREAT, 0o644)


def _holder(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096) or b"{}")
        return (f"pid {info.get('pid')} on {info.get('host')} since {info.get('since')} "
                f"({info.get('command')})")
    except (OSError, ValueError):
        return "another process (its details are unreadable)"


def _hold(directory: str) -> None:
    """Take the folder for this process (kept until exit or `release_checkpoint_dir`)."""
    if fcntl is None:
        return
    with _thread_lock:
        if _key(directory) in _held:
            return
        fd = _open_lock(directory)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = _holder(fd)
            os.close(fd)
            raise CheckpointError(
                f"{directory}: expected a checkpoint folder no other run is writing to, found "
                f"it held by {who} (lock {os.path.join(directory, _LOCK)}); use another "
                f"checkpoint_dir, or wait for that run to end") from None
        except OSError as e:
            # A file system without flock (some network or FUSE mounts): saves stay atomic
            # and verified, only a second writer goes unnoticed -- say so once per folder.
            os.close(fd)
            warnings.warn(f"{directory}: expected a file system with file locks, found none "
                          f"({e.strerror or e}); another run writing here would not be refused",
                          CheckpointWarning, stacklevel=3)
            # Recorded as held (a descriptor release_checkpoint_dir can close like a lock's) so
            # that this process's own saves go on and clean up its orphaned temp files.
            _held[_key(directory)] = os.open(os.devnull, os.O_RDONLY)
            return
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)[:200]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        _held[_key(directory)] = fd


def _try_lock_briefly(directory: str) -> bool:
    if fcntl is None:
        return True
    try:
        fd = _open_lock(directory)
    except OSError:   # a read-only folder: nothing can be removed there anyway
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:   # held by a live save, or no flock here: the temp files may be live
        os.close(fd)
        return False
    _brief[_key(directory)] = fd
    return True


def _unlock_brief(directory: str) -> None:
    fd = _brief.pop(_key(directory), None)
    if fd is not None:
        os.close(fd)   # closing the only descriptor releases the flock


def release_checkpoint_dir(directory: str | os.PathLike) -> None:
    """Let other processes write checkpoints to ``directory`` again (this process took it at
    its first save there)."""
    with _thread_lock:
        fd = _held.pop(_key(os.fspath(directory)), None)
        if fd is not None:
            os.close(fd)   # closing the only descriptor releases the flock


@contextlib.contextmanager
def checkpoint_dir_lock(directory: str | os.PathLike):
    """Hold ``directory`` for the block: another process saving there is refused (at entry,
    not at its first save), and the folder is let go when the block ends unless this process
    held it already. Refuses like `save_checkpoint`.
    """
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    with _thread_lock:
        fresh = _key(directory) not in _held
        _hold(directory)
    try:
        yield directory
    finally:
        if fresh:
            release_checkpoint_dir(directory)


# -- loading --------------------------------------------------------------------------------------


def _corrupt(path, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{os.fspath(path)}: {what}")


def _open(path):
    try:
        return open(path, "rb")
    except IsADirectoryError:
        raise _corrupt(path, "expected a checkpoint file, found a directory") from None
    except OSError as e:
        raise _corrupt(path, f"expected a readable checkpoint file, cannot open it "
                             f"({e.strerror or e})") from None


def _read_header(f, path) -> tuple[dict, bytes, tuple[str, int] | None]:
    """The header, its raw line and (digest, payload size) -- None for a v1 file."""
    try:
        magic = f.readline().rstrip(b"\n")
        if magic not in (MAGIC, MAGIC_V1):
            raise _corrupt(path, f"expected a polyexec checkpoint (first line {MAGIC!r}), "
                                 f"found first line {magic[:40]!r}")
        line = f.readline()
        if not line.endswith(b"\n"):
            raise _corrupt(path, f"expected a header line, found the file cut short after "
                                 f"{f.tell()} bytes (truncated)")
        try:
            meta = json.loads(line)
        except ValueError as e:
            raise _corrupt(path, f"expected a JSON header on line 2, found {line[:60]!r} "
                                 f"({e})") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
            raise _corrupt(path, f"expected a JSON header with an int 'step', found "
                                 f"{line[:60]!r}")
        if magic == MAGIC_V1:
            return meta, line, None
        digest = _DIGEST.match(f.readline().rstrip(b"\n"))
        if digest is None:
            raise _corrupt(path, "expected a 'sha256 <digest> <size>' line 3, found none "
                                 "(truncated or damaged)")
        return meta, line, (digest.group(1).decode(), int(digest.group(2)))
    except OSError as e:
        raise _corrupt(path, f"expected a readable checkpoint, reading failed "
                             f"({e.strerror or e})") from None


def _check(path, line: bytes, payload_chunks, expected: tuple[str, int]) -> None:
    digest, size = hashlib.sha256(line), 0
    for chunk in payload_chunks:
        digest.update(chunk)
        size += len(chunk)
    want_digest, want_size = expected
    if size != want_size:
        raise _corrupt(path, f"expected {want_size} bytes of arrays, found {size} "
                             f"({'truncated' if size < want_size else 'extra data'})")
    if digest.hexdigest() != want_digest:
        raise _corrupt(path, f"expected SHA-256 {want_digest[:16]}..., found "
                             f"{digest.hexdigest()[:16]}...: the header or the arrays were "
                             f"changed after saving")


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check ``path``'s checksum without building the state; return its header.
    `CorruptCheckpointError` names the file and what is wrong. (A v1 file: header only.)"""
    with _open(path) as f:
        meta, line, expected = _read_header(f, path)
        if expected is not None:
            try:
                _check(path, line, iter(lambda: f.read(_CHUNK), b""), expected)
            except OSError as e:
                raise _corrupt(path, f"expected a readable checkpoint, reading failed "
                                     f"({e.strerror or e})") from None
    return meta


def read_meta(path: str | os.PathLike) -> dict:
    """The JSON header of a checkpoint, verified against its checksum."""
    return verify_checkpoint(path)


def load_checkpoint(path: str | os.PathLike, like: Any) -> tuple[Any, dict]:
    """Read a checkpoint into the structure of ``like`` (a state built the same way as the
    saved one); return ``(state, meta)``. The checksum is verified first
    (`CorruptCheckpointError`); a different structure is an `OptionError`."""
    with _open(path) as f:
        meta, line, expected = _read_header(f, path)
        try:
            payload = f.read()
        except OSError as e:
            raise _corrupt(path, f"expected a readable checkpoint, reading failed "
                                 f"({e.strerror or e})") from None
    if expected is not None:
        _check(path, line, [payload], expected)
    try:
        state = _data_as_keys(eqx.tree_deserialise_leaves(io.BytesIO(payload),
                                                          _keys_as_data(like)), like)
    except Exception as e:  # a different model size, optimiser or cell type
        raise OptionError(f"{os.fspath(path)}: expected a checkpoint of the state's structure "
                          f"and shapes, received one that does not match them "
                          f"({type(e).__name__}: {e})") from e
    return state, meta
