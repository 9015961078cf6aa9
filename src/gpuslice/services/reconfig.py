"""The reconfiguration controller: change how GPUs are sliced while services keep answering.

It follows ``SliceSchedule`` objects (group ``gpuslice.io``, see ``deploy/base/crd-slice-
schedule.yaml``) and moves every GPU they select to the layout wanted now, one GPU at a time:

1. **Waiting**: the replicas on the GPU must fit on the other open GPUs (:func:`room_for`);
   when they do not, nothing is touched and the status says why.
2. **Cordoned**: the GPU's UUID joins the node's ``gpuslice.io/cordoned-gpus``; the extender
   places no new slice on it.
3. **Moving**: a replacement pod per replica on the GPU (same spec, new name, recorded in the
   status before it is created); the scheduler and extender place them elsewhere. Waits until
   every replacement runs and is ready.
4. **Draining**: the old pods get ``gpuslice.io/draining``; routers stop sending them requests
   and let in-flight ones finish (the controller asks the router until none is outstanding, or
   the drain timeout passes); then the old pods are evicted. A ReplicaSet's pod is moved
   through a stand-in without the ReplicaSet's ``pod-template-hash`` (so it is neither adopted
   nor counted); **Restoring** waits until the ReplicaSet has replaced the evicted pods and
   they are ready, then the stand-ins drain and leave. Pods of other owners (a StatefulSet's:
   their name is their identity) are not moved; the GPU waits and says why.
5. **Applying**: the GPU's layout goes into the node's ``gpuslice.io/mig-desired``; the node
   agent applies it once the GPU has no client and reports it in ``gpuslice.io/mig-layouts``.
   A failure there leads to **RollingBack** (the last good layout asked for again) and then
   **Failed** with the reason; success to reopening the GPU (cordon removed) and **Done**.

Every step is written to the object's status before it is acted on, and every action is
idempotent, so a controller killed at any point and started again resumes where the status
says (the replacements it had named are found, not created twice; no pod is deleted before its
replacement is ready). Each GPU's status records when it started and finished.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuslice.adapters.http.router_admin import RouterPort
from gpuslice.adapters.kube.annotation import AnnotationError, decode
from gpuslice.adapters.kube.fake import ApiConflict, ApiNotFound, ClusterPort
from gpuslice.adapters.kube.objects import (
    CORDONED_ANNOTATION,
    DRAINING_ANNOTATION,
    InventoryGpu,
    node_inventory,
    pod_request,
)
from gpuslice.core import catalog, migmps
from gpuslice.core.assignment import ANNOTATION, Assignment
from gpuslice.core.errors import GpusliceError, ValidationError
from gpuslice.core.reconfig import (
    GpuRoom,
    PodNeed,
    SliceSchedule,
    layout_text,
    parse_schedule,
    room_for,
    target_layout,
)
from gpuslice.services.node_layouts import MIG_DESIRED, MIG_LAYOUTS

PLURAL = "sliceschedules"
log = logging.getLogger("gpuslice.reconfig")
ACTIVE = ("Cordoned", "Moving", "Draining", "Restoring", "Applying", "RollingBack")
_SUFFIX = re.compile(r"-m\d+$")


@dataclass(frozen=True)
class _Gpu:
    node: str
    uuid: str
    model: str
    memory_mib: int


def _now_text(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


class ReconfigController:
    def __init__(self, api: ClusterPort, *, router: RouterPort | None = None,
                 clock: Callable[[], float] = time.time,
                 minute_of_day: Callable[[], int] | None = None,
                 ready_timeout_s: float = 120.0) -> None:
        self.api, self.router, self.clock = api, router, clock
        self.minute_of_day = minute_of_day or (
            lambda: time.gmtime(self.clock()).tm_hour * 60 + time.gmtime(self.clock()).tm_min)
        self.ready_timeout_s = ready_timeout_s
        self.log: list[str] = []

    # -- the loop ------------------------------------------------------------------------------

    def step(self) -> None:
        """One pass over every SliceSchedule. One schedule's trouble never stops the others:
        an invalid one gets the condition Invalid (naming the field), an unexpected error the
        condition Error (and a log line with its traceback)."""
        for obj in self.api.list_custom(PLURAL):
            try:
                self._one(obj)
            except ApiConflict:
                continue  # someone changed the object: read it again next pass
            except Exception as exc:
                self._failed(obj, exc)

    def _one(self, obj: dict[str, Any]) -> None:
        try:
            sched = parse_schedule(obj)
        except ValidationError as exc:
            self._set_condition(obj, "Invalid", str(exc))
            return
        self._reconcile(obj, sched)

    def _failed(self, obj: dict[str, Any], exc: Exception) -> None:
        meta = obj.get("metadata") if isinstance(obj, dict) else None
        name = (f"{meta.get('namespace', 'default')}/{meta.get('name', '')}"
                if isinstance(meta, dict) else repr(obj)[:80])
        log.error("SliceSchedule %s: %s: %s", name, type(exc).__name__, exc,
                  exc_info=(type(exc), exc, exc.__traceback__))
        self.log.append(f"{name}: Error: {type(exc).__name__}: {exc}")
        try:
            self._set_condition(obj, "Error", f"reconciling failed ({type(exc).__name__}: "
                                f"{exc}); the controller goes on with the other schedules")
        except Exception as again:
            log.error("SliceSchedule %s: its status could not be written: %s", name, again)

    def _note(self, text: str) -> None:
        self.log.append(text)
        log.info(text)

    def run(self, stop: threading.Event, every_s: float = 0.5) -> None:
        """A step every ``every_s`` until ``stop`` is set (a step is short: each GPU's move
        is a state machine whose phase lives on its SliceSchedule, so a stopped controller
        resumes it where it was)."""
        while not stop.is_set():
            try:
                self.step()
            except GpusliceError as exc:
                self._note(f"step: {exc}")
            except Exception:
                log.exception("step")
            stop.wait(every_s)

    # -- one schedule --------------------------------------------------------------------------

    def _gpus(self, sched: SliceSchedule) -> tuple[list[_Gpu], dict[str, dict[str, Any]]]:
        gpus: list[_Gpu] = []
        nodes: dict[str, dict[str, Any]] = {}
        for n in self.api.list_nodes():
            name = n["metadata"]["name"]
            nodes[name] = n
            try:
                inv = node_inventory(n)
            except ValidationError:
                continue
            gpus.extend(_Gpu(name, g.uuid, g.model, g.memory_mib) for g in inv
                        if sched.selects(name, g.model))
        return gpus, nodes

    @staticmethod
    def _ann(node: dict[str, Any], key: str) -> Any:
        raw = ((node.get("metadata") or {}).get("annotations") or {}).get(key)
        if key == CORDONED_ANNOTATION:
            return [u for u in (raw or "").split(",") if u]
        try:
            return json.loads(raw) if raw else {}
        except ValueError:
            return {}

    def _reconcile(self, obj: dict[str, Any], sched: SliceSchedule) -> None:
        target = target_layout(sched, self.minute_of_day())
        status = dict(obj.get("status") or {})
        gstat: dict[str, dict[str, Any]] = dict(status.get("gpus") or {})
        gpus, nodes = self._gpus(sched)
        try:  # a GPU model the layout does not fit: the schedule is invalid, nothing is touched
            want = {g.uuid: layout_text(sched.layouts[target].for_model(g.model)) for g in gpus}
        except ValidationError as exc:
            self._set_condition(obj, "Invalid", str(exc))
            return
        current = {g.uuid: (self._ann(nodes[g.node], MIG_LAYOUTS).get(g.uuid) or {})
                   for g in gpus}
        if status.get("target") != target:
            status["target"] = target
            # a new target: GPUs that failed or waited for the old one are tried again
            gstat = {u: st for u, st in gstat.items() if st.get("phase") in ACTIVE}
        active = [g for g in gpus if (gstat.get(g.uuid) or {}).get("phase") in ACTIVE]
        if active:
            g = active[0]
            self._advance(obj, status, gstat, g, want[g.uuid], current[g.uuid], nodes)
            return
        for g in gpus:  # GPUs whose layout cannot be changed: said, never touched
            rep = current[g.uuid]
            why = None if rep.get("state") in ("success", "pending", "failed") else (
                rep.get("message") or "the node agent reports no MIG layout for this GPU")
            if why and (gstat.get(g.uuid) or {}).get("message") != why:
                gstat[g.uuid] = {"node": g.node, "phase": "Failed", "to": target,
                                 "message": why}
        todo = [g for g in gpus if current[g.uuid].get("layout") != want[g.uuid]
                and (gstat.get(g.uuid) or {}).get("phase") != "Failed"]
        done = sum(1 for g in gpus if current[g.uuid].get("layout") == want[g.uuid])
        status["summary"] = {"gpus": len(gpus), "inTarget": done, "target": target}
        if not todo:
            self._save(obj, status, gstat, "Done" if done == len(gpus) else "Failed",
                       f"{done} of {len(gpus)} GPUs in layout {target}")
            return
        # emptiest GPU first: the ones with no replica change at once, and the replicas of the
        # busy ones then move onto GPUs already in the target layout (each replica moves once)
        load: dict[str, int] = {}
        for _, a in self._assignments():
            for u in a.gpu_uuids():
                load[u] = load.get(u, 0) + 1
        g = min(todo, key=lambda x: (load.get(x.uuid, 0), x.node, x.uuid))
        why = self._no_room(g, gpus, nodes)
        if why is not None:
            gstat[g.uuid] = {"node": g.node, "phase": "Waiting", "to": target,
                             "message": why}
            self._save(obj, status, gstat, "Waiting",
                       f"GPU {g.uuid} on {g.node} waits: {why}")
            return
        gstat[g.uuid] = {"node": g.node, "phase": "Cordoned", "to": target,
                         "toLayout": want[g.uuid],
                         "fromLayout": current[g.uuid].get("layout", ""),
                         "started": self.clock(), "replacements": {}}
        self._save(obj, status, gstat, "Progressing", f"GPU {g.uuid} on {g.node}: cordoned")

    def dry_run(self, obj: dict[str, Any]) -> dict[str, Any]:
        """What reconciling ``obj`` would do now, changing nothing: the target layout, and per
        GPU not in it, its layouts, the pods that would move and whether they have room."""
        sched = parse_schedule(obj)
        target = target_layout(sched, self.minute_of_day())
        gpus, nodes = self._gpus(sched)
        out = []
        for g in gpus:
            want = layout_text(sched.layouts[target].for_model(g.model))
            cur = (self._ann(nodes[g.node], MIG_LAYOUTS).get(g.uuid) or {}).get("layout")
            if cur == want:
                continue
            out.append({"node": g.node, "gpu": g.uuid, "from": cur or "(not reported yet)",
                        "to": want, "moves": sorted(self._pods_on(g.uuid)),
                        "blocked": self._no_room(g, gpus, nodes)})
        return {"schedule": f"{sched.namespace}/{sched.name}", "target": target,
                "gpus": len(gpus), "changes": out}

    # -- the steps of one GPU ------------------------------------------------------------------

    def _advance(self, obj: dict[str, Any], status: dict[str, Any],
                 gstat: dict[str, dict[str, Any]], g: _Gpu, want: str,
                 current: dict[str, Any], nodes: dict[str, dict[str, Any]]) -> None:
        st = dict(gstat[g.uuid])
        phase = st["phase"]
        node = nodes[g.node]
        if phase == "Cordoned":
            self._cordon(node, g.uuid, True)
            on_gpu = self._pods_on(g.uuid)
            pods_now = self.api.list_pods()
            owners = {_owner(p) for p in pods_now
                      if _key(p) in on_gpu and _owner(p) is not None}
            # ReplicaSets recreate the pods evicted from here; their stand-ins leave once the
            # owner has as many ready pods again as now
            st["owners"] = {uid: sum(1 for p in pods_now if _owner(p) == uid and _ready(p))
                            for uid in sorted(o for o in owners if o is not None)}
            base = int(status.get("moves", 0))
            st["replacements"] = {
                key: f"{key.split('/')[0]}/{_SUFFIX.sub('', key.split('/')[1])}-m{base + i}"
                for i, key in enumerate(sorted(on_gpu))}
            status["moves"] = base + len(on_gpu)
            st["phase"] = "Moving"
            st["movingSince"] = self.clock()
            return self._put(obj, status, gstat, g, st, f"moving {len(on_gpu)} replica(s)")
        if phase == "Moving":
            pods = {f"{p['metadata']['namespace']}/{p['metadata']['name']}": p
                    for p in self.api.list_pods()}
            ready = True
            for old, new in st["replacements"].items():
                if new not in pods:
                    src = pods.get(old)
                    if src is None:  # the old pod is gone: nothing to replace
                        continue
                    with contextlib.suppress(ApiConflict):  # created before a restart
                        self.api.create_pod(_replacement(src, new))
                    ready = False
                elif not _ready(pods[new]):
                    ready = False
            if ready:
                st["phase"] = "Draining"
                st["drainingSince"] = self.clock()
                return self._put(obj, status, gstat, g, st, "replacements ready; draining")
            if self.clock() - float(st.get("movingSince", self.clock())) > self.ready_timeout_s:
                for new in st["replacements"].values():
                    ns, name = new.split("/", 1)
                    self.api.delete_pod(ns, name)
                self._cordon(node, g.uuid, False)
                st["phase"] = "Failed"
                st["message"] = (f"replacements not ready after {self.ready_timeout_s:.0f} "
                                 "s; they were removed and the GPU reopened unchanged")
                return self._put(obj, status, gstat, g, st, st["message"])
            return None
        if phase == "Draining":
            olds = [o for o in st["replacements"] if self._exists(o)]
            for old in olds:
                self._mark_draining(old)
            names = [o.split("/", 1)[1] for o in olds]
            # no router to ask, or one that cannot tell yet: wait the drain timeout
            left = self.router.outstanding(names) if self.router and names else (
                None if names else 0)
            waited = self.clock() - float(st.get("drainingSince", self.clock()))
            if olds and (left is None or left > 0) and waited < self._drain_s(obj):
                return None
            for old in olds:
                ns, name = old.split("/", 1)
                self.api.delete_pod(ns, name)
            if st.get("owners"):
                st["phase"] = "Restoring"
                st["restoringSince"] = self.clock()
                return self._put(obj, status, gstat, g, st, "drained; waiting for the "
                                 "ReplicaSets to replace the evicted pods")
            st["phase"] = "Applying"
            return self._put(obj, status, gstat, g, st, "drained; applying the layout")
        if phase == "Restoring":
            everyone = self.api.list_pods()
            stand_ins = [new for new in st["replacements"].values() if self._exists(new)]
            restored = all(sum(1 for p in everyone if _owner(p) == uid and _ready(p)
                           and _key(p) not in stand_ins) >= n
                       for uid, n in st["owners"].items())
            waited = self.clock() - float(st.get("restoringSince", self.clock()))
            if not restored and waited < self.ready_timeout_s:
                return None
            if restored:  # the owners' own pods serve again: the stand-ins drain and leave
                if "standInsDraining" not in st:
                    for new in stand_ins:
                        self._mark_draining(new)
                    st["standInsDraining"] = self.clock()
                    return self._put(obj, status, gstat, g, st, "the ReplicaSets' pods are "
                                     "ready; the stand-ins drain")
                names = [x.split("/", 1)[1] for x in stand_ins]
                left = self.router.outstanding(names) if self.router and names else None
                drained_for = self.clock() - float(st["standInsDraining"])
                if names and (left is None or left > 0) and drained_for < self._drain_s(obj):
                    return None
                for new in stand_ins:
                    ns, name = new.split("/", 1)
                    self.api.delete_pod(ns, name)
            else:
                st["message"] = ("the ReplicaSets did not bring their pods back in time; the "
                                 "stand-ins stay")
            st["phase"] = "Applying"
            return self._put(obj, status, gstat, g, st, "restored; applying the layout")
        if phase == "Applying":
            self._desire(node, g.uuid, want)
            if current.get("layout") == want and current.get("state") == "success":
                self._cordon(node, g.uuid, False)
                st["phase"] = "Done"
                st["finished"] = self.clock()
                st["seconds"] = round(st["finished"] - float(st["started"]), 3)
                return self._put(obj, status, gstat, g, st, f"now {want}")
            if current.get("state") == "failed":
                st["phase"] = "RollingBack"
                st["message"] = f"applying {want} failed: {current.get('message', '')}"
                return self._put(obj, status, gstat, g, st, st["message"])
            return None
        if phase == "RollingBack":
            back = str(st.get("fromLayout", ""))
            self._desire(node, g.uuid, back)
            if current.get("layout") == back and current.get("state") == "success":
                self._cordon(node, g.uuid, False)
                st["phase"] = "Failed"
                st["finished"] = self.clock()
                return self._put(obj, status, gstat, g, st,
                                 f"rolled back to {back}: {st.get('message', '')}")
            return None
        return None

    # -- helpers -------------------------------------------------------------------------------

    def _drain_s(self, obj: dict[str, Any]) -> float:
        return parse_schedule(obj).drain_timeout_s

    def _exists(self, key: str) -> bool:
        ns, name = key.split("/", 1)
        try:
            self.api.get_pod(ns, name)
        except ApiNotFound:
            return False
        return True

    def _mark_draining(self, key: str) -> None:
        ns, name = key.split("/", 1)
        for _ in range(5):
            try:
                p = self.api.get_pod(ns, name)
                if (p["metadata"].get("annotations") or {}).get(DRAINING_ANNOTATION) == "true":
                    return
                self.api.patch_pod_annotations(ns, name, {DRAINING_ANNOTATION: "true"},
                                               p["metadata"]["resourceVersion"])
                return
            except ApiConflict:
                continue
            except ApiNotFound:
                return

    def _assignments(self) -> list[tuple[dict[str, Any], Assignment]]:
        out = []
        for p in self.api.list_pods():
            text = (p["metadata"].get("annotations") or {}).get(ANNOTATION)
            if not text:
                continue
            try:
                out.append((p, decode(text)))
            except AnnotationError:
                continue
        return out

    def _pods_on(self, uuid: str) -> list[str]:
        return [f"{a.namespace}/{a.pod}" for p, a in self._assignments()
                if uuid in a.gpu_uuids()
                and (p["metadata"].get("annotations") or {}).get(DRAINING_ANNOTATION) != "true"]

    def _no_room(self, g: _Gpu, gpus: list[_Gpu], nodes: dict[str, dict[str, Any]]) -> str | None:
        """Why the replicas on ``g`` could not move (None: they can)."""
        used: dict[str, list[int]] = {}
        needs = []
        for p, a in self._assignments():
            for c in a.containers:
                for share in c.gpus:
                    u = used.setdefault(share.uuid, [0, 0])
                    u[0] += share.milli
                    u[1] += share.memory_mib
            if g.uuid in a.gpu_uuids():
                kinds = {r.get("kind") for r in p["metadata"].get("ownerReferences") or []}
                if kinds - {"ReplicaSet"}:
                    return (f"pod {a.namespace}/{a.pod} is managed by a "
                            f"{'/'.join(sorted(str(k) for k in kinds - {'ReplicaSet'}))}, whose "
                            "pods gpuslice does not move (their names are their identity)")
                try:
                    req = pod_request(p)
                except ValidationError:
                    req = None
                share = a.containers[0].gpus[0]
                needs.append(PodNeed(f"{a.namespace}/{a.pod}", share.milli, share.memory_mib,
                                     req.models if req else frozenset()))
        if not needs:
            return None
        cordoned = {u for n in nodes.values() for u in self._ann(n, CORDONED_ANNOTATION)}
        in_mig = migmps.usage(a for _, a in self._assignments())
        rooms = []
        for n in nodes.values():
            try:
                inv = node_inventory(n)
            except ValidationError:
                continue
            for x in inv:
                if x.uuid == g.uuid or x.uuid in cordoned:
                    continue
                if x.mig_enabled:  # as the extender places them: MPS slices inside instances
                    rooms.extend(self._instance_rooms(x, n["metadata"]["name"], in_mig))
                    continue
                u = used.get(x.uuid, [0, 0])
                rooms.append(GpuRoom(x.uuid, n["metadata"]["name"], x.model, 1000 - u[0],
                                     x.memory_mib - u[1]))
        return room_for(needs, rooms)

    @staticmethod
    def _instance_rooms(x: InventoryGpu, node: str,
                        in_mig: dict[tuple[str, int], tuple[int, int, bool]]) -> list[GpuRoom]:
        """The room each MIG instance of a MIG-enabled GPU has for MPS slices (none in one
        held whole by a MIG-isolated pod)."""
        model = catalog.lookup(x.model)
        if model is None or model.mig is None:
            return []
        out = []
        for m in x.mig:
            milli, mib, whole = in_mig.get((x.uuid, m.start), (0, 0, False))
            if whole:
                continue
            cap = migmps.capacity_milli(model.mig.profile(m.profile).compute_slices,
                                        model.mig.compute_slices)
            out.append(GpuRoom(f"{x.uuid} {m.profile}@{m.start}", node, x.model, cap - milli,
                               m.memory_mib - mib))
        return out

    def _cordon(self, node: dict[str, Any], uuid: str, on: bool) -> None:
        name = node["metadata"]["name"]
        fresh = next((n for n in self.api.list_nodes() if n["metadata"]["name"] == name), node)
        cur = self._ann(fresh, CORDONED_ANNOTATION)
        new = sorted(set(cur) | {uuid}) if on else [u for u in cur if u != uuid]
        if new != cur:
            self.api.patch_node(name, {}, {CORDONED_ANNOTATION: ",".join(new)})

    def _desire(self, node: dict[str, Any], uuid: str, layout: str) -> None:
        name = node["metadata"]["name"]
        fresh = next((n for n in self.api.list_nodes() if n["metadata"]["name"] == name), node)
        cur = dict(self._ann(fresh, MIG_DESIRED))
        if cur.get(uuid) != layout:
            cur[uuid] = layout
            self.api.patch_node(name, {}, {MIG_DESIRED: json.dumps(cur, sort_keys=True)})

    def _put(self, obj: dict[str, Any], status: dict[str, Any],
             gstat: dict[str, dict[str, Any]], g: _Gpu, st: dict[str, Any],
             message: str) -> None:
        gstat[g.uuid] = st
        # the overall Done / Failed / Waiting is the next pass's summary over every GPU
        self._save(obj, status, gstat, "Progressing",
                   f"GPU {g.uuid} on {g.node}: {st['phase'].lower()}: {message}")
        self.api.patch_node(g.node, {f"gpuslice.io/reconfig.{_label_key(g.uuid)}":
                                     st["phase"].lower()}, {})

    def _save(self, obj: dict[str, Any], status: dict[str, Any],
              gstat: dict[str, dict[str, Any]], condition: str, message: str) -> None:
        status = dict(status)
        status["gpus"] = gstat
        conds = [c for c in status.get("conditions", []) if c.get("type") != "Ready"]
        ready = {"type": "Ready", "status": "True" if condition == "Done" else "False",
                 "reason": condition, "message": message,
                 "lastTransitionTime": _now_text(self.clock())}
        old = next((c for c in status.get("conditions", []) if c.get("type") == "Ready"), None)
        if old and (old.get("reason"), old.get("message")) == (condition, message):
            ready["lastTransitionTime"] = old["lastTransitionTime"]
        status["conditions"] = [*conds, ready]
        if obj.get("status") == status:
            return
        if (old or {}).get("message") != message:
            self._note(f"{obj['metadata']['name']}: {condition}: {message}")
        new = dict(obj)
        new["status"] = status
        self.api.replace_custom(PLURAL, new)

    def _set_condition(self, obj: dict[str, Any], reason: str, message: str) -> None:
        self._save(obj, dict(obj.get("status") or {}), dict((obj.get("status") or {})
                                                           .get("gpus") or {}), reason, message)


def _label_key(uuid: str) -> str:
    """The GPU part of the label ``gpuslice.io/reconfig.<GPU>`` (a label name is at most 63
    characters, alphanumeric at both ends)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", uuid)[-(63 - len("reconfig.")):].strip("-_.")


def _key(pod: dict[str, Any]) -> str:
    meta = pod["metadata"]
    return f"{meta.get('namespace', 'default')}/{meta['name']}"


def _owner(pod: dict[str, Any]) -> str | None:
    """The UID of the ReplicaSet that owns ``pod`` (None: a bare pod)."""
    for ref in pod["metadata"].get("ownerReferences") or []:
        if ref.get("kind") == "ReplicaSet" and ref.get("controller", True):
            return str(ref.get("uid"))
    return None


def _ready(pod: dict[str, Any]) -> bool:
    st = pod.get("status") or {}
    return st.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in st.get("conditions") or [])


def _replacement(src: dict[str, Any], key: str) -> dict[str, Any]:
    """A copy of ``src`` named ``key`` ("namespace/name"), unscheduled, without the old pod's
    assignment and status."""
    ns, name = key.split("/", 1)
    meta = src["metadata"]
    ann = {k: v for k, v in (meta.get("annotations") or {}).items()
           if k not in (ANNOTATION, DRAINING_ANNOTATION)}
    ann["gpuslice.io/replaces"] = f"{meta.get('namespace', 'default')}/{meta['name']}"
    spec = {k: v for k, v in (src.get("spec") or {}).items() if k != "nodeName"}
    # a ReplicaSet's pod: the stand-in keeps the labels Services select on, but not the
    # ReplicaSet's own pod-template-hash, so the ReplicaSet neither adopts nor counts it
    labels = {k: v for k, v in (meta.get("labels") or {}).items() if k != "pod-template-hash"}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": labels,
                         "annotations": ann},
            "spec": spec}
