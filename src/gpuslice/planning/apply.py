"""Applying a re-plan without dropping traffic: ``gpuslice replan --apply``.

The planner's manifests give each planned slice its own Deployment (``SERVICE-gGPU-PROFILE-START``,
one replica), so a re-plan's diff is a set of Deployments to add and a set to remove. They are
applied in the order that never lowers a service's capacity below what it has:

1. the added Deployments are created, and their pods must run and be ready (the scheduler and
   extender place them; a timeout stops here, and nothing is removed);
2. the pods of the removed Deployments get ``gpuslice.io/draining``: routers stop sending them
   requests and let in-flight ones finish; the router's admin API is asked until none is
   outstanding (or the drain timeout passes);
3. the removed Deployments are deleted.

Every step is idempotent (an existing Deployment is kept, a missing one is not an error), so an
interrupted apply can simply be run again.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from gpuslice.adapters.http.router_admin import RouterPort
from gpuslice.adapters.kube.fake import ApiConflict, ApiNotFound, ClusterPort
from gpuslice.adapters.kube.objects import DRAINING_ANNOTATION, DRAINING_LABEL
from gpuslice.core.errors import GpusliceError
from gpuslice.core.planner import Plan
from gpuslice.planning.export import manifests

REPLICA_LABEL = "gpuslice.io/replica"


def _deployments(plan: Plan, namespace: str, image: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in manifests(plan, namespace, image)
            if d["kind"] == "Deployment"}


def _ready(pod: dict[str, Any]) -> bool:
    st = pod.get("status") or {}
    return st.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in st.get("conditions") or [])


def apply_plan(api: ClusterPort, current: Plan, new: Plan, *, namespace: str,
               image: str = "REPLACE-WITH-YOUR-MODEL-SERVER-IMAGE",
               router: RouterPort | None = None, ready_timeout_s: float = 300.0,
               drain_timeout_s: float = 60.0, poll_s: float = 0.5,
               clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> list[str]:
    """Apply ``current`` -> ``new`` (see the module); returns what was done, a line each.
    Raises :class:`GpusliceError` when added slices do not become ready in time (nothing has
    been removed then)."""
    old = _deployments(current, namespace, image)
    want = _deployments(new, namespace, image)
    add = sorted(n for n in want if n not in old)
    remove = sorted(n for n in old if n not in want)
    done: list[str] = []
    existing = {d["metadata"]["name"] for d in api.list_deployments(namespace)}
    for name in add:
        if name not in existing:
            with contextlib.suppress(ApiConflict):
                api.create_deployment(want[name])
            done.append(f"created Deployment {namespace}/{name}")
    end = clock() + ready_timeout_s
    while add:
        pods = [p for p in api.list_pods() if (p["metadata"].get("namespace") == namespace)]
        ready = {(p["metadata"].get("labels") or {}).get(REPLICA_LABEL) for p in pods
                 if _ready(p)}
        missing = [n for n in add if n not in ready]
        if not missing:
            done.append(f"{len(add)} added slice(s) ready")
            break
        if clock() > end:
            raise GpusliceError(f"added slices not ready after {ready_timeout_s:.0f} s: "
                                f"{missing}; nothing was removed (run it again to go on)")
        sleep(poll_s)
    leaving = [p for p in api.list_pods() if p["metadata"].get("namespace") == namespace
               and (p["metadata"].get("labels") or {}).get(REPLICA_LABEL) in remove]
    for p in leaving:
        meta = p["metadata"]
        for _ in range(5):
            try:
                cur = api.get_pod(namespace, meta["name"])
                # the label too: routers on EndpointSlices list the draining pods by it
                api.patch_pod_metadata(namespace, meta["name"], {DRAINING_LABEL: "true"},
                                       {DRAINING_ANNOTATION: "true"},
                                       cur["metadata"]["resourceVersion"])
                break
            except ApiConflict:
                continue
            except ApiNotFound:
                break
    if leaving:
        names = [p["metadata"]["name"] for p in leaving]
        end = clock() + drain_timeout_s
        while clock() < end:
            left = router.outstanding(names) if router is not None else None
            if left == 0:
                break
            sleep(poll_s)
        done.append(f"drained {len(leaving)} pod(s) of the removed slices")
    for name in remove:
        api.delete_deployment(namespace, name)
        done.append(f"deleted Deployment {namespace}/{name}")
    return done
