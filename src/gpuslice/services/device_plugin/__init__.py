"""The kubelet device plugin of the node agent (API v1beta1, gRPC over unix sockets).

It serves ``gpuslice.io/gpu`` as ``replicas`` virtual devices per healthy GPU (IDs
``<GPU UUID>::<k>``). The scheduler extender has already decided which GPU a pod gets and
written it as a signed assignment on the pod; the plugin steers the kubelet to that GPU in
GetPreferredAllocation and, in Allocate, finds the assignment it is executing: a verified
assignment for this node, on the GPUs of the devices the kubelet chose, not yet executed (the
oldest first). Claiming it is one set insertion under a small lock, never a node-wide lock, and
every failure is a gRPC error with a reason that changes no state.

Start order follows the kubelet: serve the plugin socket first, then Register with
``kubelet.sock``; when ``kubelet.sock`` is recreated (a kubelet restart) register again.

Split by concern: ``config`` (configuration, resource names, device list strategies),
``state`` (devices, health, claims), ``admission`` (matching Allocate to an assignment),
``responses`` (Allocate's answers, the CDI spec), ``servicer`` (the gRPC API) and ``server``
(serving and registering with the kubelet).
"""

from gpuslice.services.device_plugin.admission import Admissions
from gpuslice.services.device_plugin.config import (
    CDI_ANNOTATION_PREFIX,
    CDI_KIND,
    CDI_VERSION,
    DEVICE_LIST_STRATEGIES,
    HEALTHY,
    RESOURCE,
    UNHEALTHY,
    VOLUME_MOUNTS_ROOT,
    PluginConfig,
    cdi_device_name,
    device_list_strategy,
    mig_resource_suffix,
    plugin_configs,
    wait_for,
)
from gpuslice.services.device_plugin.responses import Responses
from gpuslice.services.device_plugin.server import PluginServer, RegistrationRefused, log
from gpuslice.services.device_plugin.servicer import DevicePlugin
from gpuslice.services.device_plugin.state import PluginState, _Admission

__all__ = [
    "CDI_ANNOTATION_PREFIX",
    "CDI_KIND",
    "CDI_VERSION",
    "DEVICE_LIST_STRATEGIES",
    "HEALTHY",
    "RESOURCE",
    "UNHEALTHY",
    "VOLUME_MOUNTS_ROOT",
    "Admissions",
    "DevicePlugin",
    "PluginConfig",
    "PluginServer",
    "PluginState",
    "RegistrationRefused",
    "Responses",
    "_Admission",
    "cdi_device_name",
    "device_list_strategy",
    "log",
    "mig_resource_suffix",
    "plugin_configs",
    "wait_for",
]
