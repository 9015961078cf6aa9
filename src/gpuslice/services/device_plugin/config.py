"""The device plugin's configuration, resource names and device list strategies."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpuslice.adapters.mps import PIPE_DIR, SHM_DIR
from gpuslice.adapters.nvml.port import NvmlPort
from gpuslice.core.errors import ValidationError

RESOURCE = "gpuslice.io/gpu"
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"


@dataclass
class PluginConfig:
    node: str
    socket_dir: Path
    key: bytes
    replicas: int = 10  # virtual devices per GPU
    endpoint: str = "gpuslice-gpu.sock"
    mps_pipe_dir: str = PIPE_DIR
    # host directory mounted at /dev/shm in MPS clients: the daemons' /dev/shm ("" for none)
    mps_shm_dir: str = SHM_DIR
    # "none": the extender names the GPU (or instance); "single": every MIG instance is one
    # gpuslice.io/gpu; "mixed": one resource per MIG profile (gpuslice.io/mig-1g.10gb, ...)
    mig_strategy: str = "none"
    mig_profile: str = ""  # with "mixed": the profile this plugin serves
    resource: str = RESOURCE
    # how long Allocate keeps asking an API server that does not answer before it fails the
    # admission (the kubelet sets no deadline on Allocate; a failed one fails the pod): the
    # whole of it, a frozen server's unanswered connections included
    api_retry_s: float = 10.0
    # calls waiting on the API server at a time (Allocate, GetPreferredAllocation); one more
    # is answered at once, and ListAndWatch streams (at most ``streams``, a new one ends the
    # oldest) have threads of their own (grpc_limits.py)
    api_calls: int = 8
    streams: int = 4
    # the kubelet's PodResources socket: pods it has given this resource's devices to already
    # executed their assignment, even while still Pending (pulling an image); None: not asked
    pod_resources: Path | None = None
    # how Allocate names the devices to the container runtime (NVIDIA's device plugin's
    # names): "envvar" (NVIDIA_VISIBLE_DEVICES), "volume-mounts" (one /dev/null mount per
    # device under /var/run/nvidia-container-devices), "cdi-annotations" (the cdi.k8s.io/
    # annotation), "cdi-cri" (the CRI's CDI devices field); several may be combined
    device_list_strategy: tuple[str, ...] = ("envvar",)
    cdi_root: Path = Path("/var/run/cdi")  # where the CDI spec is written (cdi-* strategies)
    # where the NVIDIA device nodes are on the host (the CDI spec's hostPath; they keep their
    # /dev names in the container): another folder for fake GPUs with stand-in nodes
    dev_dir: Path = Path("/dev")
    # during an assignment-key rotation, the previous key: assignments it signed still verify
    previous_keys: tuple[bytes, ...] = ()


DEVICE_LIST_STRATEGIES = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
VOLUME_MOUNTS_ROOT = "/var/run/nvidia-container-devices"
CDI_KIND = "gpuslice.io/gpu"
CDI_VERSION = "1.0.0"
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"


def device_list_strategy(value: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The strategies named (comma-separated or a list), checked: NVIDIA's names only."""
    names = [v.strip() for v in (value.split(",") if isinstance(value, str) else value)
             if v.strip()]
    bad = [n for n in names if n not in DEVICE_LIST_STRATEGIES]
    if bad or not names:
        raise ValidationError("--device-list-strategy",
                              f"one or more of {', '.join(DEVICE_LIST_STRATEGIES)}",
                              value)
    return tuple(dict.fromkeys(names))


def mig_resource_suffix(profile: str) -> str:
    """A MIG profile as it appears in a resource name: NVIDIA's spelling, ``1g.10gb+me`` ->
    ``1g.10gb.me`` (``+`` is not allowed in a qualified name)."""
    return profile.replace("+", ".")


def cdi_device_name(device: str) -> str:
    """The CDI device name of a GPU or MIG UUID (CDI names: letters, digits, ``_.:-``)."""
    return re.sub(r"[^A-Za-z0-9_.:-]", "_", device)


def wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def plugin_configs(base: PluginConfig, nvml: NvmlPort) -> list[PluginConfig]:
    """The plugins a node runs: one for ``none`` and ``single``; for ``mixed`` one per MIG
    profile present, serving ``gpuslice.io/mig-<profile>`` on its own socket."""
    from dataclasses import replace

    if base.mig_strategy not in ("none", "single", "mixed"):
        from gpuslice.core.errors import ValidationError

        raise ValidationError("mig strategy", "none, single or mixed", base.mig_strategy)
    if base.mig_strategy != "mixed":
        return [base]
    profiles = sorted({m.profile for g in nvml.devices() for m in g.mig})
    return [replace(base, mig_profile=p, resource=f"gpuslice.io/mig-{mig_resource_suffix(p)}",
                    endpoint=f"gpuslice-mig-{mig_resource_suffix(p)}.sock") for p in profiles]
