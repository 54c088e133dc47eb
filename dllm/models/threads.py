"""How many CPU threads torch runs a model's operations on: the caller's number, else `DLLM_THREADS`, else
`OMP_NUM_THREADS`, else a default by the model's size.

The default: a model under `SMALL_MODEL_PARAMETERS` runs on one thread, since its matrices are too small to
split (a forward of the shipped tiny models takes a few ms on one core, and on a shared machine torch's threads
wait on each other far longer: 21 s instead of 0.2 s for a README example, issue #39); a larger one runs on the
machine's physical cores, hyperthreads counted once.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ..core.checks import check_int
from ..core.errors import DllmError

SMALL_MODEL_PARAMETERS = 10_000_000

SYSFS_CPUS = Path("/sys/devices/system/cpu")


def physical_cores(sysfs: Path = SYSFS_CPUS) -> int:
    """Cores this process may run on, two hyperthreads of one core counted once (Linux: the cores' sibling lists;
    elsewhere the logical CPU count)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            cores.add((sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip())
        except OSError:  # no topology (not Linux, a container without /sys): every logical CPU counts
            return len(cpus)
    return max(1, len(cores))


def default_threads(parameters: int) -> tuple[int, str]:
    """The thread count for a model of `parameters` parameters, and why."""
    if parameters < SMALL_MODEL_PARAMETERS:
        return 1, f"{parameters / 1e6:.3g}M parameters: one thread"
    return physical_cores(), f"{parameters / 1e6:.4g}M parameters: the physical cores"


def _from_env(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise DllmError(f"{name} must be a positive integer, got {value!r}; set it to a thread count or unset it")
    return int(value)


def requested_threads(threads: int | None = None) -> tuple[int, str] | None:
    """The thread count asked for, and by whom: `threads` if given, else DLLM_THREADS, else OMP_NUM_THREADS (torch's
    own variable); None leaves it to `default_threads`. Checked before any work."""
    if threads is not None:
        return check_int("threads", threads, 1), "threads= (--threads)"
    for name in ("DLLM_THREADS", "OMP_NUM_THREADS"):
        count = _from_env(name)
        if count is not None:
            return count, name
    return None


def set_threads(model, requested: tuple[int, str] | None, ranks: int = 1) -> dict[str, int | str]:
    """Set torch's thread count for this process (`torch.set_num_threads`) to the `requested_threads`, else to
    `default_threads` for `model` shared by the `ranks` processes of a tensor-parallel model on one machine;
    returns `{"threads": n, "chosen_by": why}`."""
    count, why = requested or default_threads(model.config.num_parameters())
    if requested is None and ranks > 1:
        count, why = max(1, count // ranks), f"{why}, shared by {ranks} tensor-parallel ranks"
    torch.set_num_threads(count)
    return {"threads": count, "chosen_by": why}
