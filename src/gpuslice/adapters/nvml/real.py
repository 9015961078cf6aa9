"""The NVML port on nvidia-ml-py (``pynvml``): one choke point with lazy init and explained
errors. Used on GPU nodes; :func:`load` falls back to :class:`NullNvml` when there is no driver.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from gpuslice.adapters.nvml.port import HealthEvent, NullNvml, NvmlError, NvmlPort
from gpuslice.core import catalog
from gpuslice.core.devices import GpuDevice, MigInstance

T = TypeVar("T")

# (NVML error name, the usual cause, how to fix) for the errors an agent meets in practice
_HINTS = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": ("libnvidia-ml.so is not on this node",
                                     "install the NVIDIA driver, or run the agent with the "
                                     "NVIDIA container toolkit's runtime"),
    "NVML_ERROR_DRIVER_NOT_LOADED": ("the NVIDIA kernel module is not loaded",
                                     "load it (modprobe nvidia) or reboot after the driver "
                                     "install"),
    "NVML_ERROR_NO_PERMISSION": ("the agent may not open /dev/nvidia*",
                                 "run it privileged or with the device nodes mounted"),
    "NVML_ERROR_GPU_IS_LOST": ("the GPU fell off the bus (often XID 79)",
                               "drain the node and reset or reboot it"),
    "NVML_ERROR_NOT_SUPPORTED": ("this GPU or driver does not support the call",
                                 "nothing: the agent skips the feature"),
}


def _explain(exc: Exception, what: str) -> NvmlError:
    # pynvml names its exceptions NVMLError_LibraryNotFound, ...; compare without separators
    name = type(exc).__name__.removeprefix("NVMLError_").replace("_", "").upper()
    for key, (cause, fix) in _HINTS.items():
        if name and key.removeprefix("NVML_ERROR_").replace("_", "") == name:
            return NvmlError(f"{what} failed: {exc} (usual cause: {cause}; fix: {fix})")
    return NvmlError(f"{what} failed: {exc}")


class RealNvml:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nvml: Any = None
        self._events: Any = None

    def _lib(self) -> Any:
        with self._lock:
            if self._nvml is None:
                try:
                    import pynvml
                except ImportError:
                    raise NvmlError("nvidia-ml-py is not installed: pip install "
                                    "'gpuslice[gpu]'") from None
                try:
                    pynvml.nvmlInit()
                except Exception as exc:  # pynvml raises dynamically created classes
                    raise _explain(exc, "nvmlInit") from None
                self._nvml = pynvml
            return self._nvml

    def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except Exception as exc:
            raise _explain(exc, what) from None

    def driver_version(self) -> str:
        lib = self._lib()
        v = self._call("nvmlSystemGetDriverVersion", lib.nvmlSystemGetDriverVersion)
        return v.decode() if isinstance(v, bytes) else str(v)

    def why_empty(self) -> str:
        return "" if self.devices() else "NVML reports no GPU on this node"

    def devices(self) -> list[GpuDevice]:
        lib = self._lib()
        out: list[GpuDevice] = []
        for i in range(self._call("nvmlDeviceGetCount", lib.nvmlDeviceGetCount)):
            h = self._call("nvmlDeviceGetHandleByIndex", lib.nvmlDeviceGetHandleByIndex, i)
            name = self._call("nvmlDeviceGetName", lib.nvmlDeviceGetName, h)
            name = name.decode() if isinstance(name, bytes) else str(name)
            uuid = self._call("nvmlDeviceGetUUID", lib.nvmlDeviceGetUUID, h)
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            mem = self._call("nvmlDeviceGetMemoryInfo", lib.nvmlDeviceGetMemoryInfo, h)
            cc = self._call("nvmlDeviceGetCudaComputeCapability",
                            lib.nvmlDeviceGetCudaComputeCapability, h)
            known = catalog.lookup(name)
            try:
                mig_mode = lib.nvmlDeviceGetMigMode(h)[0] == 1
            except Exception:  # not MIG-capable: NVML_ERROR_NOT_SUPPORTED
                mig_mode = False
            out.append(GpuDevice(
                i, uuid, name, known.name if known else name, int(mem.total // (1024 * 1024)),
                known.sms if known else None, (int(cc[0]), int(cc[1])), mig_mode,
                self._mig_instances(lib, h) if mig_mode else (),
            ))
        return out

    def _mig_instances(self, lib: Any, h: Any) -> tuple[MigInstance, ...]:
        out = []
        count = self._call("nvmlDeviceGetMaxMigDeviceCount", lib.nvmlDeviceGetMaxMigDeviceCount, h)
        for j in range(count):
            try:
                m = lib.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
            except Exception:  # empty slot
                continue
            uuid = self._call("nvmlDeviceGetUUID", lib.nvmlDeviceGetUUID, m)
            mem = self._call("nvmlDeviceGetMemoryInfo", lib.nvmlDeviceGetMemoryInfo, m)
            name = self._call("nvmlDeviceGetName", lib.nvmlDeviceGetName, m)
            text = name.decode() if isinstance(name, bytes) else str(name)
            out.append(MigInstance(uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                                   text.split()[-1], -1, int(mem.total // (1024 * 1024))))
        return tuple(out)

    def _handle(self, uuid: str) -> Any:
        lib = self._lib()
        return self._call("nvmlDeviceGetHandleByUUID", lib.nvmlDeviceGetHandleByUUID,
                          uuid.encode())

    def clients(self, uuid: str) -> int:
        lib = self._lib()
        procs = self._call("nvmlDeviceGetComputeRunningProcesses",
                           lib.nvmlDeviceGetComputeRunningProcesses, self._handle(uuid))
        return len(procs)

    def usage(self, uuid: str) -> tuple[int, int]:
        lib = self._lib()
        h = self._handle(uuid)
        mem = self._call("nvmlDeviceGetMemoryInfo", lib.nvmlDeviceGetMemoryInfo, h)
        try:
            util = int(lib.nvmlDeviceGetUtilizationRates(h).gpu)
        except Exception:  # not supported on MIG-enabled GPUs: report 0, memory still counts
            util = 0
        return int(mem.used) // (1024 * 1024), util

    def _profile_id(self, uuid: str, profile: str) -> int:
        name = self._call("nvmlDeviceGetName", self._lib().nvmlDeviceGetName, self._handle(uuid))
        model = catalog.lookup(name.decode() if isinstance(name, bytes) else str(name))
        if model is None or model.mig is None:
            raise NvmlError(f"GPU {uuid} ({name!r}) is not a MIG-capable model of the catalogue")
        return model.mig.profile(profile).profile_id

    def _instances(self, uuid: str) -> list[tuple[str, int, Any]]:
        lib = self._lib()
        h = self._handle(uuid)
        name = self._call("nvmlDeviceGetName", lib.nvmlDeviceGetName, h)
        model = catalog.lookup(name.decode() if isinstance(name, bytes) else str(name))
        if model is None or model.mig is None:
            return []
        out = []
        for prof in model.mig.profiles:
            try:
                gis = lib.nvmlDeviceGetGpuInstances(h, prof.profile_id)
            except Exception:  # profile not supported on this SKU
                continue
            for gi in gis:
                info = self._call("nvmlGpuInstanceGetInfo", lib.nvmlGpuInstanceGetInfo, gi)
                out.append((prof.name, int(info.placement.start), gi))
        return out

    def mig_layout(self, uuid: str) -> list[tuple[str, int]]:
        lib = self._lib()
        current, _pending = self._call("nvmlDeviceGetMigMode", lib.nvmlDeviceGetMigMode,
                                       self._handle(uuid))
        if current != 1:
            raise NvmlError(f"MIG mode is disabled on GPU {uuid}")
        return [(p, s) for p, s, _ in self._instances(uuid)]

    def destroy_instance(self, uuid: str, profile: str, start: int) -> None:
        lib = self._lib()
        for p, s, gi in self._instances(uuid):
            if (p, s) != (profile, start):
                continue
            cis = []
            for idx in range(8):  # compute instance profile indices
                try:
                    ci_info = lib.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, idx, 0)
                    cis.extend(lib.nvmlGpuInstanceGetComputeInstances(gi, ci_info.id))
                except Exception:  # no such compute profile on this instance
                    continue
            for ci in cis:
                self._call("nvmlComputeInstanceDestroy", lib.nvmlComputeInstanceDestroy, ci)
            self._call("nvmlGpuInstanceDestroy", lib.nvmlGpuInstanceDestroy, gi)
            return
        raise NvmlError(f"GPU {uuid} has no {profile} instance at {start}")

    def create_instance(self, uuid: str, profile: str, start: int) -> None:
        lib = self._lib()
        h = self._handle(uuid)
        pid = self._profile_id(uuid, profile)
        raw = self._call("nvmlDeviceGetName", lib.nvmlDeviceGetName, h)
        model = catalog.lookup(raw.decode() if isinstance(raw, bytes) else str(raw))
        size = model.mig.profile(profile).memory_slices if model and model.mig else 1
        placement = lib.c_nvmlGpuInstancePlacement_t()
        placement.start, placement.size = start, size
        gi = self._call("nvmlDeviceCreateGpuInstanceWithPlacement",
                        lib.nvmlDeviceCreateGpuInstanceWithPlacement, h, pid, placement)
        # one compute instance spanning the GPU instance (what nvidia-smi -cgi ... -C makes)
        for idx in (4, 3, 2, 1, 0, 6, 5):  # the largest compute profile that the GI accepts
            try:
                ci_info = lib.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, idx, 0)
                self._call("nvmlGpuInstanceCreateComputeInstance",
                           lib.nvmlGpuInstanceCreateComputeInstance, gi, ci_info.id)
                return
            except Exception:  # profile larger than this GPU instance
                continue
        raise NvmlError(f"created {profile}@{start} on {uuid} but no compute instance fits it")

    def events(self, timeout_s: float) -> list[HealthEvent]:
        lib = self._lib()
        if self._events is None:
            self._events = self._call("nvmlEventSetCreate", lib.nvmlEventSetCreate)
            for i in range(self._call("nvmlDeviceGetCount", lib.nvmlDeviceGetCount)):
                h = lib.nvmlDeviceGetHandleByIndex(i)
                try:
                    lib.nvmlDeviceRegisterEvents(h, lib.nvmlEventTypeXidCriticalError,
                                                 self._events)
                except Exception:  # some GPUs do not report XIDs: health stays polled
                    continue
        try:
            data = lib.nvmlEventSetWait_v2(self._events, int(timeout_s * 1000))
        except Exception as exc:
            if "Timeout" in type(exc).__name__:
                return []
            raise _explain(exc, "nvmlEventSetWait") from None
        uuid = lib.nvmlDeviceGetUUID(data.device)
        uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        return [HealthEvent(uuid, int(data.eventData), "XID critical error")]


def load() -> NvmlPort:
    """The real NVML when a driver answers, else the null one with the reason."""
    real = RealNvml()
    try:
        real.driver_version()
    except NvmlError as exc:
        return NullNvml(str(exc))
    return real
