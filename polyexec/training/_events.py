"""Process-wide counts of XLA compiles and persistent-cache hits (from ``jax.monitoring``).

The executor counts compiled *buckets*; these count what XLA actually did, which tells a cold
persistent cache (every bucket an XLA compile) from a warm one (every bucket a disk load).
JAX reports ``backend_compile_duration`` around compile-or-load-from-cache, so real compiles
are those events minus the cache hits.
"""

from __future__ import annotations

import threading

import jax

_lock = threading.Lock()
_counts = {"backend_compiles": 0, "backend_seconds": 0.0, "cache_hits": 0, "cache_writes": 0}


def _on_duration(event: str, duration: float, **_: object) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        with _lock:
            _counts["backend_compiles"] += 1
            _counts["backend_seconds"] += duration


def _on_event(event: str, **_: object) -> None:
    key = {"/jax/compilation_cache/cache_hits": "cache_hits",
           "/jax/compilation_cache/cache_misses": "cache_writes"}.get(event)
    if key:
        with _lock:
            _counts[key] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


def snapshot() -> dict:
    with _lock:
        return dict(_counts)


def since(before: dict) -> dict:
    """Counts since ``before``, with ``xla_compiles`` = compiles not served from the cache."""
    now = snapshot()
    out = {k: now[k] - before[k] for k in now}
    out["xla_compiles"] = out["backend_compiles"] - out["cache_hits"]
    return out
