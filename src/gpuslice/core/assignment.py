"""The assignment: the extender's decision for one pod, signed so a node agent can trust it.

An :class:`Assignment` names the node, and per container the GPUs (by UUID, or a MIG instance
with its placement), the milli-GPU and GPU memory of each, and the sharing mode; plus the pod's
identity and the bind time. :func:`sign` computes an HMAC-SHA256 over a canonical byte encoding
of all of it with a key shared by the extender and the node agents; :func:`verify` checks it in
constant time. A user who writes the annotation by hand cannot produce a valid MAC.

The canonical encoding is defined here (sorted, escaped ``key=value`` lines), independent of how
the annotation is serialised, so any JSON library can carry it. The JSON codec lives in
``gpuslice.adapters.kube.annotation``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from enum import StrEnum

from gpuslice.core.errors import ValidationError
from gpuslice.core.podrequest import ContainerKind, ContainerRequest, pod_requests

ANNOTATION = "gpuslice.io/assignment"
MAC_VERSION = "v1"


class Mode(StrEnum):
    EXCLUSIVE = "exclusive"
    MPS = "mps"
    MIG = "mig"
    TIMESLICE = "timeslice"


@dataclass(frozen=True, slots=True)
class GpuShare:
    """One GPU (or MIG instance) given to a container: its UUID, the share of it, and for MIG
    the GPU instance's profile and start slice."""

    uuid: str
    milli: int
    memory_mib: int
    mig_profile: str = ""
    mig_start: int = -1

    def __post_init__(self) -> None:
        if not self.uuid:
            raise ValidationError("assignment gpu uuid", "a GPU or MIG UUID", self.uuid)
        if not 1 <= self.milli <= 1000:
            raise ValidationError(f"assignment {self.uuid} milli", "1..1000", self.milli)
        if self.memory_mib < 0:
            raise ValidationError(f"assignment {self.uuid} memory_mib", ">= 0", self.memory_mib)
        if bool(self.mig_profile) != (self.mig_start >= 0):
            raise ValidationError(f"assignment {self.uuid} mig", "a MIG profile with its start",
                                  (self.mig_profile, self.mig_start))


@dataclass(frozen=True, slots=True)
class ContainerAssignment:
    """One container's GPUs. ``kind``: an app container, an init container or a sidecar
    (restartable init container); the kinds decide what the pod holds at once
    (:meth:`Assignment.held`)."""

    name: str
    mode: Mode
    gpus: tuple[GpuShare, ...]
    kind: ContainerKind = ContainerKind.APP

    def __post_init__(self) -> None:
        if not self.name:
            raise ValidationError("assignment container name", "a container name", self.name)
        if not self.gpus:
            raise ValidationError(f"assignment container {self.name} gpus", "at least one GPU",
                                  self.gpus)
        if self.mode is Mode.EXCLUSIVE and any(g.milli != 1000 for g in self.gpus):
            raise ValidationError(f"assignment container {self.name}",
                                  "whole GPUs (1000 milli) for exclusive mode",
                                  [g.milli for g in self.gpus])
        if self.mode is Mode.MIG and any(not g.mig_profile for g in self.gpus):
            raise ValidationError(f"assignment container {self.name}",
                                  "a MIG instance for every GPU in mig mode", self.gpus)


@dataclass(frozen=True, slots=True)
class Assignment:
    namespace: str
    pod: str
    pod_uid: str
    node: str
    containers: tuple[ContainerAssignment, ...]
    bind_time: str  # RFC 3339, passed in by the caller (the core reads no clock)
    mac: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for name in ("namespace", "pod", "pod_uid", "node", "bind_time"):
            if not getattr(self, name):
                raise ValidationError(f"assignment {name}", "a non-empty value",
                                      getattr(self, name))
        names = [c.name for c in self.containers]
        if not names or len(set(names)) != len(names):
            raise ValidationError("assignment containers", "one entry per container, unique names",
                                  names)

    def gpu_uuids(self) -> set[str]:
        return {g.uuid for c in self.containers for g in c.gpus}

    def held(self) -> dict[str, tuple[int, int]]:
        """(milli, MiB) the pod holds of each GPU at its peak, by the effective-request rule
        over its containers in order (an init container's GPU is reused by the app
        containers; sidecars and app containers add up)."""
        reqs = []
        for c in self.containers:
            r: dict[tuple[str, str], int] = {}
            for g in c.gpus:
                r[(g.uuid, "milli")] = r.get((g.uuid, "milli"), 0) + g.milli
                r[(g.uuid, "mib")] = r.get((g.uuid, "mib"), 0) + g.memory_mib
            reqs.append(ContainerRequest(c.name, c.kind, r))
        eff = pod_requests(reqs)
        return {u: (eff.get((u, "milli"), 0), eff.get((u, "mib"), 0))
                for u in sorted(self.gpu_uuids())}


def _esc(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace("=", "\\=")


def canonical(a: Assignment) -> bytes:
    """The bytes the MAC covers: every field but the MAC, one sorted ``key=value`` per line."""
    lines = [f"version={MAC_VERSION}"]
    for key in ("namespace", "pod", "pod_uid", "node", "bind_time"):
        lines.append(f"{key}={_esc(getattr(a, key))}")
    for c in sorted(a.containers, key=lambda c: c.name):
        prefix = f"container.{_esc(c.name)}"
        lines.append(f"{prefix}.mode={c.mode.value}")
        if c.kind is not ContainerKind.APP:  # app containers sign as before kinds existed
            lines.append(f"{prefix}.kind={c.kind.value},{a.containers.index(c)}")
        for i, g in enumerate(sorted(c.gpus, key=lambda g: g.uuid)):
            lines.append(f"{prefix}.gpu.{i}={_esc(g.uuid)},{g.milli},{g.memory_mib},"
                         f"{_esc(g.mig_profile)},{g.mig_start}")
    return "\n".join(sorted(lines)).encode()


def sign(a: Assignment, key: bytes) -> Assignment:
    """``a`` with its MAC set (HMAC-SHA256 over :func:`canonical`)."""
    if len(key) < 16:
        raise ValidationError("assignment key", "at least 16 bytes", len(key))
    mac = hmac.new(key, canonical(a), hashlib.sha256).hexdigest()
    return replace(a, mac=f"{MAC_VERSION}:{mac}")


def verify_any(a: Assignment, keys: Iterable[bytes]) -> bool:
    """True when ``a`` verifies under one of ``keys``: the current key and, during a key
    rotation, the previous one (running pods keep what the old key signed)."""
    return any(verify(a, k) for k in keys)


def verify(a: Assignment, key: bytes) -> bool:
    """True when ``a`` carries the MAC :func:`sign` gives it under ``key``."""
    if not a.mac.startswith(f"{MAC_VERSION}:") or len(key) < 16:
        return False
    want = hmac.new(key, canonical(a), hashlib.sha256).hexdigest()
    # as bytes: compare_digest refuses str with non-ASCII characters (a hand-written MAC)
    return hmac.compare_digest(a.mac.split(":", 1)[1].encode("utf-8", "surrogatepass"),
                               want.encode())
