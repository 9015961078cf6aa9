"""MIG capability device nodes from ``/proc/driver/nvidia/capabilities``.

A process inside a container may use a MIG device only if it can open the capability device
nodes of the device's GPU instance and compute instance, ``/dev/nvidia-caps/nvidia-cap<N>``
(besides ``/dev/nvidiactl`` and the parent GPU's ``/dev/nvidia<minor>``). The driver
advertises their minor numbers in

    /proc/driver/nvidia/capabilities/gpu<GPU minor>/mig/gi<GI id>/access
    /proc/driver/nvidia/capabilities/gpu<GPU minor>/mig/gi<GI id>/ci<CI id>/access

as a ``DeviceFileMinor: <N>`` line (the same files NVIDIA's device plugin and container
toolkit read). ``<GPU minor>`` is NVML's minor number of the parent GPU
(``nvmlDeviceGetMinorNumber``), not its index.
"""

from __future__ import annotations

import re
from pathlib import Path

from gpuslice.adapters.nvml.port import NvmlError

PROC_CAPS = Path("/proc/driver/nvidia/capabilities")
CAPS_DIR = "nvidia-caps"  # under /dev
_MINOR = re.compile(r"^DeviceFileMinor:\s*(\d+)\s*$", re.MULTILINE)


def cap_minor(text: str, where: str) -> int:
    """The ``DeviceFileMinor`` of one capability ``access`` file."""
    m = _MINOR.search(text)
    if m is None:
        raise NvmlError(f"{where}: no 'DeviceFileMinor: <n>' line (is this an NVIDIA "
                        "capability file?)")
    return int(m.group(1))


def mig_cap_minors(gpu_minor: int, gi: int, ci: int,
                   root: Path = PROC_CAPS) -> tuple[int, int]:
    """(GPU-instance access minor, compute-instance access minor) of a MIG device."""
    gi_file = root / f"gpu{gpu_minor}" / "mig" / f"gi{gi}" / "access"
    ci_file = root / f"gpu{gpu_minor}" / "mig" / f"gi{gi}" / f"ci{ci}" / "access"
    out = []
    for f in (gi_file, ci_file):
        try:
            out.append(cap_minor(f.read_text(), str(f)))
        except OSError as exc:
            raise NvmlError(f"cannot read {f}: {exc} (usual cause: /proc/driver/nvidia is "
                            "not visible to the driver container; fix: run it with the host's "
                            "/proc/driver/nvidia mounted, as NVIDIA's plugins are)") from None
    return out[0], out[1]


def cap_node(dev_dir: str, minor: int) -> str:
    return f"{dev_dir.rstrip('/')}/{CAPS_DIR}/nvidia-cap{minor}"
