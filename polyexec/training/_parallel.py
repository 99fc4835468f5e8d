"""Data parallelism over local devices (and over hosts) with ``jax.sharding``."""

from __future__ import annotations

import dataclasses
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .._errors import OptionError, check_int, is_int
from .._jax_internals import backends_are_initialized

AXIS = "batch"


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """Where a run computes: a one-axis ``Mesh`` named ``"batch"`` over the devices, or None
    for a single device. Parameters are replicated (``P()``), batches split along their first
    axis (``P("batch")``); XLA inserts the gradient all-reduce."""

    mesh: Mesh | None
    local_devices: int
    processes: int = 1
    process_index: int = 0

    @property
    def replicated(self) -> NamedSharding | None:
        return None if self.mesh is None else NamedSharding(self.mesh, P())

    @property
    def batch(self) -> NamedSharding | None:
        return None if self.mesh is None else NamedSharding(self.mesh, P(AXIS))

    @property
    def shardings(self) -> tuple | None:
        return None if self.mesh is None else (self.replicated, self.batch)

    @property
    def size(self) -> int:
        return 1 if self.mesh is None else self.mesh.size

    def global_batch(self, local: Any) -> Any:
        """This process's rows as global arrays (multi-host), leaf by leaf of a batch's pytree;
        the host arrays otherwise -- the compiled step places host arrays by its input
        shardings itself."""
        if self.processes == 1:
            return local

        def one(leaf):
            shape = (leaf.shape[0] * self.processes, *leaf.shape[1:])
            return jax.make_array_from_process_local_data(self.batch, leaf, shape)
        return jax.tree_util.tree_map(one, local)


def parse_coordinator(text: Any, where: str = "coordinator") -> tuple[str, int]:
    """``"host:port"`` as ``(host, port)``, checked before JAX sees it: a host, and a port that
    is an int from 1 to 65535 (``[::1]:1234`` for an IPv6 address). JAX took ``bad:addr`` and
    crashed inside its runtime (rc 139), or waited without a word.

    >>> parse_coordinator("10.0.0.2:1234")
    ('10.0.0.2', 1234)
    >>> parse_coordinator("bad:addr", "--coordinator")
    Traceback (most recent call last):
    polyexec._errors.OptionError: --coordinator: expected HOST:PORT with PORT an int from 1 to 65535 (e.g. 10.0.0.2:1234), received 'bad:addr'
    """
    wanted = "HOST:PORT with PORT an int from 1 to 65535 (e.g. 10.0.0.2:1234)"
    host, sep, port = text.rpartition(":") if isinstance(text, str) else ("", "", "")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not (sep and host and port.isdigit() and 1 <= int(port) <= 65535
            and not any(c.isspace() for c in host)):
        raise OptionError(f"{where}: expected {wanted}, received {text!r}")
    return host, int(port)


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *, heartbeat_timeout: int = 100,
                           timeout: int = 60) -> int:
    """Join a multi-process run (``jax.distributed.initialize``) and return the process count.

    With the three arguments, this process joins the run whose process 0 listens at
    ``coordinator`` (``"host:port"``, checked first: `parse_coordinator`); without them, JAX's
    own detection decides
    (``JAX_COORDINATOR_ADDRESS``/``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID``, Slurm, Open MPI,
    Kubernetes, Cloud TPU), and outside any cluster the run is one process (returns 1). Call it
    before anything else uses JAX (afterwards, with no arguments, it only reports the count). CPU processes exchange gradients over gloo, GPUs over NCCL,
    TPUs over their interconnect. A process silent for ``heartbeat_timeout`` seconds counts as
    dead, and the coordination service then ends the others with an error (they never hang).

    ``timeout``: seconds to reach the coordinator and for every process to join. A process
    other than 0 first connects to ``coordinator`` itself, retrying until then: unreachable,
    it raises `OptionError` saying so (JAX's own client would wait, then abort the process
    with a message about "another task" dying). Past the connection, JAX's
    ``initialization_timeout`` is the rest of it; the line this prints first says how long.

    >>> from polyexec.training import initialize_distributed
    >>> initialize_distributed()          # no cluster here: one process
    1
    """
    if jax.distributed.is_initialized():
        return jax.process_count()
    if coordinator is None and backends_are_initialized():
        # Too late to join anything (JAX is in use): what this process is, it stays.
        return jax.process_count()
    timeout = check_int(timeout, "initialize_distributed: timeout", min=1)
    deadline = time.monotonic() + timeout
    if coordinator is not None:
        host, port = parse_coordinator(coordinator, "initialize_distributed: coordinator")
        if process_id not in (None, 0):
            _reach(host, port, deadline, timeout, coordinator)
        print(f"jax.distributed: process {process_id} of {num_processes} joining the run at "
              f"{coordinator}; every process must join within {timeout} s, else JAX ends this "
              f"process (DEADLINE_EXCEEDED)", file=sys.stderr,
              flush=True)
    try:
        jax.distributed.initialize(
            coordinator, num_processes, process_id, heartbeat_timeout_seconds=heartbeat_timeout,
            initialization_timeout=max(1, int(deadline - time.monotonic())))
    except ValueError as e:
        if coordinator is None and "coordinator_address should be defined" in str(e):
            return 1        # no flags and no cluster environment: a single process
        raise OptionError(f"jax.distributed: {e}") from e
    except jax.errors.JaxRuntimeError as e:     # process 0 cannot listen there (port taken)
        raise OptionError(f"jax.distributed: coordinator {coordinator!r}: expected an address "
                          f"this process can listen at (process {process_id}), received an "
                          f"error starting it: {str(e).splitlines()[0]}") from e
    return jax.process_count()


def _reach(host: str, port: int, deadline: float, timeout: int, coordinator: str) -> None:
    """Connect to the coordinator's port until ``deadline`` (process 0 may start later than
    this one); an `OptionError` naming the address and the time waited when it never answers."""
    last: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            socket.create_connection((host, port), timeout=min(left, 5.0)).close()
            return
        except OSError as e:
            last = e
        time.sleep(min(0.25, max(deadline - time.monotonic(), 0)))
    why = (last.strerror or str(last)) if last is not None else "no answer"
    raise OptionError(f"coordinator {coordinator}: expected process 0's coordinator listening "
                      f"there, received no connection within {timeout} s ({why}); start process "
                      f"0 with the same coordinator address, check the host and port, or allow "
                      f"longer (the example's --coordinator-timeout, initialize_distributed's "
                      f"timeout)")


def data_parallel(devices: int | Sequence[Any] | None = None) -> DataParallel:
    """Resolve ``devices``: None = every device (all hosts' after ``jax.distributed.initialize``),
    an int = the first n local devices, or a list of devices.

    >>> from polyexec.training import data_parallel
    >>> data_parallel(1).mesh is None
    True
    """
    processes = jax.process_count()
    if processes > 1:
        if devices is not None:
            raise OptionError(f"fit: devices: expected None when running on several processes "
                              f"(jax.distributed: every process's devices join one mesh), "
                              f"received {devices!r}")
        return DataParallel(Mesh(np.array(jax.devices()), (AXIS,)), jax.local_device_count(),
                            processes, jax.process_index())
    local = jax.local_devices()
    if devices is None:
        chosen = local
    elif is_int(devices):
        if not 1 <= devices <= len(local):
            raise OptionError(f"fit: devices: expected an int from 1 to {len(local)} (the local "
                              f"{local[0].platform} devices of this process; on CPU, more "
                              f"devices need XLA_FLAGS=--xla_force_host_platform_device_count=N "
                              f"set before jax is imported), received {devices}")
        chosen = local[:int(devices)]
    elif isinstance(devices, Sequence) and not isinstance(devices, str) and devices:
        chosen = list(devices)
    else:
        raise OptionError(f"fit: devices: expected None, an int or a non-empty list of devices, "
                          f"received {devices!r}")
    if len(chosen) == 1:
        return DataParallel(None, 1)
    return DataParallel(Mesh(np.array(chosen), (AXIS,)), len(chosen))
