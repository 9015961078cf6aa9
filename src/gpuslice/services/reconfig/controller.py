"""The reconfiguration controller's loop over SliceSchedules: which GPU moves next, the
schedule's status, and its finalizer (see the package's docstring)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from gpuslice.adapters.http.router_admin import RouterPort
from gpuslice.adapters.kube.fake import ApiConflict, ClusterPort
from gpuslice.adapters.kube.objects import node_inventory
from gpuslice.core.errors import GpusliceError, ValidationError
from gpuslice.core.reconfig import SliceSchedule, layout_text, parse_schedule, target_layout
from gpuslice.services.node_layouts import MIG_LAYOUTS
from gpuslice.services.reconfig.cluster import ClusterOps, annotation
from gpuslice.services.reconfig.phases import Move, Phases
from gpuslice.services.reconfig.pods import Gpu, label_key, now_text

PLURAL = "sliceschedules"
# on a SliceSchedule while one of its GPUs is being moved: deleting the object then lets the
# controller finish or undo the move (cordon lifted, pods it made gone) before it goes
FINALIZER = "gpuslice.io/reconfig"
ACTIVE = ("Cordoned", "Moving", "Draining", "Restoring", "Retiring", "Applying", "RollingBack")
log = logging.getLogger("gpuslice.reconfig")


class ReconfigController(Phases):
    def __init__(self, api: ClusterPort, *, router: RouterPort | None = None,
                 clock: Callable[[], float] = time.time,
                 minute_of_day: Callable[[], int] | None = None) -> None:
        self.api, self.router, self.clock = api, router, clock
        self.ops = ClusterOps(api)
        self.minute_of_day = minute_of_day or (
            lambda: time.gmtime(self.clock()).tm_hour * 60 + time.gmtime(self.clock()).tm_min)
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
        deleting = bool((obj.get("metadata") or {}).get("deletionTimestamp"))
        try:
            sched = parse_schedule(obj)
        except ValidationError as exc:
            if deleting:  # nothing can be planned: lift its cordons and let it go
                return self._let_go(obj, lift=True)
            self._set_condition(obj, "Invalid", str(exc))
            return None
        self._reconcile(obj, sched)
        return None

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

    # -- the finalizer -------------------------------------------------------------------------

    def _finalizer(self, obj: dict[str, Any], on: bool) -> dict[str, Any]:
        """``obj`` with (or without) the finalizer, written if that changes it."""
        meta = obj.get("metadata") or {}
        have = list(meta.get("finalizers") or [])
        if (FINALIZER in have) == on:
            return obj
        new = dict(obj, metadata={**meta, "finalizers": [*have, FINALIZER] if on else
                                  [f for f in have if f != FINALIZER]})
        return self.api.update_custom(PLURAL, new)

    def _let_go(self, obj: dict[str, Any], lift: bool = False) -> None:
        """A deleted schedule with no move under way: the finalizer goes (and, ``lift``,
        the cordons of any GPU its status says is moving)."""
        if lift:
            for uuid, st in ((obj.get("status") or {}).get("gpus") or {}).items():
                if st.get("phase") in ACTIVE and st.get("node"):
                    self.ops.set_cordon(str(st["node"]), uuid, False)
        self._finalizer(obj, False)
        self._note(f"{obj['metadata'].get('name')}: deleted; nothing left to finish")

    # -- one schedule --------------------------------------------------------------------------

    def _gpus(self, sched: SliceSchedule) -> tuple[list[Gpu], dict[str, dict[str, Any]]]:
        gpus: list[Gpu] = []
        nodes: dict[str, dict[str, Any]] = {}
        for n in self.api.list_nodes():
            name = n["metadata"]["name"]
            nodes[name] = n
            try:
                inv = node_inventory(n)
            except ValidationError:
                continue
            gpus.extend(Gpu(name, g.uuid, g.model, g.memory_mib) for g in inv
                        if sched.selects(name, g.model))
        return gpus, nodes

    def _reconcile(self, obj: dict[str, Any], sched: SliceSchedule) -> None:
        deleting = bool((obj.get("metadata") or {}).get("deletionTimestamp"))
        target = target_layout(sched, self.minute_of_day())
        status = dict(obj.get("status") or {})
        gstat: dict[str, dict[str, Any]] = dict(status.get("gpus") or {})
        gpus, nodes = self._gpus(sched)
        try:  # a GPU model the layout does not fit: the schedule is invalid, nothing is touched
            want = {g.uuid: layout_text(sched.layouts[target].for_model(g.model)) for g in gpus}
        except ValidationError as exc:
            if deleting:
                return self._let_go(obj, lift=True)
            self._set_condition(obj, "Invalid", str(exc))
            return None
        current = {g.uuid: (annotation(nodes[g.node], MIG_LAYOUTS).get(g.uuid) or {})
                   for g in gpus}
        if status.get("target") != target and not deleting:
            status["target"] = target
            # a new target: GPUs that failed or waited for the old one are tried again
            gstat = {u: st for u, st in gstat.items() if st.get("phase") in ACTIVE}
        active = [g for g in gpus if (gstat.get(g.uuid) or {}).get("phase") in ACTIVE]
        if active:
            if not deleting:  # a move under way (one begun by an older controller too)
                obj = self._finalizer(obj, True)
            g = active[0]
            self._advance(Move(obj, status, gstat, g, dict(gstat[g.uuid]), want[g.uuid],
                               current[g.uuid], sched, deleting))
            return None
        if deleting:
            return self._let_go(obj)
        obj = self._finalizer(obj, False)  # no move under way: nothing to finish
        return self._plan(obj, status, gstat, gpus, nodes, want, current, target)

    def _plan(self, obj: dict[str, Any], status: dict[str, Any],
              gstat: dict[str, dict[str, Any]], gpus: list[Gpu],
              nodes: dict[str, dict[str, Any]], want: dict[str, str],
              current: dict[str, dict[str, Any]], target: str) -> None:
        """No GPU moving: say which cannot change, and start the next one (or say Done)."""
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
        for _, a in self.ops.assignments():
            for u in a.gpu_uuids():
                load[u] = load.get(u, 0) + 1
        g = min(todo, key=lambda x: (load.get(x.uuid, 0), x.node, x.uuid))
        why = self.ops.no_room(g, nodes)
        if why is not None:
            gstat[g.uuid] = {"node": g.node, "phase": "Waiting", "to": target,
                             "message": why}
            self._save(obj, status, gstat, "Waiting",
                       f"GPU {g.uuid} on {g.node} waits: {why}")
            return
        obj = self._finalizer(obj, True)  # before the first step is written: it is a move
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
            cur = (annotation(nodes[g.node], MIG_LAYOUTS).get(g.uuid) or {}).get("layout")
            if cur == want:
                continue
            out.append({"node": g.node, "gpu": g.uuid, "from": cur or "(not reported yet)",
                        "to": want, "moves": sorted(self.ops.pods_on(g.uuid)),
                        "blocked": self.ops.no_room(g, nodes)})
        return {"schedule": f"{sched.namespace}/{sched.name}", "target": target,
                "gpus": len(gpus), "changes": out}

    # -- status --------------------------------------------------------------------------------

    def _put(self, m: Move, message: str) -> None:
        m.gstat[m.g.uuid] = m.st
        # the overall Done / Failed / Waiting is the next pass's summary over every GPU
        self._save(m.obj, m.status, m.gstat, "Progressing",
                   f"GPU {m.g.uuid} on {m.g.node}: {m.st['phase'].lower()}: {message}")
        self.api.patch_node(m.g.node, {f"gpuslice.io/reconfig.{label_key(m.g.uuid)}":
                                       m.st["phase"].lower()}, {})

    def _save(self, obj: dict[str, Any], status: dict[str, Any],
              gstat: dict[str, dict[str, Any]], condition: str, message: str) -> None:
        status = dict(status)
        status["gpus"] = gstat
        conds = [c for c in status.get("conditions", []) if c.get("type") != "Ready"]
        ready = {"type": "Ready", "status": "True" if condition == "Done" else "False",
                 "reason": condition, "message": message,
                 "lastTransitionTime": now_text(self.clock())}
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
