"""Dynamic Resource Allocation, the pure part: what gpuslice's DRA driver publishes and how it
reads what the scheduler allocated.

- :func:`pool_slices` turns a node's GPUs and the sharing model chosen per GPU into the
  ResourceSlice specs of the node's pool (``resource.k8s.io/v1``), within the API server's
  validation limits (:func:`slice_problems` checks them, from ``k8s.io/api`` resource/v1
  types.go, release-1.35). Three models:

  ``share``  one device per GPU with ``allowMultipleAllocations`` and consumable capacities
             ``memory`` and ``compute`` (percent of the SMs) with request policies: the
             scheduler hands out shares of it (KEP-5075), each result carrying a ``shareID``
             and its ``consumedCapacity``;
  ``mig``    one device per legal MIG placement, each consuming counters of its GPU's counter
             set (a counter per memory slice, one for the compute slices, one per profile
             whose instance limit the slices do not imply), so that any set of devices the
             scheduler can allocate together is a valid MIG layout (KEP-4815);
  ``whole``  one device per GPU, allocated to one claim (which pods may share: time-slicing).

- :func:`decode_config` decodes the opaque ``gpuslice.io/v1alpha1`` configs strictly.
- :func:`share_caps` turns a share's consumed capacity into MPS caps, and
  :func:`share_problems` refuses a share that would over-commit its GPU.

No I/O here: the driver (``gpuslice.services.dra_driver``) does the talking. The parts:
:mod:`.slices` (the pool's slices and their limits), :mod:`.config` (claim configuration
and shares), :mod:`.quantity` (quantities); this module names them all, as ``dra.X``.
"""

from __future__ import annotations

from gpuslice.core.dra.config import (
    CONFIG_KINDS,
    INTERVALS,
    Config,
    GpuConfig,
    MigConfig,
    MpsConfig,
    MpsSettings,
    ShareCaps,
    config_for,
    decode_config,
    share_caps,
    share_problems,
)
from gpuslice.core.dra.quantity import (
    canonical_quantity,
    mib_quantity,
    parse_quantity,
    semantic_spec,
)
from gpuslice.core.dra.slices import (
    ALLOCATOR_TAINT,
    ALLOCATOR_TAINT_VALUE,
    CONFIG_API_VERSION,
    DEVICE_NAME_MAX,
    DRIVER,
    MAX_ATTRIBUTE_VALUE,
    MAX_ATTRIBUTES_AND_CAPACITIES,
    MAX_CONSUMPTIONS_PER_DEVICE,
    MAX_COUNTER_SETS,
    MAX_COUNTERS_PER_SET,
    MAX_DEVICES,
    MAX_DEVICES_TAINTS_OR_COUNTERS,
    MAX_DOMAIN_LENGTH,
    MAX_ID_LENGTH,
    MAX_TAINTS,
    MAX_VALID_VALUES,
    MEMORY_STEP_MIB,
    MIG,
    MODES,
    POOL_NAME_MAX,
    SHARE,
    TYPE_GPU,
    TYPE_MIG,
    TYPE_SHARE,
    UNHEALTHY_TAINT,
    WHOLE,
    DeviceRef,
    Features,
    GpuFacts,
    PoolPlan,
    architecture,
    counter_set_name,
    mig_consumption,
    mig_counters,
    mig_device_name,
    pool_slices,
    semver,
    slice_problems,
)

__all__ = [
    "ALLOCATOR_TAINT",
    "ALLOCATOR_TAINT_VALUE",
    "CONFIG_API_VERSION",
    "CONFIG_KINDS",
    "DEVICE_NAME_MAX",
    "DRIVER",
    "INTERVALS",
    "MAX_ATTRIBUTES_AND_CAPACITIES",
    "MAX_ATTRIBUTE_VALUE",
    "MAX_CONSUMPTIONS_PER_DEVICE",
    "MAX_COUNTERS_PER_SET",
    "MAX_COUNTER_SETS",
    "MAX_DEVICES",
    "MAX_DEVICES_TAINTS_OR_COUNTERS",
    "MAX_DOMAIN_LENGTH",
    "MAX_ID_LENGTH",
    "MAX_TAINTS",
    "MAX_VALID_VALUES",
    "MEMORY_STEP_MIB",
    "MIG",
    "MODES",
    "POOL_NAME_MAX",
    "SHARE",
    "TYPE_GPU",
    "TYPE_MIG",
    "TYPE_SHARE",
    "UNHEALTHY_TAINT",
    "WHOLE",
    "Config",
    "DeviceRef",
    "Features",
    "GpuConfig",
    "GpuFacts",
    "MigConfig",
    "MpsConfig",
    "MpsSettings",
    "PoolPlan",
    "ShareCaps",
    "architecture",
    "canonical_quantity",
    "config_for",
    "counter_set_name",
    "decode_config",
    "mib_quantity",
    "mig_consumption",
    "mig_counters",
    "mig_device_name",
    "parse_quantity",
    "pool_slices",
    "semantic_spec",
    "semver",
    "share_caps",
    "share_problems",
    "slice_problems",
]
