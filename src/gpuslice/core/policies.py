"""Placement policies: score the feasible nodes, pick the best, choose GPUs inside it.

Each policy scores every feasible node at once (numpy, no loop over nodes) and says which GPUs
it would use there. The node with the highest score wins; ties are broken uniformly at random
with the generator passed in, as kube-scheduler's ``selectHost`` does. The six published policies
follow the FGD simulator (``shared/reference/fgd-protocol.md``) including its integer scores;
``frag-strand`` (alias ``ours``) is our own (see :class:`FragStrandPolicy`).

Policies live in :data:`REGISTRY` (name -> factory), validated when they are built.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gpuslice.core import placement_state as _state
from gpuslice.core.dra_default import default_scores, spread_scores
from gpuslice.core.errors import ValidationError
from gpuslice.core.fit import feasible, gpu_ok, reject_reasons
from gpuslice.core.frag import TargetWorkload, shape_frag
from gpuslice.core.model import (
    MILLI,
    BoolArray,
    ClusterArrays,
    ClusterSnapshot,
    Decision,
    FloatArray,
    IntArray,
    Placement,
    SliceRequest,
)
from gpuslice.core.placement_state import tables_of as _tables
from gpuslice.core.placement_state import workload_of as _workload

# the state the policies score, and the task classes of gpu-clustering: defined in
# core.placement_state, imported from here by the owners of a state
PlacementState = _state.PlacementState
task_tag = _state.task_tag

MAX_SPEC_CPU = 128_000
MAX_SPEC_GPU = 8_000


@dataclass(frozen=True, slots=True)
class Scored:
    """Scores of candidate nodes (aligned with ``nodes``) and, where the policy chose them while
    scoring, the GPU per node (``-1``: use the policy's GPU selection)."""

    nodes: IntArray
    scores: FloatArray
    gpu: IntArray | None = None


class Policy(Protocol):
    name: str
    needs_workload: bool
    uniform_ties: bool

    def score(self, st: PlacementState, req: SliceRequest, nodes: IntArray) -> Scored: ...

    def choose_gpus(self, st: PlacementState, req: SliceRequest, node: int,
                    rng: np.random.Generator) -> tuple[int, ...]: ...


# ---- GPU selection inside a node -----------------------------------------------------------


def exclusive_gpus(arrays: ClusterArrays, req: SliceRequest, node: int) -> tuple[int, ...]:
    """Whole GPUs: the first fully free ones by index."""
    free = np.flatnonzero(arrays.gpu_present[node] & (arrays.gpu_free[node] == MILLI))
    return tuple(int(i) for i in free[: req.gpus])


def best_fit_gpu(arrays: ClusterArrays, req: SliceRequest, node: int) -> tuple[int, ...]:
    """A share: the fitting GPU with the least free milli (lowest index on ties)."""
    if not req.is_sharing:
        return exclusive_gpus(arrays, req, node)
    ok = gpu_ok(arrays, req, node)
    left = np.where(ok, arrays.gpu_free[node], np.iinfo(np.int64).max)
    return (int(np.argmin(left)),)


def random_gpu(arrays: ClusterArrays, req: SliceRequest, node: int,
               rng: np.random.Generator) -> tuple[int, ...]:
    if not req.is_sharing:
        return exclusive_gpus(arrays, req, node)
    ok = np.flatnonzero(gpu_ok(arrays, req, node))
    return (int(ok[int(rng.integers(len(ok)))]),)


def _trunc(x: FloatArray) -> FloatArray:
    return np.asarray(np.trunc(x), dtype=np.float64)


# ---- the published policies ----------------------------------------------------------------


class _BestFitGpuMixin:
    uniform_ties = False

    def choose_gpus(self, st: PlacementState, req: SliceRequest, node: int,
                    rng: np.random.Generator) -> tuple[int, ...]:
        return best_fit_gpu(st.arrays, req, node)


class RandomPolicy:
    """Uniformly random feasible node, random fitting GPU (every node ties, and its ties are
    always drawn uniformly, never by a fixed node order)."""

    name = "random"
    needs_workload = False
    uniform_ties = True

    def score(self, st: PlacementState, req: SliceRequest, nodes: IntArray) -> Scored:
        return Scored(nodes, np.zeros(len(nodes)))

    def choose_gpus(self, st: PlacementState, req: SliceRequest, node: int,
                    rng: np.random.Generator) -> tuple[int, ...]:
        return random_gpu(st.arrays, req, node, rng)


class DotProductPolicy(_BestFitGpuMixin):
    """Tetris-like: the smallest dot product of free resources and request (both normalised
    by the largest node) wins, which packs."""

    name = "dotprod"
    needs_workload = False

    def score(self, st: PlacementState, req: SliceRequest, nodes: IntArray) -> Scored:
        a = st.arrays
        cpu = a.cpu_free[nodes] / MAX_SPEC_CPU
        gpu = a.gpu_free[nodes].sum(axis=1) / MAX_SPEC_GPU
        dot = cpu * (req.cpu_milli / MAX_SPEC_CPU) + gpu * (req.total_milli / MAX_SPEC_GPU)
        return Scored(nodes, _trunc(100.0 * (1.0 - dot / 2.0)))


class GpuClusteringPolicy(_BestFitGpuMixin):
    """Keep tasks of one class (shared, k whole GPUs) together; fuller nodes first."""

    name = "gpu-clustering"
    needs_workload = False

    def score(self, st: PlacementState, req: SliceRequest, nodes: IntArray) -> Scored:
        tag = task_tag(req)
        if tag < 0:
            return Scored(nodes, np.zeros(len(nodes)))
        left = st.arrays.gpu_free[nodes].sum(axis=1)
        base = (25 * (MAX_SPEC_GPU - left)) // MAX_SPEC_GPU
        aff = st.affinity[nodes]
        kinds = (aff > 0).sum(axis=1)
        has = aff[:, tag] > 0 if tag < aff.shape[1] else np.zeros(len(nodes), dtype=np.bool_)
        bonus = np.where(has, np.where(kinds == 1, 75, 50), np.where(kinds == 0, 25, 0))
        return Scored(nodes, np.asarray(base + bonus, dtype=np.float64))


class GpuPackingPolicy(_BestFitGpuMixin):
    """Partly used GPUs first, then free GPUs on used nodes, then empty nodes."""

    name = "gpu-packing"
    needs_workload = False

    def score(self, st: PlacementState, req: SliceRequest, nodes: IntArray) -> Scored:
        if req.gpus == 0:
            return Scored(nodes, np.zeros(len(nodes)))
        a = st.arrays
        left = a.gpu_free[nodes]
        present = a.gpu_present[nodes]
        n_free = (present & (left == MILLI)).sum(axis=1)
        count = a.gpu_count[nodes]
        idle_node = np.maximum(33 - n_free, n_free)
        if req.is_sharing:
            fits = present & (left >= req.milli)
            tight = np.where(fits, left, MILLI + 1).min(axis=1)
            partly = np.maximum(100 - (tight * 100 // MILLI) // 10, 50)
            used = np.where(tight == MILLI, 49, partly)
        else:
            used = np.full(len(nodes), max(50 - req.gpus, 33))
        return Scored(nodes, np.asarray(np.where(n_free == count, idle_node, used), dtype=float))


class BestFitPolicy(_BestFitGpuMixin):
    """The node with the least weighted CPU and GPU left over after placement."""

    name = "bestfit"
    needs_workload = False

    def score(self, st: PlacementState, req: SliceRequest, nodes: IntArray) -> Scored:
        a = st.arrays
        cpu = (a.cpu_free[nodes] - req.cpu_milli) / MAX_SPEC_CPU
        gpu = (a.gpu_free[nodes].sum(axis=1) - req.total_milli) / MAX_SPEC_GPU
        return Scored(nodes, _trunc(100.0 * (1.0 - (0.5 * cpu + 0.5 * gpu))))


def _sigmoid(x: FloatArray) -> FloatArray:
    return np.asarray(1.0 / (1.0 + np.exp(-x)), dtype=np.float64)


def share_pairs(st: PlacementState, req: SliceRequest, nodes: IntArray, *,
                cpu_bound: bool = False) -> tuple[IntArray, IntArray, FloatArray]:
    """Every (node, GPU) where a share fits, with the node's fragmentation after placing it
    there: (row into ``nodes``, GPU index, F_n'), sorted by row then GPU index
    (``cpu_bound``: :func:`~gpuslice.core.frag.shape_frag`'s)."""
    a, tw, tb = st.arrays, _workload(st), _tables(st)
    ok = gpu_ok(a, req, nodes)  # (K, G)
    # GPUs of one node with the same free milli (and memory) give the same result: keep the
    # lowest index of each, which is also the tie-break the policies want.
    free = a.gpu_free[nodes]
    same = free[:, :, None] == free[:, None, :]
    if req.gpu_memory_mib:
        mem = a.gpu_mem_free[nodes]
        same &= mem[:, :, None] == mem[:, None, :]
    ok &= ~(same & _earlier(free.shape[1])).any(axis=2)
    rows, cols = np.nonzero(ok)
    node_rows = nodes[rows]
    r = a.gpu_free[node_rows, cols][:, None]
    r2 = r - req.milli
    g = tw.milli[None, :]
    ge, ge2 = r >= g, r2 >= g
    count = tb.count[node_rows] - ge + ge2
    big = tb.big[node_rows] - r * ge + r2 * ge2
    total = a.gpu_free[node_rows].sum(axis=1) - req.milli
    cpu = a.cpu_free[node_rows] - req.cpu_milli
    mem = a.mem_free[node_rows] - req.memory_mib
    per = shape_frag(total, cpu, mem, tb.access[node_rows], count, big, tw, cpu_bound=cpu_bound)
    return rows, cols, np.asarray(per @ tw.popularity)


def _earlier(width: int) -> BoolArray:
    """``[j, i]`` is True when GPU slot ``i`` comes before slot ``j``."""
    return np.tril(np.ones((width, width), dtype=np.bool_), -1)


def whole_frag_after(st: PlacementState, req: SliceRequest, nodes: IntArray, *,
                     cpu_bound: bool = False) -> FloatArray:
    """F_n' of each node after a CPU-only or whole-GPU task takes its first free GPUs
    (``cpu_bound``: :func:`~gpuslice.core.frag.shape_frag`'s)."""
    a, tw, tb = st.arrays, _workload(st), _tables(st)
    used = req.gpus * MILLI
    total = a.gpu_free[nodes].sum(axis=1) - used
    cpu = a.cpu_free[nodes] - req.cpu_milli
    mem = a.mem_free[nodes] - req.memory_mib
    per = shape_frag(total, cpu, mem, tb.access[nodes], tb.count[nodes] - req.gpus,
                     tb.big[nodes] - used, tw, cpu_bound=cpu_bound)
    return np.asarray(per @ tw.popularity)


def best_per_row(values: FloatArray, rows: IntArray, cols: IntArray,
                 n_rows: int) -> tuple[FloatArray, IntArray]:
    """Per row the largest value and the lowest column reaching it (pairs sorted by row)."""
    best = np.full(n_rows, -np.inf)
    np.maximum.at(best, rows, values)
    hit = values >= best[rows]
    col = np.full(n_rows, -1, dtype=np.int64)
    col[rows[hit][::-1]] = cols[hit][::-1]
    return best, col


def fgd_int_score(delta: FloatArray) -> FloatArray:
    return _trunc(_sigmoid(delta / 1000.0) * 100.0)


class FgdPolicy:
    """Fragmentation gradient descent: the placement that grows the expected fragmentation
    least, scored as FGD's simulator does, ``int(100 * sigmoid(-delta / 1000))``; for a share,
    the GPU with the best integer score, the lowest index on ties."""

    name = "fgd"
    needs_workload = True
    # a node's score depends on its own row and the state's shared values only, and nothing
    # is drawn: scores may be kept until the row changes (core.scorecache)
    row_local = True
    uniform_ties = False

    def score(self, st: PlacementState, req: SliceRequest, nodes: IntArray) -> Scored:
        before = st.frag[nodes]
        if not req.is_sharing:
            after = whole_frag_after(st, req, nodes)
            return Scored(nodes, fgd_int_score(before - after))
        rows, cols, after_pair = share_pairs(st, req, nodes)
        pair_score = fgd_int_score(before[rows] - after_pair)
        best, gpu = best_per_row(pair_score, rows, cols, len(nodes))
        return Scored(nodes, best, gpu)

    def choose_gpus(self, st: PlacementState, req: SliceRequest, node: int,
                    rng: np.random.Generator) -> tuple[int, ...]:
        if not req.is_sharing:
            return exclusive_gpus(st.arrays, req, node)
        scored = self.score(st, req, np.array([node], dtype=np.int64))
        assert scored.gpu is not None
        return (int(scored.gpu[0]),)


class FragStrandPolicy(FgdPolicy):
    """Ours: fragmentation gradient descent that also counts stranded and contended GPUs, and
    that spreads where the CPU, not the GPUs, runs out first.

    Two blind spots of FGD, each measured on the Alibaba trace:

    * **CPU stranding.** FGD notices CPU only when a node can no longer fit a whole typical
      task, so CPU-heavy tasks drain nodes with few cores per GPU (the trace's 8-GPU, 96-core
      nodes) and strand their GPUs. We add the change of the node's stranded-GPU estimate
      ``max(0, free_gpu_milli - free_cpu / rho)``, ``rho`` being the CPU the target workload
      needs per milli-GPU (:func:`~gpuslice.core.frag.cpu_per_milli`), so CPU-heavy tasks go to
      CPU-rich nodes.
    * **Model contention.** When some tasks accept only certain GPU models, tasks that could
      run anywhere should leave those models alone. A placement on model X costs
      ``milli x pressure(X)`` (:func:`~gpuslice.core.frag.model_pressure`), which is 0 on every
      model when no task is constrained.

    And one measured on clusters of identical nodes (issue 59): **where the CPU runs out before
    the GPUs** (``kappa``, :func:`~gpuslice.core.frag.cpu_demand_ratio`, above 1 by more than
    ``z`` standard errors where the workload was learned), which tasks get the CPU decides, not
    GPU fragmentation. Placements whose fragmentation change (counting the GPUs a node's CPU
    cannot feed: ``shape_frag``'s ``cpu_bound``) falls in the same band of ``q`` milli-GPU are
    then equal, and spreading scores choose among them, as DRA's first fit does
    (LeastAllocated + the balance of CPU and memory after the pod, kube-scheduler's scores up
    to v1.35: :func:`~gpuslice.core.dra_default.spread_scores`). ``q = spread x min(1, (kappa
    - bound_from) / bound_ramp)``, 0 below ``min_band`` (narrower bands would only trade FGD's
    integer ties, which pack, for exact scores); at 0 the policy is the packing one.

    Below that, scores use FGD's integer scale, so near-equal placements tie and go to a fixed
    node order, which packs. ``weight`` and ``contention`` scale the first two terms against
    fragmentation; ``spread=0`` turns the third off, ``cpu_fed=False`` keeps FGD's measure in
    it, ``v136_scores=True`` breaks the bands' ties with kube-scheduler v1.36's own scores
    (:func:`~gpuslice.core.dra_default.default_scores`; for taking it apart:
    ``benchmarks/placement_why.py``).
    """

    name = "frag-strand"
    needs_workload = True

    def __init__(self, weight: float = 1.0, contention: float = 0.3, *,
                 spread: float = 1000.0, bound_from: float = 1.0, bound_ramp: float = 0.5,
                 min_band: float = 50.0, z: float = 1.0, cpu_fed: bool = True,
                 v136_scores: bool = False) -> None:
        for label, value in (("weight", weight), ("contention", contention),
                             ("spread", spread), ("min_band", min_band), ("z", z)):
            if not value >= 0:
                raise ValidationError(f"frag-strand {label}", "a number >= 0", value)
        if not bound_ramp > 0:
            raise ValidationError("frag-strand bound_ramp", "a number > 0", bound_ramp)
        self.weight = weight
        self.contention = contention
        self.spread, self.bound_from, self.bound_ramp, self.z = spread, bound_from, bound_ramp, z
        self.min_band = min_band
        self.cpu_fed = cpu_fed  # spreading: count the GPUs the CPU cannot feed (else FGD's F)
        self.spreading = default_scores if v136_scores else spread_scores

    def band(self, st: PlacementState) -> float:
        """The width ``q`` (milli-GPU) of the bands of equal fragmentation change inside which
        the spreading scores decide; 0 while the GPUs run out before the CPU."""
        if self.spread <= 0:
            return 0.0
        ratio, error = st.demand
        over = (ratio - self.z * error - self.bound_from) / self.bound_ramp
        q = self.spread * min(max(over, 0.0), 1.0)
        return q if q >= self.min_band else 0.0

    def _stranding_gain(self, st: PlacementState, req: SliceRequest,
                        nodes: IntArray) -> FloatArray:
        gain = np.zeros(len(nodes))
        rho = st.cpu_per_milli
        if rho > 0 and self.weight > 0:
            free = st.arrays.gpu_free[nodes].sum(axis=1).astype(np.float64)
            cpu = st.arrays.cpu_free[nodes].astype(np.float64)
            before = np.maximum(0.0, free - cpu / rho)
            after = np.maximum(0.0, free - req.total_milli - (cpu - req.cpu_milli) / rho)
            gain += self.weight * (before - after)
        if req.gpus > 0 and self.contention > 0:
            gain -= self.contention * req.total_milli * st.pressure[st.arrays.model_id[nodes]]
        return gain

    def score(self, st: PlacementState, req: SliceRequest, nodes: IntArray) -> Scored:
        q = self.band(st)
        bound = q > 0
        fed = bound and self.cpu_fed
        before = st.cpu_frag[nodes] if fed else st.frag[nodes]
        gain = self._stranding_gain(st, req, nodes)
        gpu: IntArray | None = None
        if not req.is_sharing:
            delta = before - whole_frag_after(st, req, nodes, cpu_bound=fed) + gain
        else:
            rows, cols, after_pair = share_pairs(st, req, nodes, cpu_bound=fed)
            pair = before[rows] - after_pair + gain[rows]
            # packing: the GPU with the best integer score (FGD's); spreading: the exact change
            delta, gpu = best_per_row(pair if bound else fgd_int_score(pair), rows, cols,
                                      len(nodes))
            if not bound:
                return Scored(nodes, delta, gpu)
        if not bound:
            return Scored(nodes, fgd_int_score(delta), gpu)
        # band first, then the spreading scores (0..200), then the integer score
        spreading = self.spreading(st.arrays, req, nodes)
        return Scored(nodes, np.floor(delta / q) * 1e6 + spreading * 1e3 + fgd_int_score(delta),
                      gpu)


PolicyFactory = Callable[[], Policy]

REGISTRY: dict[str, PolicyFactory] = {
    "random": RandomPolicy,
    "dotprod": DotProductPolicy,
    "gpu-clustering": GpuClusteringPolicy,
    "gpu-packing": GpuPackingPolicy,
    "bestfit": BestFitPolicy,
    "fgd": FgdPolicy,
    "frag-strand": FragStrandPolicy,
}
ALIASES: dict[str, str] = {"ours": "frag-strand"}
PUBLISHED_NAMES: Mapping[str, str] = {
    "random": "01-Random",
    "dotprod": "02-DotProd",
    "gpu-clustering": "03-GpuClustering",
    "gpu-packing": "04-GpuPacking",
    "bestfit": "05-BestFit",
    "fgd": "06-FGD",
}


def policy_names() -> list[str]:
    return [*REGISTRY, *ALIASES]


def make_policy(name: str) -> Policy:
    """Build the policy registered as ``name`` (or an alias of it)."""
    key = ALIASES.get(name, name)
    factory = REGISTRY.get(key)
    if factory is None:
        raise ValidationError("policy", f"one of {', '.join(policy_names())}", name)
    return factory()


def tie_order(names: Sequence[str]) -> IntArray:
    """A fixed node order for breaking ties, as a rank per node: by a hash of the node's name,
    so it is the same for every replica and restart of a scheduler and unrelated to how nodes
    are named (the FGD simulator's random name prefixes give such an order; ordering by name
    itself sends every tie to, say, all ``a100-*`` nodes first, which cost 1.6 points of
    unallocated GPU on the embedded scenario, seeds 42-51)."""
    keys = [hashlib.blake2b(n.encode(), digest_size=8).digest() for n in names]
    order = sorted(range(len(names)), key=lambda i: (keys[i], names[i]))
    rank = np.empty(len(names), dtype=np.int64)
    rank[np.array(order, dtype=np.int64)] = np.arange(len(names), dtype=np.int64)
    return rank


@dataclass(frozen=True, slots=True)
class Choice:
    node: int
    gpus: tuple[int, ...]
    score: float


def top_ranked(scores: FloatArray, rank: IntArray) -> int:
    """The position of the highest of ``scores``, ties to the lowest ``rank`` (the fixed node
    order of the candidates, position by position)."""
    top = np.flatnonzero(scores == scores.max())
    return int(top[np.argmin(rank[top])])


def choose(policy: Policy, st: PlacementState, req: SliceRequest, ok: BoolArray,
           rng: np.random.Generator, rank: IntArray | None = None) -> Choice | None:
    """The policy's choice among the nodes where ``ok`` is True (``None`` when there is none).

    A single feasible node is taken without scoring; otherwise the highest score wins. Ties go
    to the node of lowest ``rank`` when a ranking is given (a fixed node order, as the FGD
    simulator has), else are broken uniformly at random.
    """
    nodes = np.flatnonzero(ok)
    if len(nodes) == 0:
        return None
    if len(nodes) == 1:
        node = int(nodes[0])
        return Choice(node, _gpus_for(policy, st, req, node, None, rng), float("nan"))
    scored = policy.score(st, req, nodes)
    top = scored.scores.max()
    best = np.flatnonzero(scored.scores == top)
    if len(best) == 1:
        pick = int(best[0])
    elif rank is not None and not policy.uniform_ties:
        pick = top_ranked(scored.scores, rank[nodes])
    else:
        pick = int(best[int(rng.integers(len(best)))])
    node = int(nodes[pick])
    pre = None if scored.gpu is None else int(scored.gpu[pick])
    return Choice(node, _gpus_for(policy, st, req, node, pre, rng), float(top))


def _gpus_for(policy: Policy, st: PlacementState, req: SliceRequest, node: int,
              pre: int | None, rng: np.random.Generator) -> tuple[int, ...]:
    if req.gpus == 0:
        return ()
    if pre is not None and pre >= 0:
        return (pre,)
    return policy.choose_gpus(st, req, node, rng)


def place(snapshot: ClusterSnapshot, req: SliceRequest, policy: Policy | str,
          rng: np.random.Generator, workload: TargetWorkload | None = None) -> Decision:
    """Decide where ``req`` goes in ``snapshot`` under ``policy``. Nothing is changed."""
    pol = make_policy(policy) if isinstance(policy, str) else policy
    if pol.needs_workload and workload is None:
        raise ValidationError(
            "workload", f"a target workload for policy {pol.name}", None
        )
    st = PlacementState.build(snapshot.arrays, workload)
    ok = feasible(snapshot.arrays, req)
    found = choose(pol, st, req, ok, rng)
    n_ok = int(ok.sum())
    if found is None:
        return Decision(None, pol.name, 0, reject_reasons(snapshot.arrays, req, ok))
    pl = Placement(found.node, snapshot.arrays.names[found.node], found.gpus, req.milli,
                   found.score)
    return Decision(pl, pol.name, n_ok)
