"""The steps of one GPU's move, each a method that reads the cluster, acts at most once and
writes the next phase into the SliceSchedule's status (a part of
:class:`~gpuslice.services.reconfig.controller.ReconfigController`).

Cordoned -> Moving -> Draining -> [Restoring] -> Applying -> Done, with RollingBack -> Failed
when the node agent cannot apply the layout, and Retiring (the pods the controller made drain
and leave) when the replacements are not ready within ``spec.readyTimeoutSeconds`` (-> Failed),
when a ReplicaSet does not adopt a stand-in handed to it (-> Applying), or when the
SliceSchedule is deleted before its replicas moved (-> Cancelled)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuslice.adapters.http.router_admin import RouterPort
from gpuslice.adapters.kube.fake import ApiConflict, ClusterPort
from gpuslice.core.reconfig import SliceSchedule
from gpuslice.services.reconfig.cluster import ClusterOps
from gpuslice.services.reconfig.pods import (
    STAND_IN_HASH,
    TEMPLATE_HASH,
    Gpu,
    controlled,
    key,
    owner,
    ready,
    replacement,
    replacement_names,
    split,
)

ADOPT_S = 30.0  # a stand-in handed to its ReplicaSet not adopted within this: it leaves
DELETED = "the SliceSchedule was deleted"


@dataclass
class Move:
    """One GPU's move as a pass sees it: its schedule's object and status, the GPU's own
    status (``st``, changed in place), the layout wanted and the node agent's report."""

    obj: dict[str, Any]
    status: dict[str, Any]
    gstat: dict[str, dict[str, Any]]
    g: Gpu
    st: dict[str, Any]
    want: str
    current: dict[str, Any]
    sched: SliceSchedule
    deleting: bool = False


class Phases:
    api: ClusterPort
    ops: ClusterOps
    router: RouterPort | None
    clock: Callable[[], float]

    def _put(self, m: Move, message: str) -> None:
        raise NotImplementedError  # the controller's

    def _note(self, text: str) -> None:
        raise NotImplementedError  # the controller's

    def _advance(self, m: Move) -> None:
        step = {"Cordoned": self._cordoned, "Moving": self._moving,
                "Draining": self._draining, "Restoring": self._restoring,
                "Retiring": self._retiring, "Applying": self._applying,
                "RollingBack": self._rolling_back}.get(str(m.st.get("phase")))
        if step is not None:
            step(m)

    def _end(self, m: Move, phase: str, message: str) -> None:
        m.st.update(phase=phase, message=message, finished=self.clock())
        self._put(m, message)

    def _cordoned(self, m: Move) -> None:
        g, st = m.g, m.st
        if m.deleting:
            self.ops.set_cordon(g.node, g.uuid, False)
            return self._end(m, "Cancelled", f"{DELETED} before any replica moved; the GPU "
                             "is open again, unchanged")
        self.ops.set_cordon(g.node, g.uuid, True)
        on_gpu = self.ops.pods_on(g.uuid)
        pods_now = self.api.list_pods()
        owners = {owner(p) for p in pods_now if key(p) in on_gpu and owner(p) is not None}
        # ReplicaSets recreate the pods evicted from here; their stand-ins leave once the
        # owner has as many ready pods again as now
        st["owners"] = {uid: sum(1 for p in pods_now if owner(p) == uid and ready(p))
                        for uid in sorted(o for o in owners if o is not None)}
        base = int(m.status.get("moves", 0))
        st["replacements"] = replacement_names(on_gpu, base)
        m.status["moves"] = base + len(on_gpu)
        st["phase"] = "Moving"
        st["movingSince"] = self.clock()
        self._put(m, f"moving {len(on_gpu)} replica(s)")

    def _moving(self, m: Move) -> None:
        st, limit = m.st, m.sched.ready_timeout_s
        late = self.clock() - float(st.get("movingSince", self.clock())) > limit
        pods = {key(p): p for p in self.api.list_pods()}
        all_ready = True
        for old, new in st["replacements"].items():
            if new not in pods:
                src = pods.get(old)
                if src is None:  # the old pod is gone: nothing to replace
                    continue
                if not (late or m.deleting):
                    with contextlib.suppress(ApiConflict):  # created before a restart
                        self.api.create_pod(replacement(src, new))
                all_ready = False
            elif not ready(pods[new]):
                all_ready = False
        made = sorted(new for new in st["replacements"].values() if new in pods)
        olds = [old for old in st["replacements"] if old in pods]
        # the routers must send to the replacements before the old pods are marked draining
        # (a router with every replica draining would answer 503)
        taken = all_ready and self._routers_serve(made, olds)
        if taken and not m.deleting:
            st["phase"] = "Draining"
            st["drainingSince"] = self.clock()
            return self._put(m, "replacements ready; draining")
        if not (late or m.deleting):
            return None
        why = (f"{DELETED} during the move" if m.deleting else
               f"replacements not ready after {limit:g} s (spec.readyTimeoutSeconds)"
               if not all_ready else f"the routers did not send to the ready replacements "
               f"within {limit:g} s (spec.readyTimeoutSeconds)")
        return self._retire(m, made, "Cancelled" if m.deleting else "Failed",
                            f"{why}: the {len(made)} replacement(s) made drain and are removed, "
                            "the GPU reopens unchanged")

    def _draining(self, m: Move) -> None:
        st = m.st
        olds = [o for o in st["replacements"] if self.ops.exists(o)]
        for old in olds:
            self.ops.mark_draining(old)
        if not self._drained(m, olds, float(st.get("drainingSince", self.clock()))):
            return None
        for old in olds:
            self.api.delete_pod(*split(old))
        if st.get("owners"):
            st["phase"] = "Restoring"
            st["restoringSince"] = self.clock()
            return self._put(m, "drained; waiting for the ReplicaSets to replace the evicted "
                             "pods")
        st["phase"] = "Applying"
        return self._put(m, "drained; applying the layout")

    def _restoring(self, m: Move) -> None:
        st = m.st
        everyone = {key(p): p for p in self.api.list_pods()}
        stand_ins = [new for new in st["replacements"].values() if new in everyone]
        if "handedOver" in st:
            return self._adopted(m, [everyone[k] for k in stand_ins])
        theirs = [k for k, p in everyone.items()
                  if owner(p) in st["owners"] and ready(p) and k not in stand_ins]
        restored = all(sum(1 for k in theirs if owner(everyone[k]) == uid) >= n
                       for uid, n in st["owners"].items())
        if restored and "standInsDraining" not in st:  # the routers must send to them first
            restored = self._routers_serve(theirs, stand_ins)
        if restored:  # the owners' own pods serve again: the stand-ins drain and leave
            if "standInsDraining" not in st:
                for new in stand_ins:
                    self.ops.mark_draining(new)
                st["standInsDraining"] = self.clock()
                return self._put(m, "the ReplicaSets' pods are ready; the stand-ins drain")
            if not self._drained(m, stand_ins, float(st["standInsDraining"])):
                return None
            for new in stand_ins:
                self.api.delete_pod(*split(new))
            st["phase"] = "Applying"
            return self._put(m, "restored; applying the layout")
        limit = m.sched.ready_timeout_s
        if self.clock() - float(st.get("restoringSince", self.clock())) <= limit:
            return None
        # the ReplicaSets' new pods are not ready in time (a model still loading, no room):
        # each stand-in gets its ReplicaSet's pod-template-hash back, so the ReplicaSet
        # adopts it (a pod like its own) and removes a surplus pod, a not-ready one first
        for k in stand_ins:
            h = (everyone[k]["metadata"].get("annotations") or {}).get(STAND_IN_HASH)
            if h:
                self.ops.patch_pod(k, {TEMPLATE_HASH: h}, {})
        st["handedOver"] = self.clock()
        st["message"] = (f"the ReplicaSets did not bring their pods back within {limit:g} s "
                         f"(spec.readyTimeoutSeconds): the {len(stand_ins)} stand-in(s) were "
                         "handed to them (a ReplicaSet adopts its stand-in and removes a "
                         "surplus pod, a not-ready one first)")
        return self._put(m, st["message"])

    def _adopted(self, m: Move, stand_ins: list[dict[str, Any]]) -> None:
        """After the hand-over: every stand-in adopted (or gone) -> Applying; one still
        without an owner after ADOPT_S (its ReplicaSet is gone) drains and leaves."""
        st = m.st
        orphans = sorted(key(p) for p in stand_ins if not controlled(p))
        if not orphans:
            st["phase"] = "Applying"
            return self._put(m, "the stand-ins belong to their ReplicaSets now; applying the "
                             "layout")
        if self.clock() - float(st["handedOver"]) <= ADOPT_S:
            return None
        return self._retire(m, orphans, "Applying", f"{len(orphans)} stand-in(s) not adopted "
                            f"within {ADOPT_S:g} s (their ReplicaSet is gone?) drain and are "
                            "removed")

    def _retire(self, m: Move, pods: list[str], after: str, message: str) -> None:
        m.st.update(phase="Retiring", retire=pods, retireSince=self.clock(), after=after,
                    afterMessage=message, message=message)
        self._put(m, message)

    def _retiring(self, m: Move) -> None:
        st, g = m.st, m.g
        pods = {key(p): p for p in self.api.list_pods()}
        left = [k for k in st.get("retire") or [] if k in pods]
        serving = [k for k in left if ready(pods[k])]  # a pod never ready serves nothing
        for k in serving:
            self.ops.mark_draining(k)
        if not self._drained(m, serving, float(st.get("retireSince", self.clock()))):
            return None
        for k in left:
            self.api.delete_pod(*split(k))
        after = str(st.get("after", "Failed"))
        message = str(st.get("afterMessage", ""))
        if after == "Applying":
            st["phase"] = after
            return self._put(m, message)
        self.ops.set_cordon(g.node, g.uuid, False)
        return self._end(m, after, message)

    def _applying(self, m: Move) -> None:
        st, g, want, current = m.st, m.g, m.want, m.current
        if current.get("layout") == want and current.get("state") == "success":
            self.ops.set_cordon(g.node, g.uuid, False)
            st["phase"] = "Done"
            st["finished"] = self.clock()
            st["seconds"] = round(st["finished"] - float(st["started"]), 3)
            return self._put(m, f"now {want}")
        if m.deleting:  # not applied yet: the request is withdrawn, the GPU reopened
            self.ops.set_desired(g.node, g.uuid, None)
            self.ops.set_cordon(g.node, g.uuid, False)
            return self._end(m, "Cancelled", f"{DELETED} before the node agent applied "
                             f"{want}: the request is withdrawn, the GPU open again in its "
                             "layout")
        self.ops.set_desired(g.node, g.uuid, want)
        if current.get("state") == "failed":
            st["phase"] = "RollingBack"
            st["message"] = f"applying {want} failed: {current.get('message', '')}"
            return self._put(m, st["message"])
        return None

    def _rolling_back(self, m: Move) -> None:
        st, g, current = m.st, m.g, m.current
        back = str(st.get("fromLayout", ""))
        self.ops.set_desired(g.node, g.uuid, back)
        if current.get("layout") == back and current.get("state") == "success":
            self.ops.set_cordon(g.node, g.uuid, False)
            st["phase"] = "Failed"
            st["finished"] = self.clock()
            return self._put(m, f"rolled back to {back}: {st.get('message', '')}")
        return None

    def _routers_serve(self, keep: list[str], leaving: list[str]) -> bool:
        """Whether every router that sends to ``leaving`` has ``keep`` to send to instead
        (no router to ask: yes)."""
        if self.router is None:
            return True
        return self.router.serving([split(k)[1] for k in keep],
                                   [split(k)[1] for k in leaving]) is True

    def _drained(self, m: Move, pods: list[str], since: float) -> bool:
        """Whether ``pods`` (marked draining) may go: every router replica reports them
        draining with no request in flight (or knows them not), or the drain timeout passed
        (said in the GPU's status)."""
        if not pods:
            return True
        left = self.router.outstanding([split(k)[1] for k in pods]) \
            if self.router is not None else None
        if left == 0:
            return True
        limit = m.sched.drain_timeout_s
        if self.clock() - since < limit:
            return False
        why = ("no router to ask" if self.router is None else
               "the routers could not tell" if left is None else
               f"{left} request(s) still in flight")
        m.st["drainNote"] = (f"{', '.join(pods)} went after the drain timeout ({limit:g} s, "
                             f"spec.drainTimeoutSeconds): {why}")
        self._note(f"{m.sched.namespace}/{m.sched.name}: {m.st['drainNote']}")
        return True
