"""Which pod and container a process belongs to, from its cgroup: the one process-to-pod
mapping of the node side (the node agent counting each pod's CUDA processes; the DRA driver's
node side uses the same function).

The kubelet puts every container in a cgroup under its pod's, named by the pod's UID:
``/kubepods/<qos>/pod<UID>/<container ID>`` with the cgroupfs driver,
``/kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<UID with _>.slice/
cri-containerd-<container ID>.scope`` with the systemd driver (cgroup v1 or v2). NVML names
processes by their PID in the host's PID namespace, so the reader must see the host's
``/proc`` (the node agent runs with ``hostPID``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
                  r"|[0-9a-f]{32})(?:\.slice)?$")
_RUNTIME_PREFIXES = ("cri-containerd-", "docker-", "crio-", "containerd-")


@dataclass(frozen=True, slots=True)
class PodProcess:
    pid: int
    pod_uid: str
    container_id: str  # "" when the cgroup names none (the pod's own cgroup)


def pod_of_cgroup(text: str) -> tuple[str, str] | None:
    """(pod UID, container ID) from the content of ``/proc/<pid>/cgroup``; None for a
    process that is no pod's."""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        parts = [p for p in path.split("/") if p]
        for i, part in enumerate(parts):
            m = _UID.search(part)
            if m is None:
                continue
            uid = m.group(1).replace("_", "-")
            cid = parts[i + 1] if i + 1 < len(parts) else ""
            for prefix in _RUNTIME_PREFIXES:
                cid = cid.removeprefix(prefix)
            return uid, cid.removesuffix(".scope")
    return None


def pod_of(pid: int, proc: Path = Path("/proc")) -> PodProcess | None:
    """The pod of process ``pid``; None when it has ended or belongs to no pod."""
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    found = pod_of_cgroup(text)
    return PodProcess(pid, *found) if found else None
