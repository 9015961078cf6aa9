"""CPU time of a process and of its threads, from Linux /proc (for cluster_scale.py's CPU per
pod), and the names of a Python process's threads from ``py-spy dump``."""

from __future__ import annotations

import os
import re
import subprocess
from collections import defaultdict
from pathlib import Path


def cpu_split(pid: int) -> tuple[float, float]:
    """User and system CPU time of a process so far (Linux /proc/<pid>/stat, fields 14 and
    15, in clock ticks); 0 where it cannot be read."""
    return cpu_split_path(Path(f"/proc/{pid}/stat"))


def cpu_split_path(stat: Path) -> tuple[float, float]:
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (:func:`cpu_split`)."""
    return sum(cpu_split(pid))


def thread_cpu(pid: int) -> dict[int, float]:
    """User + system CPU seconds so far of each of a process's threads (by native id)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        t = cpu_split_path(task / "stat")
        out[int(task.name)] = t[0] + t[1]
    return out


def thread_names(pid: int) -> dict[int, str]:
    """Native thread id -> the Python thread's name, without its pool index (``bind_3`` ->
    ``bind``), from ``py-spy dump``; empty when py-spy cannot attach."""
    try:
        text = subprocess.run(["py-spy", "dump", "--pid", str(pid), "--nonblocking"],
                              check=False, capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    names = {}
    for m in re.finditer(r'^Thread (\d+) \([a-z]+\): "([^"]*)"', text, re.M):
        names[int(m.group(1))] = re.sub(r"_\d+$", "", m.group(2))
    return names


def by_thread(before: dict[int, float], after: dict[int, float], names: dict[int, str],
              pods: int) -> dict[str, float]:
    """CPU ms per pod of each thread kind over a window (threads py-spy did not name, ended
    ones included, as "other")."""
    out: dict[str, float] = defaultdict(float)
    for tid, t in after.items():
        out[names.get(tid, "other")] += 1e3 * (t - before.get(tid, 0.0)) / pods
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
