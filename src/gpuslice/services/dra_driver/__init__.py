"""gpuslice's DRA driver (``gpuslice dra-driver``, a node DaemonSet): the kubelet plugin of
Dynamic Resource Allocation for driver ``gpu.gpuslice.io``.

What the Go ``kubeletplugin`` helper does for drivers written in Go is done here:

- **registration**: ``pluginregistration.Registration`` on
  ``<kubelet>/plugins_registry/<driver>-reg.sock`` answers GetInfo with type ``DRAPlugin``, the
  DRA socket, and the versions ``v1.DRAPlugin``, ``v1beta1.DRAPlugin``,
  ``v1alpha1.DRAResourceHealth`` (the kubelet takes the first it supports);
- **the DRA service** (v1 and v1beta1) and the health stream on
  ``<kubelet>/plugins/<driver>/dra.sock``, with gRPC keepalive so that an idle kubelet
  connection is noticed (dra-example-driver#126, kubernetes#133920);
- **prepare / unprepare**, serialized: each claim is read from the API server (its UID must
  match: a claim deleted and recreated under the same name is another claim), within one
  deadline for the prepare (``claim_read_timeout_s``: a frozen API server gets the claim an
  error the kubelet retries, well before the kubelet's own 45 s), only this driver's results
  are handled, every claim gets its own answer or error, a repeated prepare gives the same
  answer and an unprepare of an unknown claim succeeds; an unprepare needs no API server and
  never waits behind prepares (their gRPC threads are bounded apart, ``services.grpc_limits``);
- **a checkpoint** (``adapters.dra.checkpoint``) written before any effect and after the last,
  so that a restart mid-flight neither loses a preparation nor gives its devices twice;
- **CDI specs** (``adapters.dra.cdi``), one per claim, removed on unprepare, stale ones
  removed at start;
- **ResourceSlices** of the node's pool (``core.dra.pool_slices``), republished with a new
  pool generation when the devices or their health change.

The three models' effects on prepare: a **share** (consumable capacity) becomes MPS caps for
its clients (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` from its consumed ``compute``,
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` from its ``memory``) under the GPU's one MPS control
daemon, refused when the shares prepared on that GPU would over-commit it; a **MIG** device
is created through the MIG executor (and destroyed on unprepare); a **whole GPU** is handed
over, exclusive unless its GpuConfig says TimeSlicing or MPS.

The modules: :mod:`.config` (the configuration and names), :mod:`.claims` (the claim reads
within a deadline), :mod:`.plan` (what an allocation means on this node), :mod:`.effects`
(MPS, MIG, time-slices, CDI devices), :mod:`.slices` (feature detection and the pool's
ResourceSlices), :mod:`.driver` (:class:`DraDriver`, the state and decisions),
:mod:`.server` (the gRPC servicers, :class:`DraServer` and :func:`run`).
"""

from gpuslice.services.dra_driver.claims import ClaimReader
from gpuslice.services.dra_driver.config import (
    APPLICATION_XIDS,
    KEEPALIVE_OPTIONS,
    PLUGIN_TYPE,
    SUPPORTED_VERSIONS,
    ClaimError,
    ClaimRef,
    DraConfig,
    parse_modes,
)
from gpuslice.services.dra_driver.driver import DraDriver
from gpuslice.services.dra_driver.server import (
    DraServer,
    DraV1,
    DraV1beta1,
    Health,
    Registration,
    run,
)
from gpuslice.services.dra_driver.slices import SlicePublisher, detect_features, pci_of

__all__ = [
    "APPLICATION_XIDS", "KEEPALIVE_OPTIONS", "PLUGIN_TYPE", "SUPPORTED_VERSIONS", "ClaimError",
    "ClaimReader", "ClaimRef", "DraConfig", "DraDriver", "DraServer", "DraV1", "DraV1beta1",
    "Health", "Registration", "SlicePublisher", "detect_features", "parse_modes", "pci_of",
    "run",
]
