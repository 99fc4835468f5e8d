"""``--devices N``: the ``pack`` peer and ``polyexec`` split their rows over a Mesh of N devices.

Both use `polyexec.training.data_parallel` -- the one-axis ``Mesh`` named ``"batch"`` that
`polyexec.training.fit` builds for ``devices=N``: parameters replicated (``P()``), a batch's
rows split along the batch axis (``P("batch")``), every device holding whole rows (so the rows
of a batch are a multiple of N: ``--batch-size`` must be). On CPU, N devices need
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before JAX creates its backends: the
orchestrating process never uses JAX's devices, and it starts every worker with that flag
(`worker_xla_flags`); a worker checks it has the devices (`data_parallel_for`).

>>> worker_xla_flags(2, "")
'--xla_force_host_platform_device_count=2'
>>> worker_xla_flags(2, "--xla_cpu_use_thunk_runtime=false --xla_force_host_platform_device_count=1")
'--xla_cpu_use_thunk_runtime=false --xla_force_host_platform_device_count=2'
>>> worker_xla_flags(2, "--xla_force_host_platform_device_count=8")   # already enough
'--xla_force_host_platform_device_count=8'
"""

from __future__ import annotations

import re
from typing import Any

import equinox as eqx
import jax

import polyexec as px
from polyexec.training import DataParallel, data_parallel

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def worker_xla_flags(devices: int, flags: str) -> str:
    """``XLA_FLAGS`` for a worker of a ``--devices`` run: ``flags`` with the host platform's
    device count at least ``devices`` (it only affects the CPU platform; a GPU or TPU run
    uses its own devices)."""
    pattern = re.compile(re.escape(DEVICE_COUNT_FLAG) + r"=(\d+)")
    found = pattern.search(flags)
    if found is not None and int(found.group(1)) >= devices:
        return flags
    wanted = f"{DEVICE_COUNT_FLAG}={devices}"
    if found is not None:
        return pattern.sub(wanted, flags)
    return f"{flags} {wanted}".strip()


def data_parallel_for(devices: int) -> DataParallel:
    """The run's `DataParallel` over the first ``devices`` local devices (``mesh`` None for
    one), or a clear error when this process has fewer."""
    have = jax.local_devices()
    if len(have) < devices:
        raise px.OptionError(
            f"--devices {devices}: expected {devices} local devices, received {len(have)} "
            f"({have[0].platform}); on CPU set XLA_FLAGS={DEVICE_COUNT_FLAG}={devices} before "
            f"JAX initialises its backends (polyexec-bench sets it for its worker processes; "
            f"an XLA_FLAGS of this process's own that JAX read first wins)")
    return data_parallel(devices)


def place(tree: Any, sharding: Any) -> Any:
    """Every array leaf of ``tree`` on ``sharding`` (None: unchanged); static leaves stay."""
    if sharding is None:
        return tree
    return jax.tree_util.tree_map(
        lambda x: jax.device_put(x, sharding) if eqx.is_array(x) else x, tree)
