"""Node scores kept between placements: a scheduler asks the same few request shapes again and
again (a Deployment's replicas), and one placement changes one node, so the policy need only
score again the nodes whose row changed since it last scored that shape.

Only for policies whose score of a node depends on that node's row and the placement state's
shared values (the target workload and what is derived from it), and on nothing random:
``row_local`` on the policy (FGD and frag-strand). The owner calls :meth:`ScoreCache.changed`
for every row it changes and starts a new cache with every new placement state.

Whether a shape fits a node (its GPUs: :func:`gpu_fit.feasible` without node resources) is kept
the same way, so :meth:`ScoreCache.choose` answers a filter over thousands of nodes with work
for the changed rows and a few passes over flat arrays: its cost barely grows with the cluster.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from gpuslice.core import fit as gpu_fit
from gpuslice.core.model import BoolArray, FloatArray, IntArray, Isolation, SliceRequest
from gpuslice.core.policies import PlacementState, Policy, Scored, top_ranked

SHAPES = 64  # request shapes kept (least recently used first out)

_Key = tuple[int, int, int, int, int, frozenset[str], Isolation, bool]


@dataclass
class _Entry:
    scores: FloatArray
    gpu: IntArray
    fresh: BoolArray  # scores[row] is that of the row as it is now
    ok: BoolArray  # the shape fits the row's GPUs
    ok_fresh: BoolArray  # ok[row] is that of the row as it is now
    has_gpu: bool = False


def _key(req: SliceRequest) -> _Key:
    """What a request's score depends on (its name does not)."""
    return (req.gpus, req.milli, req.cpu_milli, req.memory_mib, req.gpu_memory_mib,
            req.models, req.isolation, req.memory_share)


class ScoreCache:
    """Scores of ``policy`` on placement state ``st`` per request shape and node."""

    def __init__(self, policy: Policy, st: PlacementState) -> None:
        self.policy, self.st = policy, st
        self.n = st.arrays.n_nodes
        self._entries: OrderedDict[_Key, _Entry] = OrderedDict()
        self.scored = 0  # node scores computed (the rest came from the cache)

    @staticmethod
    def usable(policy: Policy) -> bool:
        return bool(getattr(policy, "row_local", False))

    def changed(self, row: int) -> None:
        """Node ``row``'s arrays changed: its scores and fit are computed again when next
        asked."""
        for e in self._entries.values():
            e.fresh[row] = False
            e.ok_fresh[row] = False

    def _entry(self, req: SliceRequest) -> _Entry:
        key = _key(req)
        e = self._entries.get(key)
        if e is None:
            n = self.n
            e = _Entry(np.zeros(n), np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=np.bool_),
                       np.zeros(n, dtype=np.bool_), np.zeros(n, dtype=np.bool_))
            self._entries[key] = e
            while len(self._entries) > SHAPES:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        return e

    def _fill(self, e: _Entry, req: SliceRequest, nodes: IntArray) -> None:
        stale = np.unique(nodes[~e.fresh[nodes]])
        if stale.size:
            got = self.policy.score(self.st, req, stale)
            e.scores[stale] = got.scores
            if got.gpu is not None:
                e.gpu[stale] = got.gpu
                e.has_gpu = True
            e.fresh[stale] = True
            self.scored += int(stale.size)

    def score(self, req: SliceRequest, nodes: IntArray) -> Scored:
        """``policy.score(st, req, nodes)``, computing only the nodes not scored for this
        shape since their row last changed."""
        e = self._entry(req)
        self._fill(e, req, nodes)
        return Scored(nodes, e.scores[nodes], e.gpu[nodes] if e.has_gpu else None)

    def choose(self, req: SliceRequest, nodes: IntArray | None, rank: IntArray) -> int | None:
        """The position in ``nodes`` (distinct rows; ``None``: every row, so the position is
        the row) of the node the policy picks among those whose GPUs fit ``req``
        (:func:`gpu_fit.feasible` without node resources): the highest score, ties to the
        lowest ``rank``; ``None`` when none fits. The fit and the scores are computed for the
        rows changed since this shape was last asked alone."""
        e = self._entry(req)
        stale = np.flatnonzero(~e.ok_fresh) if nodes is None else nodes[~e.ok_fresh[nodes]]
        if stale.size:
            e.ok[stale] = gpu_fit.feasible(self.st.arrays, req, node_resources=False,
                                           rows=stale)
            e.ok_fresh[stale] = True
        at = np.flatnonzero(e.ok if nodes is None else e.ok[nodes])
        if not at.size:
            return None
        cand = at if nodes is None else nodes[at]
        self._fill(e, req, cand)
        return int(at[top_ranked(e.scores[cand], rank[cand])])
