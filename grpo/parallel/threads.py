"""torch's CPU threads for each step: the cores that other processes left idle during the previous one.

torch's CPU threads wait for each other at the end of every parallel region, spinning while they wait. When
another CPU-bound process takes one of the cores, every region then waits for the thread that shares a core
with it, while the same step on fewer threads does not. Letting the threads sleep instead of spin
(OMP_WAIT_POLICY, GOMP_SPINCOUNT) slows a quiet machine, so the loop keeps torch's wait policy and changes the
thread count instead (docs/benchmarks.md, "A step beside a CPU-bound neighbour", has the figures):

    others  = (busy CPU time of the machine - this process's CPU time) / wall time, over the last step (cores)
    threads = clamp(round(usable cores - others), 1, the count torch started with)

On a quiet machine `others` is near 0 and nothing changes. Linux (/proc/stat) CPU runs only. The thread count
changes how some sums are split, so a run that changed it agrees with a quiet run to fp32 rounding, not bit
for bit; `--no-adapt-cpu-threads` keeps the count fixed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

PROC_STAT = Path("/proc/stat")


def cpu_times() -> tuple[float, float, float]:
    """(the machine's busy CPU seconds, this process's CPU seconds, wall seconds), now."""
    # /proc/stat's first line: cpu user nice system idle iowait irq softirq steal ... (clock ticks, every core)
    ticks = [int(value) for value in PROC_STAT.read_text().split("\n", 1)[0].split()[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK"), time.process_time(), time.monotonic()


class CpuThreads:
    """Call `adjust()` before each step; it returns the thread count the step runs with."""

    def __init__(self, enabled: bool):
        self.most = torch.get_num_threads()
        self.enabled = enabled and self.most > 1 and PROC_STAT.exists()
        self.last = cpu_times() if self.enabled else None

    def adjust(self) -> int:
        if not self.enabled:
            return torch.get_num_threads()
        now = cpu_times()
        busy, own, wall = (after - before for after, before in zip(now, self.last, strict=True))
        self.last = now
        others = max(busy - own, 0.0) / max(wall, 1e-9)  # cores other processes kept busy
        cores = len(os.sched_getaffinity(0))
        threads = max(1, min(self.most, int(cores - others + 0.5)))
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        return threads
