"""CDI specs of the DRA driver's prepared claims (Container Device Interface, SPEC.md of
cncf-tags/container-device-interface): one transient spec file per claim under the dynamic
spec directory (``/var/run/cdi``), holding one CDI device per allocated device (and share),
written atomically, removed on unprepare; specs left by a crash are removed at start.

Fully-qualified IDs are ``k8s.gpu.gpuslice.io/claim=<claim UID>-<device>[-<share ID>]``: the
claim UID is never reused, so an ID never names two different preparations (the kubeletplugin
package's advice). The runtime (containerd with ``enable_cdi``, CRI-O) resolves the IDs the
kubelet passes in ``CDI_devices`` and applies the edits to the container.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuslice.adapters.files import remove_durably, write_atomic
from gpuslice.core.errors import ValidationError

CDI_VERSION = "0.6.0"  # env, deviceNodes with hostPath, mounts, names starting with digits
VENDOR = "k8s.gpu.gpuslice.io"
CLASS = "claim"
KIND = f"{VENDOR}/{CLASS}"
DYNAMIC_DIR = Path("/var/run/cdi")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*[A-Za-z0-9]$|^[A-Za-z0-9]$")


@dataclass(frozen=True)
class CdiDevice:
    """One CDI device of a claim: its edits (env ``K=V``, device nodes, bind mounts)."""

    name: str
    env: dict[str, str] = field(default_factory=dict)
    device_nodes: tuple[str, ...] = ()
    mounts: tuple[tuple[str, str], ...] = ()  # (host path, container path)
    # where ``device_nodes`` are on the host: another folder than /dev (stand-in nodes of fake
    # GPUs) keeps their /dev names in the container, the host's as hostPath
    dev_dir: str = "/dev"

    def qualified(self) -> str:
        return f"{KIND}={self.name}"

    def spec(self) -> dict[str, Any]:
        edits: dict[str, Any] = {}
        if self.env:
            edits["env"] = [f"{k}={v}" for k, v in sorted(self.env.items())]
        if self.device_nodes:
            edits["deviceNodes"] = [device_node(p, self.dev_dir) for p in self.device_nodes]
        if self.mounts:
            edits["mounts"] = [{"hostPath": h, "containerPath": c, "type": "none",
                                "options": ["rbind", "rw", "nosuid", "nodev"]}
                               for h, c in self.mounts]
        return {"name": self.name, "containerEdits": edits}


def device_node(host_path: str, dev_dir: str = "/dev") -> dict[str, str]:
    """A CDI ``deviceNodes`` entry: ``path`` in the container, ``hostPath`` when the node is
    elsewhere on the host (``<dev_dir>/nvidia0`` is ``/dev/nvidia0`` in the container)."""
    root = Path(dev_dir)
    if root == Path("/dev") or not Path(host_path).is_relative_to(root):
        return {"path": host_path}
    return {"path": str(Path("/dev") / Path(host_path).relative_to(root)),
            "hostPath": host_path}


def device_name(claim_uid: str, device: str, share_id: str = "") -> str:
    name = f"{claim_uid}-{device}" + (f"-{share_id}" if share_id else "")
    if not _NAME.match(name):
        raise ValidationError("CDI device name (claim UID, device, share ID)",
                              "letters, digits, '-', '_', '.' and ':' only", name)
    return name


class CdiSpecs:
    """The driver's spec files in ``directory``, one per claim UID."""

    PREFIX = f"{VENDOR}-{CLASS}_"

    def __init__(self, directory: Path = DYNAMIC_DIR) -> None:
        self.directory = Path(directory)

    def path(self, claim_uid: str) -> Path:
        return self.directory / f"{self.PREFIX}{claim_uid}.json"

    def write(self, claim_uid: str, devices: list[CdiDevice]) -> Path:
        """Write (or rewrite, identically) the claim's spec; the IDs to return are the
        devices' :meth:`CdiDevice.qualified` names."""
        if not devices:
            raise ValueError("a CDI spec needs at least one device")
        spec = {"cdiVersion": CDI_VERSION, "kind": KIND,
                "devices": [d.spec() for d in devices]}
        path = self.path(claim_uid)
        write_atomic(path, json.dumps(spec, indent=2, sort_keys=True).encode() + b"\n")
        return path

    def remove(self, claim_uid: str) -> bool:
        return remove_durably(self.path(claim_uid))

    def claims(self) -> set[str]:
        """Claim UIDs that have a spec here."""
        if not self.directory.is_dir():
            return set()
        return {p.name[len(self.PREFIX):-len(".json")]
                for p in self.directory.glob(f"{self.PREFIX}*.json")}

    def remove_stale(self, keep: set[str]) -> list[str]:
        """Remove the specs of claims not in ``keep`` (left by a crash); their UIDs."""
        gone = sorted(self.claims() - keep)
        for uid in gone:
            self.remove(uid)
        return gone
