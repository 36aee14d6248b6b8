"""``HostThreads``: how many torch CPU threads a backend runs with, and why (``LLM`` applies it, ``deepinfer env``
shows it).

A device backend names a fixed count (``Backend.host_threads``): its host only builds step layouts and reads
tokens. The CPU backend computes the model on these threads, so it takes one thread per core that is idle when the
engine starts (:func:`cpu_host_threads`): torch splits every op into one chunk per thread and waits for the slowest
chunk, so a thread whose core another process holds waits for a scheduler time slice on every op. On a small model,
whose ops take microseconds, that makes each op as slow as the time slice: on a 2-core machine busy with two other
processes, the tiny model generated 7.5 tokens/s with torch's default 2 threads and 91 with one. ``OMP_NUM_THREADS``
always wins.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from pathlib import Path

OMP_VARIABLE = "OMP_NUM_THREADS"
_CPU_TOPOLOGY = Path("/sys/devices/system/cpu")


@dataclasses.dataclass(frozen=True)
class HostThreads:
    """A torch CPU thread count and the sentence saying why."""

    count: int
    why: str


def cpu_threads_for(physical_cores: int, others_load: float) -> HostThreads:
    """One thread per physical core that other processes leave idle (``others_load``: the runnable processes
    besides this one, averaged over the last minute), at least one."""
    busy = min(physical_cores, max(0, round(others_load)))
    count = max(1, physical_cores - busy)
    why = (f"{physical_cores} physical core(s) usable, about {busy} busy with other processes (1-minute load "
           f"{others_load:.1f}): one thread per idle core, at least 1; {OMP_VARIABLE} overrides")
    return HostThreads(count, why)


@functools.cache
def cpu_host_threads() -> HostThreads:
    """The CPU backend's thread count on this machine, chosen once per process (so every engine of a process
    computes with the same reduction order)."""
    return cpu_threads_for(physical_cores(), others_load())


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (hyperthread siblings count once)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topology = _CPU_TOPOLOGY / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))  # no topology (not Linux, or hidden): a logical CPU counts as a core
    return max(1, len(cores))


def others_load() -> float:
    """The 1-minute load average minus this process's own share of it (it has run for at most a minute, alone)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 0.0
    return max(0.0, load - _own_share_of_load())


def _own_share_of_load() -> float:
    """This process's contribution to the 1-minute average: its CPU time over the last minute, at most 1."""
    return min(1.0, time.process_time() / 60.0)
