from __future__ import annotations

import numpy as np
import pytest

from gpuslice.core.errors import ValidationError
from gpuslice.core.fit import feasible
from gpuslice.core.frag import Shape, TargetWorkload
from gpuslice.core.model import ClusterSnapshot, SliceRequest
from gpuslice.core.policies import (
    REGISTRY,
    PlacementState,
    best_fit_gpu,
    choose,
    exclusive_gpus,
    make_policy,
    place,
    policy_names,
)
from tests.builders import MakeNode, MakeReq

TW = TargetWorkload.of(
    [Shape(4000, 1, 500), Shape(8000, 1, 1000), Shape(4000, 0, 0)], [0.4, 0.4, 0.2]
)


def decide(policy: str, nodes: list[MakeNode], req: MakeReq,
           seed: int = 0) -> tuple[str, tuple[int, ...]]:
    snap = ClusterSnapshot.of([n.obj() for n in nodes])
    d = place(snap, req.obj(), policy, np.random.default_rng(seed), TW)
    assert d.placement is not None, d.message()
    return d.placement.node, d.placement.gpu_indices


# name, policy, nodes, request, expected node, expected GPUs
CASES = [
    ("bestfit picks the node left fullest", "bestfit",
     [MakeNode("big").gpus("T4", 4), MakeNode("small").gpus("T4", 2)], MakeReq().gpu(1).cpu(1000),
     "small", (0,)),
    ("bestfit picks the tightest GPU inside", "bestfit",
     [MakeNode("n").gpus("T4", 3).used(200, 600, 0)], MakeReq().share(300), "n", (1,)),
    ("dotprod picks the smallest dot product", "dotprod",
     [MakeNode("idle").gpus("T4", 4), MakeNode("busy").gpus("T4", 4).used(1000, 1000)],
     MakeReq().gpu(1).cpu(1000), "busy", (2,)),
    ("gpu-packing prefers a partly used GPU", "gpu-packing",
     [MakeNode("empty").gpus("T4", 2), MakeNode("part").gpus("T4", 2).used(1000, 500)],
     MakeReq().share(400), "part", (1,)),
    ("gpu-packing puts whole GPUs on used nodes", "gpu-packing",
     [MakeNode("empty").gpus("T4", 2), MakeNode("used").gpus("T4", 2).used(300)],
     MakeReq().gpu(1), "used", (1,)),
    ("fgd fills a leftover that fits exactly", "fgd",
     [MakeNode("empty").gpus("T4", 2).cpu(64000),
      MakeNode("part").gpus("T4", 2).used(500).cpu(64000)],
     MakeReq().share(500).cpu(1000), "part", (0,)),
    ("ours sends a CPU-heavy task to the CPU-rich node", "ours",
     [MakeNode("poor").gpus("T4", 4).cpu(40000), MakeNode("rich").gpus("T4", 4).cpu(128000)],
     MakeReq().gpu(1).cpu(20000), "rich", (0,)),
    ("ours keeps off a model that constrained tasks need", "ours",
     [MakeNode("p100").gpus("P100", 4).cpu(64000), MakeNode("t4").gpus("T4", 4).cpu(64000)],
     MakeReq().gpu(1).cpu(4000), "t4", (0,)),
]


@pytest.mark.parametrize(("name", "policy", "nodes", "req", "node", "gpus"), CASES,
                         ids=[c[0] for c in CASES])
def test_policy_choices(name: str, policy: str, nodes: list[MakeNode], req: MakeReq, node: str,
                        gpus: tuple[int, ...]) -> None:
    # the expected node must win on score, not by a lucky tie-break: every seed agrees
    tw = TW
    if "constrained" in name:
        tw = TargetWorkload.of([Shape(4000, 1, 1000), Shape(4000, 1, 1000, frozenset({"P100"}))],
                               [0.5, 0.5])
    snap = ClusterSnapshot.of([n.obj() for n in nodes])
    for seed in range(8):
        d = place(snap, req.obj(), policy, np.random.default_rng(seed), tw)
        assert d.placement is not None
        assert (d.placement.node, d.placement.gpu_indices) == (node, gpus)


def test_gpu_clustering_keeps_classes_together() -> None:
    snap = ClusterSnapshot.of([MakeNode("a").gpus("T4", 4).obj(),
                               MakeNode("b").gpus("T4", 4).obj()])
    st = PlacementState.build(snap.arrays.copy(), None)
    st.affinity[1, 0] = 2  # node b holds two shared-GPU tasks
    req = MakeReq().share(300).obj()
    pol = make_policy("gpu-clustering")
    got = choose(pol, st, req, feasible(st.arrays, req), np.random.default_rng(0))
    assert got is not None and got.node == 1
    whole = MakeReq().gpu(1).obj()
    got = choose(pol, st, whole, feasible(st.arrays, whole), np.random.default_rng(0))
    assert got is not None and got.node == 0  # an empty node beats one holding another class


def test_random_policy_reaches_every_feasible_node() -> None:
    nodes = [MakeNode(f"n{i}").gpus("T4", 1) for i in range(4)] + \
        [MakeNode("full").gpus("T4", 1).used(1000)]
    seen = {decide("random", nodes, MakeReq().share(500), seed=s)[0] for s in range(60)}
    assert seen == {"n0", "n1", "n2", "n3"}


def test_ties_go_to_the_lowest_rank() -> None:
    snap = ClusterSnapshot.of([MakeNode(f"n{i}").gpus("T4", 2).obj() for i in range(3)])
    st = PlacementState.build(snap.arrays.copy(), TW)
    req = MakeReq().gpu(1).obj()
    rank = np.array([2, 0, 1])
    got = choose(make_policy("fgd"), st, req, feasible(st.arrays, req), np.random.default_rng(0),
                 rank)
    assert got is not None and got.node == 1


def test_no_feasible_node_gives_a_decision_with_reasons() -> None:
    snap = ClusterSnapshot.of([MakeNode("a").gpus("T4", 1).used(800).obj(),
                               MakeNode("b").gpus("T4", 1).cpu(1000, 0).obj()])
    d = place(snap, MakeReq().share(500).cpu(500).obj(), "bestfit", np.random.default_rng(0))
    assert not d.ok
    assert d.reasons == {"insufficient cpu": 1, "not enough GPUs with the requested share free": 1}
    assert "0 feasible nodes" in d.message()


def test_gpu_selection_helpers() -> None:
    arrays = ClusterSnapshot.of([MakeNode("n").gpus("T4", 4).used(0, 1000, 500, 500).obj()]).arrays
    assert exclusive_gpus(arrays, MakeReq().gpu(1).obj(), 0) == (0,)
    assert best_fit_gpu(arrays, MakeReq().share(400).obj(), 0) == (2,)


def test_registry_and_alias() -> None:
    assert {"random", "dotprod", "gpu-clustering", "gpu-packing", "bestfit", "fgd"} <= set(REGISTRY)
    assert "ours" in policy_names()
    assert make_policy("ours").name == make_policy("frag-strand").name
    with pytest.raises(ValidationError, match="policy"):
        make_policy("nope")


def test_frag_policies_need_a_workload() -> None:
    snap = ClusterSnapshot.of([MakeNode("a").gpus("T4", 1).obj()])
    with pytest.raises(ValidationError, match="workload"):
        place(snap, MakeReq().share(100).obj(), "fgd", np.random.default_rng(0))


def test_random_policy_ignores_the_tie_order() -> None:
    snap = ClusterSnapshot.of([MakeNode(f"n{i}").gpus("T4", 1).obj() for i in range(4)])
    st = PlacementState.build(snap.arrays.copy(), None)
    req = MakeReq().share(100).obj()
    rank = np.arange(4)
    picks = {choose(make_policy("random"), st, req, feasible(st.arrays, req),
                    np.random.default_rng(s), rank).node for s in range(40)}  # type: ignore[union-attr]
    assert picks == {0, 1, 2, 3}


@pytest.mark.parametrize("policy", ["fgd", "frag-strand"])
def test_score_cache_equals_fresh_scores_and_rescores_only_changed_rows(policy: str) -> None:
    from gpuslice.core.scorecache import ScoreCache

    pol = make_policy(policy)
    assert ScoreCache.usable(pol) and not ScoreCache.usable(make_policy("random"))
    snap = ClusterSnapshot.of([MakeNode(f"n{i}").gpus("A100-80GB", 4).used(100 * (i % 5))
                               .obj() for i in range(12)])
    st = PlacementState.build(snap.arrays.copy(), TW)
    cache = ScoreCache(pol, st)
    rng = np.random.default_rng(3)
    nodes = np.arange(12, dtype=np.int64)
    shapes = [MakeReq().share(250).obj(), MakeReq().share(500).obj(), MakeReq().gpu(1).obj()]
    for step in range(40):
        req = shapes[step % 3]
        asked = rng.permutation(nodes)[: 6 + step % 6]
        got, want = cache.score(req, asked), pol.score(st, req, asked)
        assert np.array_equal(got.scores, want.scores)
        assert (got.gpu is None) == (want.gpu is None)
        if want.gpu is not None:
            assert got.gpu is not None and np.array_equal(got.gpu, want.gpu)
        row = int(rng.integers(12))  # one node changes, as a bind does
        before = cache.scored
        st.arrays.gpu_free[row, int(rng.integers(4))] = int(rng.integers(0, 11)) * 100
        st.refresh(row)
        cache.changed(row)
        again = cache.score(req, np.array([row, *asked], dtype=np.int64))
        assert cache.scored == before + 1  # the changed row alone was scored again
        assert np.array_equal(again.scores, pol.score(
            st, req, np.array([row, *asked], dtype=np.int64)).scores)


@pytest.mark.parametrize("policy", ["fgd", "frag-strand"])
def test_cached_choice_is_the_policys_choice_over_the_fitting_nodes(policy: str) -> None:
    """ScoreCache.choose against the uncached rule (feasible GPUs, the policy's highest
    score, ties to the lowest rank), as nodes fill up and free again one row at a time; some
    shapes fit nowhere at times, and other models' nodes never fit a model-bound shape."""
    from gpuslice.core.policies import tie_order
    from gpuslice.core.scorecache import ScoreCache

    pol = make_policy(policy)
    snap = ClusterSnapshot.of(
        [MakeNode(f"n{i}").gpus("A100-80GB" if i % 3 else "T4", 4).used(100 * (i % 7)).obj()
         for i in range(15)])
    st = PlacementState.build(snap.arrays.copy(), TW)
    cache = ScoreCache(pol, st)
    rank = tie_order([f"n{i}" for i in range(15)])
    rng = np.random.default_rng(5)
    shapes = [MakeReq().share(250).obj(), MakeReq().share(700).obj(), MakeReq().gpu(4).obj(),
              MakeReq().share(500).models("T4").obj()]
    def uncached(req: SliceRequest, rows: np.ndarray) -> int | None:
        """The rule: among ``rows`` whose GPUs fit, the highest score, ties to the lowest rank."""
        cand = rows[feasible(st.arrays, req, node_resources=False)[rows]]
        if not cand.size:
            return None
        raw = pol.score(st, req, cand).scores
        top = np.flatnonzero(raw == raw.max())
        return int(cand[top[np.argmin(rank[cand[top]])]])

    nones = 0
    for step in range(120):
        req = shapes[step % len(shapes)]
        asked = rng.permutation(15)[: 5 + step % 10].astype(np.int64)
        want = uncached(req, asked)
        at = cache.choose(req, asked, rank)
        assert (None if at is None else int(asked[at])) == want, step
        # every row (nodes=None): the position is the row
        assert cache.choose(req, None, rank) == uncached(req, np.arange(15)), step
        nones += want is None
        row = int(rng.integers(15))  # one node's GPU takes or gives back a share
        st.arrays.gpu_free[row, int(rng.integers(4))] = int(rng.integers(0, 11)) * 100
        st.refresh(row)
        cache.changed(row)
    assert 0 < nones < 120  # both answers were exercised


def _a100(name: str, gpus_used: int = 0, cpu_used: int = 0) -> MakeNode:
    return MakeNode(name).gpus("A100-80GB", 8).used(*[1000] * gpus_used) \
        .cpu(96_000, 96_000 - cpu_used).mem(768 * 1024)


def test_frag_strand_spreads_only_where_the_cpu_runs_out_first() -> None:
    """Two identical nodes, one half used. A whole-GPU task changes neither node's
    fragmentation (the workload has only one-GPU shapes). While the GPUs run out first the
    policy's scores are exactly the packing ones (a tie: the fixed node order decides); where
    the workload needs half again as much CPU as the cluster has, kube-scheduler's spreading
    scores decide among them: the emptier node, whatever the node order."""
    from gpuslice.core.policies import FragStrandPolicy

    snap = ClusterSnapshot.of([_a100("used", 4, 48_000).obj(), _a100("empty").obj()])
    req = MakeReq().gpu(1).cpu(8_000).mem(16 * 1024).obj()
    light = TargetWorkload.of([Shape(8_000, 1, 1000), Shape(4_000, 1, 500)], [0.5, 0.5])
    heavy = TargetWorkload.of([Shape(8_000, 1, 1000), Shape(4_000, 1, 500), Shape(40_000, 0, 0)],
                              [0.4, 0.4, 0.2])
    pol, packing = FragStrandPolicy(), FragStrandPolicy(spread=0)
    nodes = np.arange(2, dtype=np.int64)
    for rank in (np.array([0, 1]), np.array([1, 0])):
        st = PlacementState.build(snap.arrays.copy(), light)
        assert pol.band(st) == 0
        assert np.array_equal(pol.score(st, req, nodes).scores,
                              packing.score(st, req, nodes).scores)
        got = choose(pol, st, req, feasible(st.arrays, req), np.random.default_rng(0), rank)
        assert got is not None and got.node == int(np.argmin(rank))
        st = PlacementState.build(snap.arrays.copy(), heavy)
        assert st.demand[0] > 1.5 and pol.band(st) == 1000.0
        got = choose(pol, st, req, feasible(st.arrays, req), np.random.default_rng(0), rank)
        assert got is not None and snap.arrays.names[got.node] == "empty"


def test_frag_strand_spreads_only_on_a_measured_workload_that_says_so() -> None:
    """The same CPU-heavy mix, learned from few pods, is not told from noise: the band opens
    as the count of pods it was measured from grows."""
    from gpuslice.core.policies import FragStrandPolicy

    snap = ClusterSnapshot.of([_a100("a").obj(), _a100("b").obj()])
    shapes = [Shape(8_000, 1, 1000), Shape(2_000, 1, 200), Shape(32_000, 0, 0)]
    pol, bands = FragStrandPolicy(), []
    for observed in (5, 50, 5000):
        tw = TargetWorkload.of(shapes, [0.5, 0.3, 0.2], observed=observed)
        bands.append(pol.band(PlacementState.build(snap.arrays.copy(), tw)))
    assert bands[0] == 0 < bands[1] < bands[2] == 1000.0
    with pytest.raises(ValidationError):
        FragStrandPolicy(spread=-1)
    with pytest.raises(ValidationError):
        FragStrandPolicy(bound_ramp=0)
