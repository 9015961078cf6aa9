from __future__ import annotations

import numpy as np
import pytest

from gpuslice.core.errors import ValidationError
from gpuslice.core.fit import explain, feasible, feasible_at, gpu_ok, reject_reasons
from gpuslice.core.model import ClusterSnapshot, Isolation, SliceRequest
from tests.builders import MakeNode, MakeReq

CASES = [
    # name, node, request, fits, reason fragment
    ("share fits a partly used GPU", MakeNode("n").gpus("T4", 2).used(1000, 400),
     MakeReq().share(600), True, None),
    ("share too big for every GPU", MakeNode("n").gpus("T4", 2).used(1000, 600),
     MakeReq().share(600), False, "GPU 1 has 400 milli free, pod needs 600"),
    ("two whole GPUs need two free ones", MakeNode("n").gpus("V100M32", 4).used(1000, 1000, 500),
     MakeReq().gpu(2), False, "1 of 4 GPUs fit, pod needs 2"),
    ("two whole GPUs fit", MakeNode("n").gpus("V100M32", 4).used(1000, 500),
     MakeReq().gpu(2), True, None),
    ("cpu short", MakeNode("n").gpus("T4", 1).cpu(8000, 2000), MakeReq().share(100).cpu(4000),
     False, "2000 milli-CPU free, pod needs 4000"),
    ("memory short", MakeNode("n").gpus("T4", 1).mem(1024), MakeReq().share(100).mem(2048),
     False, "1024 MiB memory free"),
    ("model not allowed", MakeNode("n").gpus("T4", 1), MakeReq().share(100).models("V100M16"),
     False, "pod accepts V100M16"),
    ("model allowed", MakeNode("n").gpus("T4", 1), MakeReq().share(100).models("V100M16", "T4"),
     True, None),
    ("no GPU on a CPU node", MakeNode("n"), MakeReq().share(100), False, "has no GPU"),
    ("CPU-only task on a CPU node", MakeNode("n"), MakeReq().cpu(1000), True, None),
    ("GPU memory short", MakeNode("n").gpus("T4", 1), MakeReq().share(100).gpu_mem(20000),
     False, "MiB free, pod needs 20000"),
    ("memory by share fits", MakeNode("n").gpus("T4", 1).gpu_mem_used(10000),
     MakeReq().share(300).memory_share(), True, None),  # 300 of 15360 MiB: 4608 <= 5360
    ("memory by share short", MakeNode("n").gpus("T4", 1).gpu_mem_used(12000),
     MakeReq().share(300).memory_share(), False, "GPU 0 has 3360 MiB free, pod needs 4608"),
    ("no memory named, none checked (trace replays)",
     MakeNode("n").gpus("T4", 1).gpu_mem_used(15000), MakeReq().share(300), True, None),
    ("MIG needs a MIG-capable model", MakeNode("n").gpus("T4", 1),
     MakeReq().share(300).isolation(Isolation.MIG), False, "cannot provide mig"),
    ("MIG on an A100", MakeNode("n").gpus("A100-80GB", 1),
     MakeReq().share(300).isolation(Isolation.MIG), True, None),
    ("exclusive needs whole GPUs", MakeNode("n").gpus("A100-80GB", 1),
     MakeReq().share(300).isolation(Isolation.EXCLUSIVE), False, "whole GPUs"),
]


@pytest.mark.parametrize(("name", "node", "req", "fits", "reason"), CASES,
                         ids=[c[0] for c in CASES])
def test_fit_table(name: str, node: MakeNode, req: MakeReq, fits: bool, reason: str | None) -> None:
    snap = ClusterSnapshot.of([node.obj()])
    ok = feasible(snap.arrays, req.obj())
    assert bool(ok[0]) is fits
    why = explain(snap.arrays, req.obj(), 0)
    if fits:
        assert why == []
    else:
        assert reason is not None and any(reason in w for w in why), why


def test_reject_reasons_count_nodes_by_first_reason() -> None:
    snap = ClusterSnapshot.of([
        MakeNode("a").gpus("T4", 1).cpu(8000, 0).obj(),
        MakeNode("b").gpus("T4", 1).used(900).obj(),
        MakeNode("c").gpus("V100M16", 1).obj(),
        MakeNode("d").gpus("T4", 1).obj(),
    ])
    req = MakeReq().share(500).cpu(1000).models("T4").obj()
    ok = feasible(snap.arrays, req)
    assert ok.tolist() == [False, False, False, True]
    assert reject_reasons(snap.arrays, req, ok) == {
        "insufficient cpu": 1, "GPU model not allowed": 1,
        "not enough GPUs with the requested share free": 1,
    }


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"gpus": -1}, "gpus"), ({"gpus": 1, "milli": 0}, "milli"),
     ({"gpus": 1, "milli": 1001}, "milli"), ({"gpus": 2, "milli": 500}, "milli"),
     ({"gpus": 0, "milli": 5}, "milli"), ({"cpu_milli": -5}, "cpu_milli")],
)
def test_bad_requests_name_the_field(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        SliceRequest(**kwargs)  # type: ignore[arg-type]


def test_snapshot_rejects_duplicate_node_names() -> None:
    with pytest.raises(ValidationError, match="unique node names"):
        ClusterSnapshot.of([MakeNode("a").obj(), MakeNode("a").obj()])


def test_snapshot_arrays_are_read_only() -> None:
    snap = ClusterSnapshot.of([MakeNode("a").gpus("T4", 2).obj()])
    with pytest.raises(ValueError):
        snap.arrays.gpu_free[0, 0] = 5
    assert np.array_equal(snap.arrays.gpu_free, [[1000, 1000]])


def test_one_node_checks_agree_with_the_whole_cluster_ones() -> None:
    """feasible_at and gpu_ok(node=...) (what a bind uses on the scheduler's one node) give
    the whole-cluster answer for that node: every case of the table, all on one snapshot."""
    from dataclasses import replace

    snap = ClusterSnapshot.of([replace(c[1].obj(), name=f"n{i}") for i, c in enumerate(CASES)])
    for _, _, req, _, _ in CASES:
        r = req.obj()
        whole = feasible(snap.arrays, r)
        slots = gpu_ok(snap.arrays, r)
        for i in range(snap.arrays.n_nodes):
            assert feasible_at(snap.arrays, r, i) == bool(whole[i]), (i, r)
            assert feasible_at(snap.arrays, r, i, node_resources=False) == bool(
                feasible(snap.arrays, r, node_resources=False)[i]), (i, r)
            assert (gpu_ok(snap.arrays, r, i) == slots[i]).all(), (i, r)
