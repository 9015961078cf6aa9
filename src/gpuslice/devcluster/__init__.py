"""A real Kubernetes control plane on loopback for the cluster test tier and for trying gpuslice
against the official components (:mod:`.cluster`), kwok nodes (:mod:`.nodes`), and a real node:
containerd and the kubelet on this host (:mod:`.realnode`, :mod:`.host`).

Not imported by the rest of gpuslice; tests use it through fixtures, people through
``gpuslice dev-cluster``.
"""

from gpuslice.devcluster.cluster import (
    BINARIES,
    KWOK_STAGES,
    SCHEDULER_NAME,
    SERVICE_CIDR,
    DevCluster,
    find_bin_dir,
    missing_binaries,
    scheduler_config,
)
from gpuslice.devcluster.nodes import (
    INVENTORY_ANNOTATION,
    KWOK_NODE_ANNOTATION,
    gpu_node,
    kwok_node,
)
from gpuslice.devcluster.procs import (
    FEATURE_GATES,
    Pki,
    Proc,
    free_port,
    http_get,
    insecure,
    wait_until,
)

__all__ = ["BINARIES", "FEATURE_GATES", "INVENTORY_ANNOTATION", "KWOK_NODE_ANNOTATION",
           "KWOK_STAGES", "SCHEDULER_NAME", "SERVICE_CIDR", "DevCluster", "Pki", "Proc",
           "find_bin_dir", "free_port", "gpu_node", "http_get", "insecure", "kwok_node",
           "missing_binaries", "scheduler_config", "wait_until"]
