"""What the DRA driver's upstream-rule tests share: the driver's slices and devices as the API
server holds them, a share claim, a claim's CDI spec and environment, the allocator's lease."""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime
from typing import Any

from gpuslice.core import dra
from tests.dra.conftest import NODE, Node, claim

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
CDI_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
LEASE = ("gpuslice-system", "gpuslice-dra-allocator")


def slices(node: Node) -> list[dict[str, Any]]:
    return node.api.list_resource_slices(dra.DRIVER, NODE)


def devices(node: Node) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in slices(node) for d in s["spec"].get("devices") or []}


def share(name: str, sid: str, compute: str, memory: str, device: str = "gpu-0",
          **kw: Any) -> dict[str, Any]:
    return claim(name, [{"request": "gpu", "device": device, "shareID": sid,
                         "consumedCapacity": {"compute": compute, "memory": memory}}], **kw)


def cdi_spec(node: Node, uid: str) -> dict[str, Any]:
    return dict(json.loads(node.driver.cdi.path(uid).read_text()))


def env(spec_device: dict[str, Any]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in spec_device["containerEdits"].get("env", []))


def renew(node: Node, seconds_ago: float, holder: str = "allocator-0") -> None:
    stamp = datetime.fromtimestamp(time.time() - seconds_ago, UTC).strftime(
        "%Y-%m-%dT%H:%M:%S.%fZ")
    cur = node.api.get_lease(*LEASE)
    node.api.put_lease(*LEASE, {"holderIdentity": holder, "leaseDurationSeconds": 15,
                                "renewTime": stamp},
                       cur["metadata"]["resourceVersion"] if cur else None)
