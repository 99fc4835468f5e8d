"""Compile accounting and caching: the XLA compile counter (`CompileEvents`), `forbid_compiles`,
and the switch for JAX's persistent compile cache.

The executor counts compiled *buckets*; `CompileEvents` counts what XLA actually did (from
``jax.monitoring``), which tells a cold persistent cache (every bucket an XLA compile) from a
warm one (every bucket a disk load). JAX reports ``backend_compile_duration`` around
compile-or-load-from-cache, so real compiles are those events minus the cache hits.

Nothing here listens at import: ``jax.monitoring`` listeners live in one process-wide list that
JAX calls on every event, so each counter (and each `forbid_compiles` block) registers its own
for the time it is asked to count and takes it away again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator

import jax
from jax.experimental.compilation_cache import compilation_cache

from ._errors import CompileError, PolyexecError

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
# JAX records a miss when it writes a freshly compiled program into the persistent cache.
_CACHE_WRITE = "/jax/compilation_cache/cache_misses"


def _unregister(unregister, listener) -> None:
    # Someone may have cleared JAX's listener lists (jax.monitoring.clear_event_listeners):
    # then ours is gone already, and JAX's unregister asserts.
    try:
        unregister(listener)
    except (AssertionError, ValueError):
        pass


@dataclasses.dataclass(frozen=True)
class CompileCounts:
    """What XLA did over a span of time: a snapshot of a `CompileEvents` counter.

    ``backend_compiles`` counts JAX's backend-compile events (a compile, or a load from the
    persistent cache), ``backend_seconds`` their seconds, ``cache_hits`` the loads and
    ``cache_writes`` the programs written to the persistent cache; ``xla_compiles`` is
    ``backend_compiles - cache_hits``, the compiles XLA really ran.

    >>> CompileCounts(backend_compiles=3, cache_hits=2).xla_compiles
    1
    """

    backend_compiles: int = 0
    backend_seconds: float = 0.0
    cache_hits: int = 0
    cache_writes: int = 0

    @property
    def xla_compiles(self) -> int:
        return self.backend_compiles - self.cache_hits

    def as_dict(self) -> dict:
        """The four counts and ``xla_compiles``, as a plain dict (for JSON records)."""
        return {**dataclasses.asdict(self), "xla_compiles": self.xla_compiles}


class CompileEvents:
    """Count XLA compiles and persistent-cache hits and writes while a ``with`` block runs.

    The counter's ``jax.monitoring`` listeners are registered when the block is entered and
    removed when it ends, so only its caller pays for them. Process-wide, like JAX's events:
    compiles on other threads count too. Reading the counts (``events.xla_compiles``,
    ``events.counts()``) is safe at any time, inside the block or after it; a counter may be
    entered again later and goes on counting from where it stopped.

    >>> import jax, jax.numpy as jnp, polyexec as px
    >>> with px.count_compiles() as events:
    ...     _ = jax.jit(lambda x: x * 3 + 1)(jnp.ones(7))
    >>> events.backend_compiles >= 1, events.xla_compiles == events.backend_compiles - events.cache_hits
    (True, True)
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._counts = CompileCounts()
        self._active = False

    def _add(self, **delta) -> None:
        with self._lock:
            c = self._counts
            self._counts = dataclasses.replace(
                c, **{k: getattr(c, k) + v for k, v in delta.items()})

    def _on_duration(self, event: str, duration: float, **_: object) -> None:
        if event == _BACKEND_COMPILE:
            self._add(backend_compiles=1, backend_seconds=duration)

    def _on_event(self, event: str, **_: object) -> None:
        if event == _CACHE_HIT:
            self._add(cache_hits=1)
        elif event == _CACHE_WRITE:
            self._add(cache_writes=1)

    def __enter__(self) -> "CompileEvents":
        with self._lock:
            if self._active:
                raise PolyexecError("CompileEvents: expected a counter that is not counting "
                                    "already, received one inside its own with-block; use a "
                                    "second px.count_compiles() to count a nested span")
            self._active = True
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc) -> None:
        _unregister(jax.monitoring.unregister_event_duration_listener, self._on_duration)
        _unregister(jax.monitoring.unregister_event_listener, self._on_event)
        with self._lock:
            self._active = False

    def counts(self) -> CompileCounts:
        """The counts so far (an immutable snapshot)."""
        with self._lock:
            return self._counts

    @property
    def backend_compiles(self) -> int:
        return self.counts().backend_compiles

    @property
    def backend_seconds(self) -> float:
        return self.counts().backend_seconds

    @property
    def cache_hits(self) -> int:
        return self.counts().cache_hits

    @property
    def cache_writes(self) -> int:
        return self.counts().cache_writes

    @property
    def xla_compiles(self) -> int:
        return self.counts().xla_compiles

    def __repr__(self) -> str:
        c = self.counts()
        return (f"CompileEvents(xla_compiles={c.xla_compiles}, cache_hits={c.cache_hits}, "
                f"cache_writes={c.cache_writes}, backend_seconds={c.backend_seconds:.3f})")


def count_compiles() -> CompileEvents:
    """A new `CompileEvents` counter: ``with px.count_compiles() as events: ...``.

    >>> import numpy as np, polyexec as px
    >>> T = px.LengthVar("T", max=64)
    >>> f = px.bucketed(lambda x: x + 1, in_specs=(px.Spec("T"),), out_specs=px.Spec("T"),
    ...                 buckets={T: [16, 64]})
    >>> with px.count_compiles() as events:
    ...     _ = f(np.ones(10, np.float32)), f(np.ones(12, np.float32))   # one bucket, T=16
    >>> f.stats.compiles, events.xla_compiles + events.cache_hits >= 1
    (1, True)
    """
    return CompileEvents()


_forbid_lock = threading.Lock()
_forbid_depth = 0


def compiles_forbidden() -> bool:
    """Whether a `forbid_compiles` block is open (on any thread): the executor then refuses to
    compile a bucket at once, before compiling."""
    return _forbid_depth > 0


@contextlib.contextmanager
def forbid_compiles() -> Iterator[None]:
    """Raise `CompileError` if anything compiles inside the block.

    A polyexec bucket that is not compiled yet raises at once, before compiling; any other XLA
    compile in the block (an eager jnp op at a new shape, say) is reported when the block ends.
    Process-wide: compiles on other threads count too. The block listens to ``jax.monitoring``
    only while it is open.

    >>> import numpy as np, polyexec as px
    >>> T = px.LengthVar("T", max=8)
    >>> f = px.bucketed(lambda x: x * 2, in_specs=(px.Spec("T"),), out_specs=px.Spec("T"))
    >>> _ = f(np.ones(3, np.float32))           # compiles the bucket T=4
    >>> with px.forbid_compiles():
    ...     f(np.ones(4, np.float32)).tolist()  # same bucket: nothing compiles
    [2.0, 2.0, 2.0, 2.0]
    """
    global _forbid_depth
    seen: list[str] = []
    lock = threading.Lock()

    def on_duration(event: str, duration: float, **_: object) -> None:
        if event == _BACKEND_COMPILE:
            with lock:
                seen.append(f"an XLA compile of {duration:.3f} s")

    with _forbid_lock:
        _forbid_depth += 1
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        yield
    finally:
        _unregister(jax.monitoring.unregister_event_duration_listener, on_duration)
        with _forbid_lock:
            _forbid_depth -= 1
    with lock:
        new = list(seen)
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
    compilation_cache.reset_cache()
