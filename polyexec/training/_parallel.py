"""Data parallelism over local devices (and over hosts) with ``jax.sharding``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .._errors import OptionError, is_int
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


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *, heartbeat_timeout: int = 100) -> int:
    """Join a multi-process run (``jax.distributed.initialize``) and return the process count.

    With the three arguments, this process joins the run whose process 0 listens at
    ``coordinator`` (``"host:port"``); without them, JAX's own detection decides
    (``JAX_COORDINATOR_ADDRESS``/``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID``, Slurm, Open MPI,
    Kubernetes, Cloud TPU), and outside any cluster the run is one process (returns 1). Call it
    before anything else uses JAX (afterwards, with no arguments, it only reports the count). CPU processes exchange gradients over gloo, GPUs over NCCL,
    TPUs over their interconnect. A process silent for ``heartbeat_timeout`` seconds counts as
    dead, and the coordination service then ends the others with an error (they never hang).

    >>> from polyexec.training import initialize_distributed
    >>> initialize_distributed()          # no cluster here: one process
    1
    """
    if jax.distributed.is_initialized():
        return jax.process_count()
    if coordinator is None and backends_are_initialized():
        # Too late to join anything (JAX is in use): what this process is, it stays.
        return jax.process_count()
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id,
                                   heartbeat_timeout_seconds=heartbeat_timeout)
    except ValueError as e:
        if coordinator is None and "coordinator_address should be defined" in str(e):
            return 1        # no flags and no cluster environment: a single process
        raise OptionError(f"jax.distributed: {e}") from e
    return jax.process_count()


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
