"""What each pod uses of its share on a DRA node: the node agent's measurement
(:class:`gpuslice.services.pod_usage.PodUsage`, the one process-to-pod mapping of the node
side), with each container's share read from the claims this driver prepared.

A container's claims are named in its ``resources.claims`` (a claim of the pod, and
optionally one request of it); the pod's ``spec.resourceClaims`` entry of that name names the
ResourceClaim, directly (``resourceClaimName``) or, for a claim made from a template, through
``status.resourceClaimStatuses``. The checkpoint holds what each prepared claim got: a share
(its MPS thread % and memory), a MIG instance (its profile and start; the instance's memory,
or the MPS limit set on it) or a whole GPU (all of it, or the MPS limits its config set).
The kubelet's PodResources API would name the claims too, but not the pod's UID nor the
container's runtime ID, which the process's cgroup gives: the pod object has all three.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gpuslice.adapters.dra.checkpoint import COMPLETED
from gpuslice.core.assignment import GpuShare
from gpuslice.core.dra.slices import TYPE_MIG, TYPE_SHARE
from gpuslice.services.pod_usage import Device


def claims_of(pod: dict[str, Any], container: str) -> dict[str, str]:
    """The ResourceClaims ``container`` of ``pod`` uses: claim name -> the request it names
    ("" for all of the claim's). A claim whose generated name is not in the pod's status yet
    is left out."""
    spec = pod.get("spec") or {}
    by_name = {str(c.get("name")): c for c in spec.get("resourceClaims") or []
               if isinstance(c, dict)}
    made = {str(s.get("name")): s.get("resourceClaimName")
            for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
            if isinstance(s, dict)}
    out: dict[str, str] = {}
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        if not isinstance(c, dict) or c.get("name") != container:
            continue
        for used in (c.get("resources") or {}).get("claims") or []:
            ref = by_name.get(str(used.get("name")))
            if ref is None:
                continue
            claim = ref.get("resourceClaimName") or made.get(str(ref.get("name")))
            if claim:
                out[str(claim)] = str(used.get("request") or "")
    return out


def _size(profile: str) -> int:
    """The compute slices of a MIG profile (``3g.40gb`` -> 3; ``1c.3g.40gb``, a compute
    instance of one slice, -> 1)."""
    head = profile.split(".", 1)[0]
    digits = head.rstrip("cg")
    return int(digits) if digits.isdigit() else 1


def share_of_entry(e: dict[str, Any], dev: Device) -> GpuShare | None:
    """The share a prepared device (a checkpoint entry's device) gives on ``dev``, if it is
    that device."""
    if e.get("admin") or e.get("gpu") != dev.gpu:
        return None
    kind = e.get("type")
    if kind == TYPE_MIG:
        if (e.get("profile"), e.get("start")) != (dev.profile, dev.start) or not dev.profile:
            return None
        milli = max(1, 1000 * _size(dev.profile) // 7)  # as the extender's MIG shares
        return GpuShare(dev.gpu, milli, int(e.get("mpsMiB") or dev.memory_mib),
                        dev.profile, dev.start)
    if dev.profile:
        return None  # a share or whole GPU, while the process runs on a MIG instance
    if kind == TYPE_SHARE:
        return GpuShare(dev.gpu, int(e.get("threadPct") or 0) * 10,
                        int(e.get("memoryMiB") or 0))
    return GpuShare(dev.gpu, int(e.get("mpsPct") or 100) * 10,
                    int(e.get("mpsMiB") or dev.memory_mib))


class ClaimShares:
    """A container's share from the claims this driver prepared (``prepared``: the
    checkpoint's claims, UID -> entry, read at each call)."""

    def __init__(self, prepared: Callable[[], Mapping[str, dict[str, Any]]]) -> None:
        self.prepared = prepared

    def __call__(self, pod: dict[str, Any], container: str, dev: Device) -> GpuShare | None:
        wanted = claims_of(pod, container)
        if not wanted:
            return None
        ns = (pod.get("metadata") or {}).get("namespace", "default")
        for entry in self.prepared().values():
            name = entry.get("name")
            if entry.get("state") != COMPLETED or entry.get("namespace") != ns \
                    or name not in wanted:
                continue
            request = wanted[str(name)]
            for e in entry.get("devices") or []:
                if request and str(e.get("request", "")).split("/", 1)[0] != request:
                    continue
                share = share_of_entry(e, dev)
                if share is not None:
                    return share
        return None
