"""The NVML port on nvidia-ml-py (``pynvml``): one choke point with lazy init and explained
errors. Used on GPU nodes; :func:`load` falls back to :class:`NullNvml` when there is no driver.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from ctypes import byref, c_uint
from typing import Any, TypeVar

from gpuslice.adapters.nvml.port import GpuProcess, HealthEvent, NullNvml, NvmlError, NvmlPort
from gpuslice.core import catalog
from gpuslice.core.catalog import MigProfile
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


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RealNvml:
    """NVML through ``pynvml``. Array-returning calls follow the C API: the caller sizes the
    array (from the profile's instance count) and passes it with a pointer to the count;
    structures the C side reads (a placement) go by pointer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nvml: Any = None
        self._events: Any = None
        self._profiles_of: dict[str, list[MigProfile]] = {}
        self._sm_seen: dict[str, int] = {}  # device -> the newest utilization sample read (us)

    def _lib(self) -> Any:
        with self._lock:
            if self._nvml is None:
                try:
                    import pynvml
                except ImportError:
                    from gpuslice.adapters.install import pip_install

                    raise NvmlError("nvidia-ml-py is not installed: "
                                    + pip_install("gpu")) from None
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
        return _text(self._call("nvmlSystemGetDriverVersion", lib.nvmlSystemGetDriverVersion))

    def why_empty(self) -> str:
        return "" if self.devices() else "NVML reports no GPU on this node"

    def devices(self) -> list[GpuDevice]:
        lib = self._lib()
        out: list[GpuDevice] = []
        for i in range(self._call("nvmlDeviceGetCount", lib.nvmlDeviceGetCount)):
            h = self._call("nvmlDeviceGetHandleByIndex", lib.nvmlDeviceGetHandleByIndex, i)
            name = _text(self._call("nvmlDeviceGetName", lib.nvmlDeviceGetName, h))
            uuid = _text(self._call("nvmlDeviceGetUUID", lib.nvmlDeviceGetUUID, h))
            mem = self._call("nvmlDeviceGetMemoryInfo", lib.nvmlDeviceGetMemoryInfo, h)
            cc = self._call("nvmlDeviceGetCudaComputeCapability",
                            lib.nvmlDeviceGetCudaComputeCapability, h)
            known = catalog.lookup(name)
            try:
                mig_mode = lib.nvmlDeviceGetMigMode(h)[0] == lib.NVML_DEVICE_MIG_ENABLE
            except lib.NVMLError:  # not MIG-capable: NVML_ERROR_NOT_SUPPORTED
                mig_mode = False
            # NVML has no SM count outside MIG: the catalogue's, else the whole-GPU profile's
            # (a lower bound: the A100's 7g profile has 98 of its 108 SMs)
            whole = max(self._profiles(uuid, h), key=lambda p: p.compute_slices, default=None)
            sms = known.sms if known else whole.sms if whole else None
            out.append(GpuDevice(
                i, uuid, name, known.name if known else name, int(mem.total // (1024 * 1024)),
                sms, (int(cc[0]), int(cc[1])), mig_mode,
                self._mig_devices(lib, h) if mig_mode else (),
            ))
        return out

    def pci_info(self, index: int) -> tuple[str, str]:
        """(PCI bus ID ``0000:3b:00.0``, PCIe root ``pci0000:3a``) of GPU ``index``: the bus ID
        from NVML, the root complex from the device's sysfs path (as the Go
        ``deviceattribute`` package of k8s.io/dynamic-resource-allocation derives it)."""
        import os

        lib = self._lib()
        h = self._call("nvmlDeviceGetHandleByIndex", lib.nvmlDeviceGetHandleByIndex, index)
        info = self._call("nvmlDeviceGetPciInfo", lib.nvmlDeviceGetPciInfo, h)
        bus = _text(info.busId).lower()
        if bus.count(":") == 2 and len(bus.split(":")[0]) == 8:  # NVML pads the domain
            bus = bus[4:]
        real = os.path.realpath(f"/sys/bus/pci/devices/{bus}")
        parts = real.split("/")
        root = next((x for x in parts if x.startswith("pci")), "") if "devices" in parts else ""
        return bus, root

    def _mig_devices(self, lib: Any, h: Any) -> tuple[MigInstance, ...]:
        out = []
        count = self._call("nvmlDeviceGetMaxMigDeviceCount", lib.nvmlDeviceGetMaxMigDeviceCount, h)
        for j in range(count):
            try:
                m = lib.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
            except lib.NVMLError:  # NVML_ERROR_NOT_FOUND: an empty slot
                continue
            uuid = _text(self._call("nvmlDeviceGetUUID", lib.nvmlDeviceGetUUID, m))
            mem = self._call("nvmlDeviceGetMemoryInfo", lib.nvmlDeviceGetMemoryInfo, m)
            name = _text(self._call("nvmlDeviceGetName", lib.nvmlDeviceGetName, m))
            try:  # the placement comes from the GPU instance the MIG device belongs to
                gi = lib.nvmlDeviceGetGpuInstanceById(h, lib.nvmlDeviceGetGpuInstanceId(m))
                start = int(lib.nvmlGpuInstanceGetInfo(gi).placement.start)
            except lib.NVMLError:  # needs a privileged caller: placement unknown
                start = -1
            out.append(MigInstance(uuid, name.split()[-1], start, int(mem.total // (1024 * 1024))))
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

    def processes(self, uuid: str) -> list[GpuProcess]:
        """nvmlDeviceGetComputeRunningProcesses and, where the driver has it,
        nvmlDeviceGetMPSComputeRunningProcesses (MPS clients), one entry per PID, with each
        one's SM utilization from nvmlDeviceGetProcessUtilization's samples since the last
        call for the device (none where the driver gives none)."""
        lib = self._lib()
        h = self._handle(uuid)
        sm = self._process_sm(uuid, h)
        found: dict[int, GpuProcess] = {}
        for name in ("nvmlDeviceGetComputeRunningProcesses",
                     "nvmlDeviceGetMPSComputeRunningProcesses"):
            fn = getattr(lib, name, None)
            if fn is None:
                continue
            try:
                procs = fn(h)
            except Exception as exc:  # pynvml's errors, and its NVMLLibraryMismatchError
                if name == "nvmlDeviceGetComputeRunningProcesses":
                    raise NvmlError(f"{name}({uuid}): {exc}") from None
                continue  # an older driver without the MPS listing
            for proc in procs:
                used = getattr(proc, "usedGpuMemory", None)
                found.setdefault(int(proc.pid), GpuProcess(
                    int(proc.pid), int(used) // (1 << 20) if isinstance(used, int) else None,
                    sm.get(int(proc.pid))))
        return sorted(found.values(), key=lambda x: x.pid)

    def _process_sm(self, uuid: str, h: Any) -> dict[int, float]:
        """PID -> SM utilization (%) from the samples newer than the last ones read for the
        device (nvmlDeviceGetProcessUtilization; its NOT_FOUND means no new sample)."""
        lib = self._lib()
        fn = getattr(lib, "nvmlDeviceGetProcessUtilization", None)
        if fn is None:
            return {}
        since = self._sm_seen.get(uuid, 0)
        try:
            samples = fn(h, since)
        except Exception:  # none since (NOT_FOUND), not supported here, or not in this driver
            return {}
        out: dict[int, float] = {}
        for s in samples:
            stamp = int(getattr(s, "timeStamp", 0))
            self._sm_seen[uuid] = max(self._sm_seen.get(uuid, 0), stamp)
            if stamp >= since:
                out[int(s.pid)] = float(getattr(s, "smUtil", 0))
        return out

    def usage(self, uuid: str) -> tuple[int, int]:
        lib = self._lib()
        h = self._handle(uuid)
        mem = self._call("nvmlDeviceGetMemoryInfo", lib.nvmlDeviceGetMemoryInfo, h)
        try:
            util = int(lib.nvmlDeviceGetUtilizationRates(h).gpu)
        except lib.NVMLError:  # not supported on MIG-enabled GPUs: 0, memory still counts
            util = 0
        return int(mem.used) // (1024 * 1024), util

    def mig_profiles(self, uuid: str) -> list[MigProfile]:
        return list(self._profiles(uuid, self._handle(uuid)))

    def _profiles(self, uuid: str, h: Any) -> list[MigProfile]:
        """The GPU-instance profiles NVML reports (with MIG enabled or not), with their possible
        placements; [] for a GPU that is not MIG-capable. Static, so read once per GPU."""
        if uuid in self._profiles_of:
            return self._profiles_of[uuid]
        lib = self._lib()
        out: list[MigProfile] = []
        for idx in range(lib.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = lib.nvmlDeviceGetGpuInstanceProfileInfo(h, idx)
            except lib.NVMLError:  # NOT_SUPPORTED on this SKU, INVALID_ARGUMENT past the last
                continue
            count = c_uint(0)
            self._call("nvmlDeviceGetGpuInstancePossiblePlacements",
                       lib.nvmlDeviceGetGpuInstancePossiblePlacements, h, info.id, None,
                       byref(count))
            places = (lib.c_nvmlGpuInstancePlacement_t * max(count.value, 1))()
            self._call("nvmlDeviceGetGpuInstancePossiblePlacements",
                       lib.nvmlDeviceGetGpuInstancePossiblePlacements, h, info.id, places,
                       byref(count))
            got = [places[k] for k in range(count.value)]
            out.append(MigProfile(
                int(info.id), _text(info.name).removeprefix("MIG "), int(info.sliceCount),
                int(got[0].size) if got else 0, int(info.memorySizeMB),
                int(info.multiprocessorCount), int(info.instanceCount),
                tuple(sorted(int(p.start) for p in got))))
        self._profiles_of[uuid] = out
        return out

    def _profile(self, uuid: str, h: Any, name: str) -> MigProfile:
        for p in self._profiles(uuid, h):
            if p.name == name:
                return p
        have = ", ".join(p.name for p in self._profiles(uuid, h)) or "none: not MIG-capable"
        raise NvmlError(f"GPU {uuid} has no MIG profile {name!r} (NVML lists {have})")

    def _instances(self, uuid: str) -> list[tuple[str, int, Any]]:
        """(profile name, placement start, GPU-instance handle) of the GPU's instances."""
        lib = self._lib()
        h = self._handle(uuid)
        out = []
        for prof in self._profiles(uuid, h):
            handles = (lib.c_nvmlGpuInstance_t * max(prof.max_instances, 1))()
            count = c_uint(len(handles))
            self._call("nvmlDeviceGetGpuInstances", lib.nvmlDeviceGetGpuInstances, h,
                       prof.profile_id, handles, byref(count))
            for k in range(count.value):
                info = self._call("nvmlGpuInstanceGetInfo", lib.nvmlGpuInstanceGetInfo,
                                  handles[k])
                out.append((prof.name, int(info.placement.start), handles[k]))
        return out

    def mig_layout(self, uuid: str) -> list[tuple[str, int]]:
        lib = self._lib()
        current, _pending = self._call("nvmlDeviceGetMigMode", lib.nvmlDeviceGetMigMode,
                                       self._handle(uuid))
        if current != lib.NVML_DEVICE_MIG_ENABLE:
            raise NvmlError(f"MIG mode is disabled on GPU {uuid}")
        return sorted((p, s) for p, s, _ in self._instances(uuid))

    def _compute_profiles(self, lib: Any, gi: Any) -> list[Any]:
        """The compute-instance profiles a GPU instance accepts (shared engines)."""
        out = []
        for idx in range(lib.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            try:
                out.append(lib.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, idx, lib.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED))
            except lib.NVMLError:  # larger than this GPU instance, or not on this SKU
                continue
        return out

    def destroy_instance(self, uuid: str, profile: str, start: int) -> None:
        lib = self._lib()
        for p, s, gi in self._instances(uuid):
            if (p, s) != (profile, start):
                continue
            for ci_prof in self._compute_profiles(lib, gi):  # compute instances go first
                cis = (lib.c_nvmlComputeInstance_t * max(int(ci_prof.instanceCount), 8))()
                count = c_uint(len(cis))
                self._call("nvmlGpuInstanceGetComputeInstances",
                           lib.nvmlGpuInstanceGetComputeInstances, gi, ci_prof.id, cis,
                           byref(count))
                for k in range(count.value):
                    self._call("nvmlComputeInstanceDestroy", lib.nvmlComputeInstanceDestroy,
                               cis[k])
            self._call("nvmlGpuInstanceDestroy", lib.nvmlGpuInstanceDestroy, gi)
            return
        raise NvmlError(f"GPU {uuid} has no {profile} instance at {start}")

    def create_instance(self, uuid: str, profile: str, start: int) -> None:
        lib = self._lib()
        h = self._handle(uuid)
        prof = self._profile(uuid, h, profile)
        if start not in prof.starts:
            raise NvmlError(f"{profile} cannot start at memory slice {start} on GPU {uuid} "
                            f"(NVML allows {', '.join(map(str, prof.starts))})")
        placement = lib.c_nvmlGpuInstancePlacement_t(start, prof.memory_slices)
        gi = self._call(f"nvmlDeviceCreateGpuInstanceWithPlacement({profile}@{start})",
                        lib.nvmlDeviceCreateGpuInstanceWithPlacement, h, prof.profile_id,
                        byref(placement))
        # one compute instance spanning the GPU instance (what nvidia-smi mig -cgi ... -C does)
        fits = [c for c in self._compute_profiles(lib, gi)
                if int(c.sliceCount) <= prof.compute_slices]
        try:
            if not fits:
                raise NvmlError(f"NVML offers no compute-instance profile for {profile}")
            whole = max(fits, key=lambda c: int(c.sliceCount))
            self._call("nvmlGpuInstanceCreateComputeInstance",
                       lib.nvmlGpuInstanceCreateComputeInstance, gi, whole.id)
        except NvmlError:  # leave no GPU instance without a compute instance behind
            self._call("nvmlGpuInstanceDestroy", lib.nvmlGpuInstanceDestroy, gi)
            raise

    def minor_number(self, uuid: str) -> int:
        lib = self._lib()
        return int(self._call("nvmlDeviceGetMinorNumber", lib.nvmlDeviceGetMinorNumber,
                              self._handle(uuid)))

    def mig_cap_minors(self, gpu_uuid: str, mig_uuid: str) -> tuple[int, int]:
        from gpuslice.adapters.nvml.caps import mig_cap_minors

        lib = self._lib()
        m = self._handle(mig_uuid)  # NVML hands out MIG device handles by UUID too
        gi = int(self._call("nvmlDeviceGetGpuInstanceId", lib.nvmlDeviceGetGpuInstanceId, m))
        ci = int(self._call("nvmlDeviceGetComputeInstanceId",
                            lib.nvmlDeviceGetComputeInstanceId, m))
        return mig_cap_minors(self.minor_number(gpu_uuid), gi, ci)

    def set_timeslice(self, uuid: str, level: int) -> None:
        """pynvml exposes no bare-metal time-slice call (nvmlDeviceSetVgpuSchedulerState is
        vGPU only), so this runs ``nvidia-smi compute-policy --set-timeslice`` as NVIDIA's
        DRA driver does."""
        import subprocess

        cmd = ["nvidia-smi", "compute-policy", "-i", uuid, "--set-timeslice", str(level)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=30,
                                  check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise NvmlError(f"{' '.join(cmd)} failed: {exc} (usual cause: nvidia-smi is not in "
                            "the driver container; fix: mount the host's driver binaries)"
                            ) from None
        if done.returncode != 0:
            raise NvmlError(f"{' '.join(cmd)} failed ({done.returncode}): "
                            f"{(done.stderr or done.stdout).strip()[:300]}")

    def events(self, timeout_s: float) -> list[HealthEvent]:
        lib = self._lib()
        if self._events is None:
            self._events = self._call("nvmlEventSetCreate", lib.nvmlEventSetCreate)
            for i in range(self._call("nvmlDeviceGetCount", lib.nvmlDeviceGetCount)):
                h = lib.nvmlDeviceGetHandleByIndex(i)
                try:
                    lib.nvmlDeviceRegisterEvents(h, lib.nvmlEventTypeXidCriticalError,
                                                 self._events)
                except lib.NVMLError:  # some GPUs do not report XIDs: health stays polled
                    continue
        try:
            data = lib.nvmlEventSetWait_v2(self._events, int(timeout_s * 1000))
        except Exception as exc:
            if "Timeout" in type(exc).__name__:
                return []
            raise _explain(exc, "nvmlEventSetWait") from None
        uuid = _text(lib.nvmlDeviceGetUUID(data.device))
        return [HealthEvent(uuid, int(data.eventData), "XID critical error")]


def load() -> NvmlPort:
    """The real NVML when a driver answers, else the null one with the reason."""
    real = RealNvml()
    try:
        real.driver_version()
    except NvmlError as exc:
        return NullNvml(str(exc))
    return real


class LateNvml:
    """The NVML of a node whose driver may load after the agent started (an operator-managed
    driver after a reboot): the null NVML with its reason until :meth:`reload` finds the
    driver answering, the real one from then on. The port's calls go to whichever it holds."""

    def __init__(self, loader: Callable[[], NvmlPort] = load) -> None:
        self._load = loader
        self.inner: NvmlPort = loader()

    @property
    def waiting(self) -> bool:
        """Whether NVML has not answered yet."""
        return isinstance(self.inner, NullNvml)

    def reload(self) -> bool:
        """Try NVML again while it has not answered; whether it answers now (first time)."""
        if not self.waiting:
            return False
        found = self._load()
        if isinstance(found, NullNvml):
            self.inner = found  # the latest reason
            return False
        self.inner = found
        return True

    def driver_version(self) -> str:
        return self.inner.driver_version()

    def devices(self) -> list[GpuDevice]:
        return self.inner.devices()

    def events(self, timeout_s: float) -> list[HealthEvent]:
        return self.inner.events(timeout_s)

    def why_empty(self) -> str:
        return self.inner.why_empty()

    def clients(self, uuid: str) -> int:
        return self.inner.clients(uuid)

    def processes(self, uuid: str) -> list[GpuProcess]:
        return self.inner.processes(uuid)

    def usage(self, uuid: str) -> tuple[int, int]:
        return self.inner.usage(uuid)

    def mig_layout(self, uuid: str) -> list[tuple[str, int]]:
        return self.inner.mig_layout(uuid)

    def mig_profiles(self, uuid: str) -> list[MigProfile]:
        return self.inner.mig_profiles(uuid)

    def destroy_instance(self, uuid: str, profile: str, start: int) -> None:
        self.inner.destroy_instance(uuid, profile, start)

    def create_instance(self, uuid: str, profile: str, start: int) -> None:
        self.inner.create_instance(uuid, profile, start)

    def minor_number(self, uuid: str) -> int:
        return self.inner.minor_number(uuid)

    def mig_cap_minors(self, gpu_uuid: str, mig_uuid: str) -> tuple[int, int]:
        return self.inner.mig_cap_minors(gpu_uuid, mig_uuid)

    def set_timeslice(self, uuid: str, level: int) -> None:
        self.inner.set_timeslice(uuid, level)

    def pci_info(self, index: int) -> tuple[str, str]:
        pci = getattr(self.inner, "pci_info", None)
        if pci is None:
            raise NvmlError(f"no GPU {index}: {self.why_empty()}")
        a, b = pci(index)
        return str(a), str(b)
