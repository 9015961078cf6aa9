"""The DRA driver's configuration, constants and the names of what the kubelet asks for."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from gpuslice.adapters.mps import PIPE_DIR, SHM_DIR
from gpuslice.core import dra
from gpuslice.core.errors import GpusliceError, ValidationError

log = logging.getLogger("gpuslice.dra")

PLUGIN_TYPE = "DRAPlugin"  # pluginregistration/v1 constants.go
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth")
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})  # the application's fault, not the GPU's
# server-side keepalive: ping an idle kubelet connection, and accept the kubelet's pings
KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
)


@dataclass
class DraConfig:
    node: str
    kubelet_dir: Path = Path("/var/lib/kubelet")
    driver: str = dra.DRIVER
    cdi_dir: Path = Path("/var/run/cdi")
    state_dir: Path | None = None  # default: the plugin directory
    mps_pipe_dir: str = PIPE_DIR  # the node agent's: one daemon per GPU
    mps_shm_dir: str = SHM_DIR  # the daemons' /dev/shm, mounted there in clients ("": none)
    mps_binary: str = "nvidia-cuda-mps-control"
    # the daemons are started by `gpuslice mps-host` (its own DaemonSet) from the records this
    # driver writes, so that they outlive the driver's pod; False: the driver starts them
    mps_host: bool = False
    default_mode: str = dra.WHOLE
    modes: dict[str, str] = field(default_factory=dict)  # GPU index or UUID -> mode
    taints: bool = True  # unhealthy devices tainted (else left out of the slices)
    quiet_s: float = 60.0  # a GPU without a new XID for this long is healthy again
    health_timeout_s: int = 120  # health_check_timeout_seconds in the health stream
    # the complete list is sent again at least this often, so that the kubelet (which marks a
    # device Unknown once its last report is older than the timeout) never does; default a
    # quarter of the timeout
    health_resend_s: float | None = None
    dev_dir: str = "/dev"
    # the claim allocator's Lease (issue 21): while it is fresh our consumable-capacity
    # devices carry its taint; None: never taint
    allocator_lease: tuple[str, str] | None = ("gpuslice-system", "gpuslice-dra-allocator")
    lease_poll_s: float = 2.0  # how often the Lease is read
    resync_s: float = 10.0  # how often the pool is compared with the API server's
    # an API server outage: a prepare's claim reads (connection, reads and retries together)
    # answer within this, else the claim gets an error the kubelet retries; the kubelet gives
    # up on a call after 45 s (kubernetes pkg/kubelet/cm/dra/plugin/dra_plugin.go)
    claim_read_timeout_s: float = 20.0
    max_prepares: int = 16  # prepares at a time; one more is answered "busy" at once
    health_streams: int = 4  # health streams open at a time; a new one ends the oldest

    @property
    def health_resend(self) -> float:
        return self.health_resend_s or max(1.0, self.health_timeout_s / 4)

    @property
    def plugin_dir(self) -> Path:
        return self.kubelet_dir / "plugins" / self.driver

    @property
    def dra_socket(self) -> Path:
        return self.plugin_dir / "dra.sock"

    @property
    def registration_socket(self) -> Path:
        return self.kubelet_dir / "plugins_registry" / f"{self.driver}-reg.sock"

    @property
    def checkpoint_path(self) -> Path:
        return (self.state_dir or self.plugin_dir) / "checkpoint.json"


class ClaimError(GpusliceError):
    """This claim cannot be prepared; the message goes back to the kubelet for it alone."""


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    uid: str
    name: str


def parse_modes(items: list[str], field_name: str = "--gpu-mode") -> dict[str, str]:
    """``INDEX_OR_UUID=MODE`` items (``0=share``, ``GPU-abc=mig``)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, mode = item.partition("=")
        if not sep or not key.strip() or mode.strip() not in dra.MODES:
            raise ValidationError(field_name, f"INDEX_OR_UUID=MODE with MODE one of "
                                  f"{', '.join(dra.MODES)}", item)
        out[key.strip()] = mode.strip()
    return out

