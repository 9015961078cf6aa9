"""The claims a prepare reads from the API server, within a deadline.

The kubelet gives up on a DRA call after 45 s (kubernetes pkg/kubelet/cm/dra/plugin/
dra_plugin.go) and calls again. A frozen API server (connections accepted, never answered)
held a prepare for 120 s: four attempts of the client's 30 s timeout, one after the other. So
the reads of one prepare share one deadline (``claim_read_timeout_s``): every claim is read in
parallel on this reader's own threads, the port is given the time left (the real client then
makes all its attempts within it), and the prepare stops waiting at the deadline whatever the
port does; a claim not read by then gets its own error, which the kubelet retries.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

from gpuslice.adapters.kube.fake import ApiNotFound, DraPort
from gpuslice.core.errors import GpusliceError
from gpuslice.services.dra_driver.config import ClaimError, ClaimRef

log = logging.getLogger("gpuslice.dra")


class ClaimReader:
    def __init__(self, api: DraPort, timeout_s: float, workers: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.api, self.timeout_s, self.clock = api, timeout_s, clock
        self._pool = futures.ThreadPoolExecutor(max_workers=max(1, workers),
                                                thread_name_prefix="dra-claim-read")

    def read(self, claims: list[ClaimRef]) -> dict[str, dict[str, Any] | GpusliceError]:
        """Claim UID -> the claim as checked by :func:`checked`, or why not, within
        ``timeout_s`` of the call for all of them."""
        deadline = self.clock() + self.timeout_s
        pending = {c.uid: self._pool.submit(self._read, c, deadline) for c in claims}
        out: dict[str, dict[str, Any] | GpusliceError] = {}
        for c in claims:
            fut = pending[c.uid]
            try:
                out[c.uid] = fut.result(timeout=max(0.0, deadline - self.clock()))
            except futures.TimeoutError:
                fut.cancel()  # not started yet (every thread busy): it never will
                out[c.uid] = ClaimError(
                    f"the API server did not answer within {self.timeout_s:g} s (the claim "
                    "could not be read; the kubelet tries again)")
            except GpusliceError as exc:
                out[c.uid] = exc
        return out

    def _read(self, c: ClaimRef, deadline: float) -> dict[str, Any]:
        left = deadline - self.clock()
        if left <= 0:
            raise ClaimError(f"the API server did not answer within {self.timeout_s:g} s")
        try:
            claim = self.api.get_resource_claim(c.namespace, c.name, timeout_s=left)
        except ApiNotFound:
            raise ClaimError("not found in the API server") from None
        return checked(c, claim)

    def close(self) -> None:
        """Reads under way finish on their own (within their deadline); queued ones are
        dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def checked(c: ClaimRef, claim: dict[str, Any]) -> dict[str, Any]:
    """The claim as the kubeletplugin helper checks it (draplugin.go,
    ``getResourceClaims``): it is the claim the kubelet means (same UID, else it "got
    replaced"), and it is allocated."""
    for part in ("metadata", "status"):
        if not isinstance(claim.get(part) or {}, dict):
            raise ClaimError(f"{part}: expected an object, got {type(claim[part]).__name__}")
    uid = (claim.get("metadata") or {}).get("uid")
    if uid != c.uid:
        raise ClaimError(f"got replaced: it has UID {uid}, the kubelet asked for {c.uid} "
                         "(the claim was deleted and recreated)")
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError("is not allocated")
    if not isinstance(allocation, dict):
        raise ClaimError(f"status.allocation: expected an object, got "
                         f"{type(allocation).__name__}")
    return claim
