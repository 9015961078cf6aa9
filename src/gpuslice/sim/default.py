"""The embedded default scenario: a generated heterogeneous cluster and a task list.

The Alibaba trace cannot ship in the repository, so ``gpuslice simulate`` with no arguments
replays this one: a 56-node cluster of A100-80GB, H100, V100 and T4 nodes, and a task mix shaped
like the trace's (CPU-only tasks, GPU shares of 0.1 to 0.8, whole GPUs and a few multi-GPU
jobs) adding up to about 98% of the cluster's GPUs. It is generated from a fixed seed, so it is
the same on every machine.
"""

from __future__ import annotations

import numpy as np

from gpuslice.core.catalog import resolve
from gpuslice.core.model import Gpu, Node
from gpuslice.core.workload import Tasks

# (model, nodes, GPUs per node, vCPU, memory GiB)
CLUSTER = (
    ("A100-80GB", 16, 8, 96, 768),
    ("H100-SXM", 8, 8, 128, 1024),
    ("V100M32", 12, 8, 96, 384),
    ("T4", 20, 2, 104, 512),
)

# (num_gpu, milli, vCPU choices, share of tasks)
SHAPES = (
    (0, 0, (8, 12.5, 32), 0.13),
    (1, 810, (3.15, 4.15), 0.13),
    (1, 470, (8, 11.9), 0.10),
    (1, 650, (11.9,), 0.03),
    (1, 320, (4, 8), 0.05),
    (1, 230, (4,), 0.02),
    (1, 160, (4,), 0.02),
    (1, 1000, (3.15, 8, 11.3, 11.4, 12, 16, 24.2), 0.50),
    (2, 1000, (16, 24), 0.01),
    (4, 1000, (32, 48), 0.005),
    (8, 1000, (64, 88), 0.005),
)


def default_nodes() -> list[Node]:
    nodes: list[Node] = []
    for model, count, gpus, cpu, mem in CLUSTER:
        mib = resolve(model).memory_mib
        for i in range(count):
            nodes.append(Node(
                name=f"{model.lower()}-{i:02d}",
                cpu_milli=cpu * 1000,
                memory_mib=mem * 1024,
                gpus=tuple(Gpu(j, model, mib) for j in range(gpus)),
            ))
    return nodes


def default_tasks(seed: int = 7, demand_ratio: float = 0.98) -> Tasks:
    """Tasks drawn from :data:`SHAPES` until their GPU demand reaches ``demand_ratio`` of the
    default cluster's GPUs."""
    rng = np.random.default_rng(seed)
    capacity = sum(count * gpus for _, count, gpus, _, _ in CLUSTER) * 1000
    shares = np.array([s[3] for s in SHAPES])
    shares = shares / shares.sum()
    cols: dict[str, list[int]] = {"cpu": [], "mem": [], "num": [], "milli": []}
    demand = 0
    while demand < demand_ratio * capacity:
        num, milli, cpus, _ = SHAPES[int(rng.choice(len(SHAPES), p=shares))]
        cpu = float(cpus[int(rng.integers(len(cpus)))])
        cols["cpu"].append(int(cpu * 1000))
        cols["mem"].append(int(cpu * 1024 * float(rng.choice([2.0, 4.0, 6.0]))))
        cols["num"].append(num)
        cols["milli"].append(milli)
        demand += num * milli
    n = len(cols["cpu"])
    return Tasks(
        np.array(cols["cpu"], dtype=np.int64), np.array(cols["mem"], dtype=np.int64),
        np.array(cols["num"], dtype=np.int64), np.array(cols["milli"], dtype=np.int64),
        np.zeros(n, dtype=np.int64), (frozenset(),),
    )
