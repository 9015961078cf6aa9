"""The claim allocator's scheduling gate, put on at admission (issue 58): a pod created with
one claim (or claim template) that the allocator places gets ``gpu.gpuslice.io/allocator``
in its ``spec.schedulingGates``, so kube-scheduler tries it once, after the allocator has
allocated its claim, instead of failing on devices tainted for the allocator and backing off.

What decides is :func:`gpuslice.adapters.kube.dra_gate.admission_patch`; this reads what it
needs from the API server: the pod's ResourceClaim, or the ResourceClaimTemplate its claim will
be made from, and whether the allocator's Lease is fresh (read at most once a second: while it
is stale, pods go ungated to kube-scheduler's own allocation). A read that fails leaves the pod
ungated (it is then placed as without the webhook, a little later), never refused. With
``cpu_only`` (the webhook's ``--gate-cpu-only``) a pod that names no claim is gated too when
the allocator places such pods (:func:`gpuslice.adapters.kube.cpu_pods.cpu_only_admission`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from gpuslice.adapters.kube.cpu_pods import cpu_only_admission, why_not_pinned
from gpuslice.adapters.kube.dra_gate import Admission, admission_patch
from gpuslice.adapters.kube.ports import ApiNotFound
from gpuslice.core.errors import GpusliceError
from gpuslice.services.dra_gate import lease_fresh

log = logging.getLogger("gpuslice.webhook")

ALLOCATOR_LEASE = ("gpuslice-system", "gpuslice-dra-allocator")
READ_TIMEOUT_S = 2.0  # each read's deadline: the API server's call to us waits for them
LEASE_TTL_S = 1.0  # the Lease read is reused this long


class GateReads(Protocol):
    def get_resource_claim(self, namespace: str, name: str,
                           timeout_s: float | None = None) -> dict[str, Any]: ...
    def get_resource_claim_template(self, namespace: str, name: str,
                                    timeout_s: float | None = None) -> dict[str, Any]: ...
    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None: ...


class DraGate:
    """Called by the review of a pod CREATE (on a worker thread: it reads the API server)."""

    def __init__(self, api: GateReads, lease: tuple[str, str] = ALLOCATOR_LEASE, *,
                 wall: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic, cpu_only: bool = False) -> None:
        self.api, self.lease, self.wall, self.clock = api, lease, wall, clock
        # gate pods that name no claim too, for the allocator to pin (adapters.kube.cpu_pods)
        self.cpu_only = cpu_only
        self._lease_read: tuple[float, bool] | None = None  # (clock, fresh)
        self.failures = 0  # reads that failed (the pod left ungated)

    def __call__(self, pod: Mapping[str, Any], namespace: str) -> Admission:
        spec = pod.get("spec")
        refs = spec.get("resourceClaims") if isinstance(spec, Mapping) else None
        if not refs:
            if not self.cpu_only:
                return Admission((), "the pod names no claim")
            if why_not_pinned(pod) is not None:  # no Lease read for a pod not to gate
                return cpu_only_admission(pod, lease_fresh=False)
            try:
                return cpu_only_admission(pod, lease_fresh=self._fresh())
            except GpusliceError as exc:
                return self._failed(f"the allocator's Lease {'/'.join(self.lease)} could "
                                    f"not be read: {exc}")
        if not isinstance(refs, list) or len(refs) != 1:
            return admission_patch(pod, [None, None], lease_fresh=False)
        try:
            claim = self._claim_spec(refs[0], namespace)
        except GpusliceError as exc:
            return self._failed(f"its claim could not be read: {exc}")
        if claim is None:  # the decision says why (a claim that does not exist)
            return admission_patch(pod, [None], lease_fresh=False)
        try:
            fresh = self._fresh()
        except GpusliceError as exc:
            return self._failed(f"the allocator's Lease {'/'.join(self.lease)} could not be "
                                f"read: {exc}")
        return admission_patch(pod, [claim], lease_fresh=fresh)

    def _claim_spec(self, ref: object, namespace: str) -> Mapping[str, Any] | None:
        """The spec of the claim the pod's reference names (a template's ``spec.spec``);
        None for a reference of the wrong shape or an object that does not exist."""
        if not isinstance(ref, Mapping):
            return None
        try:
            if isinstance(name := ref.get("resourceClaimName"), str):
                got = self.api.get_resource_claim(namespace, name, timeout_s=READ_TIMEOUT_S)
                spec = got.get("spec")
            elif isinstance(name := ref.get("resourceClaimTemplateName"), str):
                got = self.api.get_resource_claim_template(namespace, name,
                                                           timeout_s=READ_TIMEOUT_S)
                spec = (got.get("spec") or {}).get("spec")
            else:
                return None
        except ApiNotFound:
            return None
        return spec if isinstance(spec, Mapping) else None

    def _fresh(self) -> bool:
        now = self.clock()
        if self._lease_read is None or now - self._lease_read[0] >= LEASE_TTL_S:
            fresh = lease_fresh(self.api.get_lease(*self.lease), self.wall())
            self._lease_read = (now, fresh)
        return self._lease_read[1]

    def _failed(self, why: str) -> Admission:
        self.failures += 1
        log.warning("pod left ungated: %s", why, extra={"event": "gate-read-failed"})
        return Admission((), why)
