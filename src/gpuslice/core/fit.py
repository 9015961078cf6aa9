"""Fit: can a node take a request, and if not, why.

:func:`feasible` answers for every node at once (vectorised); :func:`explain` says in words why
one node does not fit ("GPU 3 has 400 milli free, pod needs 600"); :func:`reject_reasons`
counts the nodes per first reason, as kube-scheduler's "0/N nodes are available" does.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from gpuslice.core import catalog
from gpuslice.core.model import BoolArray, ClusterArrays, IntArray, Isolation, SliceRequest

REASON_CPU = "insufficient cpu"
REASON_MEMORY = "insufficient memory"
REASON_NO_GPU = "no GPU on node"
REASON_MODEL = "GPU model not allowed"
REASON_ISOLATION = "GPU model cannot provide the isolation"
REASON_GPU = "not enough GPUs with the requested share free"


def _isolation_models(arrays: ClusterArrays, isolation: Isolation,
                      rows: IntArray | None = None) -> BoolArray:
    mid = arrays.model_id if rows is None else arrays.model_id[rows]
    if isolation in (Isolation.ANY, Isolation.TIMESLICE, Isolation.EXCLUSIVE):
        return np.ones(len(mid), dtype=np.bool_)
    ok_ids = []
    for i, name in enumerate(arrays.models):
        m = catalog.lookup(name)
        if m is None:
            continue
        if (isolation is Isolation.MIG and m.mig_capable) or (
            isolation is Isolation.MPS and m.mps
        ):
            ok_ids.append(i)
    return np.isin(mid, ok_ids)


def gpu_ok(arrays: ClusterArrays, req: SliceRequest,
           node: int | IntArray | None = None) -> BoolArray:
    """Per node and GPU slot: can this GPU give the request its share (milli and memory)?
    With ``node``, that node's GPU slots alone, or those of an array of nodes (the same rule
    on those rows, without computing every other node's)."""
    rows = slice(None) if node is None else node
    ok = arrays.gpu_present[rows] & (arrays.gpu_free[rows] >= req.milli)
    if req.gpu_memory_mib > 0:
        ok &= arrays.gpu_mem_free[rows] >= req.gpu_memory_mib
    elif req.memory_share:  # milli/1000 of each GPU's own memory
        ok &= arrays.gpu_mem_free[rows] >= req.milli * arrays.gpu_mem_cap[rows] // 1000
    return np.asarray(ok)


def feasible(arrays: ClusterArrays, req: SliceRequest, *, node_resources: bool = True,
             rows: IntArray | None = None) -> BoolArray:
    """Nodes on which ``req`` fits now (CPU, memory, GPU model, per-GPU share and memory).
    Without ``node_resources``, the GPUs alone are judged (the extender leaves CPU and
    memory to kube-scheduler's own fit, whose view is authoritative). With ``rows``, the
    answer for those nodes alone (in their order), by the same rule."""
    sel = slice(None) if rows is None else rows
    ok = np.ones(arrays.n_nodes if rows is None else len(rows), dtype=np.bool_)
    if node_resources:
        ok &= (arrays.cpu_free[sel] >= req.cpu_milli) & (arrays.mem_free[sel] >= req.memory_mib)
    if req.gpus == 0:
        return np.asarray(ok)
    ok &= arrays.model_mask(req.models, rows)
    if req.isolation is not Isolation.ANY:
        ok &= _isolation_models(arrays, req.isolation, rows)
        if req.isolation is Isolation.EXCLUSIVE:
            ok &= req.milli == 1000
    ok &= gpu_ok(arrays, req, None if rows is None else rows).sum(axis=1) >= req.gpus
    return np.asarray(ok)


def feasible_at(arrays: ClusterArrays, req: SliceRequest, node: int, *,
                node_resources: bool = True) -> bool:
    """:func:`feasible` for one node, without judging every other node (a bind places its
    pod on the one node kube-scheduler chose)."""
    if node_resources and (arrays.cpu_free[node] < req.cpu_milli
                           or arrays.mem_free[node] < req.memory_mib):
        return False
    if req.gpus == 0:
        return True
    model = int(arrays.model_id[node])
    if model < 0 or (req.models and arrays.models[model] not in req.models):
        return False
    if req.isolation is not Isolation.ANY:
        if req.isolation is Isolation.EXCLUSIVE and req.milli != 1000:
            return False
        if req.isolation in (Isolation.MIG, Isolation.MPS):
            m = catalog.lookup(arrays.models[model])
            if m is None or not (m.mig_capable if req.isolation is Isolation.MIG else m.mps):
                return False
    return int(gpu_ok(arrays, req, node).sum()) >= req.gpus


def explain(arrays: ClusterArrays, req: SliceRequest, node: int) -> list[str]:
    """Why ``req`` does not fit on node ``node``, one sentence per reason (empty: it fits)."""
    out: list[str] = []
    name = arrays.names[node]
    cpu_free = int(arrays.cpu_free[node])
    if cpu_free < req.cpu_milli:
        out.append(f"node {name} has {cpu_free} milli-CPU free, pod needs {req.cpu_milli}")
    mem_free = int(arrays.mem_free[node])
    if mem_free < req.memory_mib:
        out.append(f"node {name} has {mem_free} MiB memory free, pod needs {req.memory_mib}")
    if req.gpus == 0:
        return out
    mid = int(arrays.model_id[node])
    if mid < 0:
        out.append(f"node {name} has no GPU, pod needs {req.gpus}")
        return out
    model = arrays.models[mid]
    if req.models and model not in req.models:
        allowed = "|".join(sorted(req.models))
        out.append(f"node {name} has {model} GPUs, pod accepts {allowed}")
    if req.isolation is not Isolation.ANY and not _isolation_models(arrays, req.isolation)[node]:
        out.append(f"node {name}: {model} cannot provide {req.isolation.value} isolation")
    if req.isolation is Isolation.EXCLUSIVE and req.milli != 1000:
        out.append(f"exclusive isolation needs whole GPUs, pod asks {req.milli} milli")
    fits = gpu_ok(arrays, req)[node]
    if int(fits.sum()) < req.gpus:
        count = int(arrays.gpu_count[node])
        for j in range(count):
            if fits[j]:
                continue
            free = int(arrays.gpu_free[node, j])
            if free < req.milli:
                out.append(f"GPU {j} has {free} milli free, pod needs {req.milli}")
            else:
                mem = int(arrays.gpu_mem_free[node, j])
                need = req.memory_on(int(arrays.gpu_mem_cap[node, j]))
                out.append(f"GPU {j} has {mem} MiB free, pod needs {need}")
        out.append(f"{int(fits.sum())} of {count} GPUs fit, pod needs {req.gpus}")
    return out


def reject_reasons(arrays: ClusterArrays, req: SliceRequest, ok: BoolArray) -> dict[str, int]:
    """Count the nodes that ``ok`` rejects by their first reason."""
    reasons: Counter[str] = Counter()
    rejected = ~ok
    cpu = arrays.cpu_free < req.cpu_milli
    mem = arrays.mem_free < req.memory_mib
    left = rejected.copy()
    for label, mask in ((REASON_CPU, cpu), (REASON_MEMORY, mem)):
        hit = left & mask
        if hit.any():
            reasons[label] += int(hit.sum())
        left &= ~mask
    if req.gpus > 0:
        stages = (
            (REASON_NO_GPU, arrays.model_id < 0),
            (REASON_MODEL, ~arrays.model_mask(req.models)),
            (REASON_ISOLATION, ~_isolation_models(arrays, req.isolation)),
        )
        for label, mask in stages:
            hit = left & mask
            if hit.any():
                reasons[label] += int(hit.sum())
            left &= ~mask
        if left.any():
            reasons[REASON_GPU] += int(left.sum())
    return dict(reasons)
