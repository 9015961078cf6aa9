"""A bind of a pod that is already bound: the pod's own share stays in the ledger.

Found by the chaos soak (benchmarks/chaos.py, docs/testing.md): after a kube-apiserver freeze,
kube-scheduler bound a pod again that an earlier bind had bound (that bind's answer was
lost). The replica's second bind reserved a share of its own; the watch showed the pod bound
with the first bind's assignment while that share was in flight, and was passed over ("held
already"); the second Binding failed (409) and its release took the pod's entry out of the
ledger. The replica's ledger then lacked a live pod's share (2700 milli against the API's
3100 on one node) until its next full re-read, and as the leader it could have given that GPU
again."""

from __future__ import annotations

import copy
from typing import Any

from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.adapters.kube.ports import WatchEvent
from gpuslice.core.errors import GpusliceError
from gpuslice.services.extender import ExtenderState
from tests.extender.helpers import KEY, clock, pod, small_cluster


def _bound_by_an_earlier_bind() -> tuple[ExtenderState, FakeApiServer, dict[str, Any], str]:
    """A replica that has not seen the pod bound yet, the API, the pod as the scheduler still
    has it (unbound), and its UID."""
    api = small_cluster()
    replica = ExtenderState(api, KEY, clock=clock)
    stale = copy.deepcopy(api.get_pod("default", "big"))
    uid = stale["metadata"]["uid"]
    assert ExtenderState(api, KEY, clock=clock).bind("default", "big", uid, "b") == ""
    return replica, api, stale, uid


def test_a_failed_bind_of_a_pod_bound_meanwhile_keeps_the_pods_share() -> None:
    replica, api, stale, uid = _bound_by_an_earlier_bind()
    keep, _ = replica.filter(stale, ["a", "b"])
    replica.remember(stale)
    held = replica.hold("default", "big", uid, keep[0])
    w = replica.start_held("default", "big", uid, keep[0], held) if held else None
    assert w is not None
    bound = api.get_pod("default", "big")
    replica.apply(WatchEvent("MODIFIED", "Pod", copy.deepcopy(bound)))  # seen mid-write
    try:
        api.bind("default", "big", uid, keep[0], w.annotations(),
                 w.resource_version)
        failed: GpusliceError | None = None
    except GpusliceError as exc:
        failed = exc
    assert failed is not None  # the pod is bound already
    if replica.finish_held(w, failed) is None:  # a stale read: the whole bind on a thread
        replica.bind("default", "big", uid, keep[0])
    big = replica.ledger.owners.get(("default", "big"))
    assert big is not None and big.node == "b"
    assert sum(replica.ledger.used_milli.values()) == 700  # the pod's share, once
    # the GPU it holds is not given again
    api.add_pod(pod("next", 700))
    nxt = api.get_pod("default", "next")
    assert replica.bind("default", "next", nxt["metadata"]["uid"], "b") == ""
    taken = replica.ledger.owners[("default", "next")].containers[0].gpus[0].uuid
    assert taken != big.containers[0].gpus[0].uuid


def test_a_bind_that_reads_the_pod_bound_takes_its_share_into_the_ledger() -> None:
    replica, _, _, uid = _bound_by_an_earlier_bind()
    # the replica's ledger has not seen the pod bound (its watch is behind)
    assert ("default", "big") not in replica.ledger.owners
    assert replica.bind("default", "big", uid, "b") == ""  # a retried bind: done as asked
    assert replica.ledger.owners[("default", "big")].node == "b"
    assert sum(replica.ledger.used_milli.values()) == 700
