"""Compile accounting and caching: the one XLA compile counter, `forbid_compiles`, and the
switch for JAX's persistent compile cache.

The executor counts compiled *buckets*; the counter here counts what XLA actually did (from
``jax.monitoring``), which tells a cold persistent cache (every bucket an XLA compile) from a
warm one (every bucket a disk load). JAX reports ``backend_compile_duration`` around
compile-or-load-from-cache, so real compiles are those events minus the cache hits.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import jax

from ._errors import CompileError

try:  # a private hook; without it the config switch alone applies (see _reset_jax_cache)
    from jax._src import compilation_cache as _compilation_cache
except ImportError:
    _compilation_cache = None

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_forbid_depth = 0
_seen: list[str] = []
_counts = {"backend_compiles": 0, "backend_seconds": 0.0, "cache_hits": 0, "cache_writes": 0}
_CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "cache_hits",
                 "/jax/compilation_cache/cache_misses": "cache_writes"}


def _on_duration(event: str, duration: float, **_: object) -> None:
    if event != _BACKEND_COMPILE:
        return
    with _lock:
        _counts["backend_compiles"] += 1
        _counts["backend_seconds"] += duration
        if _forbid_depth:
            _seen.append(f"an XLA compile of {duration:.3f} s")


def _on_event(event: str, **_: object) -> None:
    key = _CACHE_EVENTS.get(event)
    if key:
        with _lock:
            _counts[key] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


def xla_events() -> dict:
    """Process-wide counts so far: backend compiles (and their seconds), cache hits, writes."""
    with _lock:
        return dict(_counts)


def xla_events_since(before: dict) -> dict:
    """Counts since ``before`` (a `xla_events` snapshot), with ``xla_compiles`` = compiles not
    served from the persistent cache."""
    now = xla_events()
    out = {k: now[k] - before[k] for k in now}
    out["xla_compiles"] = out["backend_compiles"] - out["cache_hits"]
    return out


def compiles_forbidden() -> bool:
    return _forbid_depth > 0


@contextlib.contextmanager
def forbid_compiles() -> Iterator[None]:
    """Raise `CompileError` if anything compiles inside the block.

    A polyexec bucket that is not compiled yet raises at once, before compiling; any other XLA
    compile in the block (an eager jnp op at a new shape, say) is reported when the block ends.
    Process-wide: compiles on other threads count too.

    >>> import numpy as np, polyexec as px
    >>> T = px.LengthVar("T", max=8)
    >>> f = px.bucketed(lambda x: x * 2, in_specs=(px.Spec("T"),), out_specs=px.Spec("T"))
    >>> _ = f(np.ones(3, np.float32))           # compiles the bucket T=4
    >>> with px.forbid_compiles():
    ...     f(np.ones(4, np.float32)).tolist()  # same bucket: nothing compiles
    [2.0, 2.0, 2.0, 2.0]
    """
    global _forbid_depth
    with _lock:
        _forbid_depth += 1
        start = len(_seen)
    try:
        yield
    finally:
        with _lock:
            _forbid_depth -= 1
            new = _seen[start:]
            if _forbid_depth == 0:
                _seen.clear()
    if new:
        raise CompileError(f"{len(new)} compile(s) inside forbid_compiles: {'; '.join(new)}")


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "polyexec", "xla")


def enable_persistent_cache(path: str | None = None) -> str:
    """Turn on JAX's persistent compile cache (works on CPU, GPU and TPU) and return its folder.

    Every compile, however small, is cached: a bucket compiled by an earlier process loads from
    disk instead of compiling. ``path`` defaults to ``$POLYEXEC_CACHE_DIR`` or
    ``~/.cache/polyexec/xla``.
    """
    path = path or os.environ.get("POLYEXEC_CACHE_DIR") or default_cache_dir()
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _reset_jax_cache()
    return path


def disable_persistent_cache() -> None:
    """Stop reading and writing the persistent compile cache (in-memory caches are kept)."""
    jax.config.update("jax_compilation_cache_dir", None)
    _reset_jax_cache()


def _reset_jax_cache() -> None:
    # JAX opens the cache folder once, at the first compile of the process, and ignores later
    # changes of jax_compilation_cache_dir: without this reset, enabling the cache after any
    # compile, switching folders, or disabling it silently keeps writing to the first folder.
    if _compilation_cache is not None:
        _compilation_cache.reset_cache()
