"""A fake of the C library under nvidia-ml-py: the real ``pynvml`` module (its wrappers, ctypes
structures, ``byref`` conventions and error classes) runs unchanged, and only the functions it
looks up in ``libnvidia-ml.so.1`` are replaced by Python ones with the C calling convention.
That is what lets the real NVML adapter be tested without a GPU: a call with the wrong number
of arguments, a structure passed by value where the C function takes a pointer, or an ID passed
where an index is expected fails here as it would on a node.

The modelled GPUs follow ../shared/reference/protocols.md (section 4.2: the H100's profile table
was measured through NVML with MIG disabled; the A100-80GB's is NVIDIA's). Only the behaviour the
adapter relies on is modelled: devices, MIG mode, GPU-instance profiles and placements, GPU and
compute instances, MIG devices, processes, utilisation and XID events.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import pynvml as n

SUCCESS = n.NVML_SUCCESS
INVALID = n.NVML_ERROR_INVALID_ARGUMENT
NOT_SUPPORTED = n.NVML_ERROR_NOT_SUPPORTED
NOT_FOUND = n.NVML_ERROR_NOT_FOUND
INSUFFICIENT_SIZE = n.NVML_ERROR_INSUFFICIENT_SIZE
INSUFFICIENT_RESOURCES = n.NVML_ERROR_INSUFFICIENT_RESOURCES
IN_USE = n.NVML_ERROR_IN_USE
TIMEOUT = n.NVML_ERROR_TIMEOUT

# (NVML profile index, profile ID, name suffix, compute slices, memory slices, memory MB, SMs,
#  max instances, starts) of the seven-slice GPUs
_H100_SXM = [
    (0, 19, "1g.10gb", 1, 1, 9984, 16, 7, (0, 1, 2, 3, 4, 5, 6)),
    (7, 20, "1g.10gb+me", 1, 1, 9984, 16, 1, (0, 1, 2, 3, 4, 5, 6)),
    (9, 15, "1g.20gb", 1, 2, 20096, 26, 4, (0, 2, 4, 6)),
    (1, 14, "2g.20gb", 2, 2, 20096, 32, 3, (0, 2, 4)),
    (2, 9, "3g.40gb", 3, 4, 40448, 60, 2, (0, 4)),
    (3, 5, "4g.40gb", 4, 4, 40448, 64, 1, (0,)),
    (4, 0, "7g.80gb", 7, 8, 81152, 132, 1, (0,)),
]
_A100_80 = [
    (0, 19, "1g.10gb", 1, 1, 9728, 14, 7, (0, 1, 2, 3, 4, 5, 6)),
    (7, 20, "1g.10gb+me", 1, 1, 9728, 14, 1, (0, 1, 2, 3, 4, 5, 6)),
    (9, 15, "1g.20gb", 1, 2, 19968, 14, 4, (0, 2, 4, 6)),
    (1, 14, "2g.20gb", 2, 2, 19968, 28, 3, (0, 2, 4)),
    (2, 9, "3g.40gb", 3, 4, 40192, 42, 2, (0, 4)),
    (3, 5, "4g.40gb", 4, 4, 40192, 56, 1, (0,)),
    (4, 0, "7g.80gb", 7, 8, 80896, 98, 1, (0,)),
]
# compute-instance profile index -> compute slices (NVML_COMPUTE_INSTANCE_PROFILE_*)
_CI_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7, 5: 8, 6: 6}

MIB = 1024 * 1024


@dataclass
class GpuInstance:
    gi_id: int
    profile_id: int
    start: int
    size: int
    slices: int
    cis: dict[int, int] = field(default_factory=dict)  # ci id -> ci profile id


@dataclass
class FakeGpu:
    name: str
    uuid: str
    memory_mib: int
    cc: tuple[int, int]
    profiles: list[tuple[int, int, str, int, int, int, int, int, tuple[int, ...]]] = \
        field(default_factory=list)
    mig: bool = False
    gis: dict[int, GpuInstance] = field(default_factory=dict)
    used_mib: int = 0
    util: int = 0
    pids: list[int] = field(default_factory=list)
    # per-process utilization samples: (pid, timestamp in us, SM %); served newer than asked
    samples: list[tuple[int, int, int]] = field(default_factory=list)
    events: list[int] = field(default_factory=list)  # pending XIDs

    def mig_devices(self) -> list[tuple[GpuInstance, int]]:
        """(GPU instance, compute instance id) in the order NVML enumerates MIG devices."""
        return [(gi, ci) for gi in sorted(self.gis.values(), key=lambda g: g.start)
                for ci in sorted(gi.cis)]


def h100(uuid: str = "GPU-h100-0000", mig: bool = False) -> FakeGpu:
    return FakeGpu("NVIDIA H100 80GB HBM3", uuid, 81559, (9, 0), list(_H100_SXM), mig)


def a100_80(uuid: str = "GPU-a100-0000", mig: bool = True) -> FakeGpu:
    return FakeGpu("NVIDIA A100-SXM4-80GB", uuid, 81920, (8, 0), list(_A100_80), mig)


def t4(uuid: str = "GPU-t4-0000") -> FakeGpu:
    return FakeGpu("Tesla T4", uuid, 15360, (7, 5))


def _int(arg: Any) -> int:
    """A C unsigned int argument: pynvml passes some as c_uint, some as Python ints."""
    return arg if isinstance(arg, int) else int(arg.value)


def _set(ref: Any, value: int) -> None:
    ref._obj.value = value


def _set_handle(ref: Any, addr: int) -> None:
    ctypes.c_void_p.from_buffer(ref._obj).value = addr


def _addr(handle: Any) -> int:
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


def _pointee(arg: Any, kind: type) -> Any:
    """The structure a C pointer argument points at; a structure passed by value (what
    ctypes does with a bare Structure and no argtypes) is an ABI error the real library would
    misread, so it is refused here."""
    if isinstance(arg, kind):
        raise TypeError(f"{kind.__name__} passed by value where the C function takes a pointer")
    obj = getattr(arg, "_obj", None)  # byref(x)
    if isinstance(obj, kind):
        return obj
    if hasattr(arg, "contents") and isinstance(arg.contents, kind):  # pointer(x)
        return arg.contents
    raise TypeError(f"expected a pointer to {kind.__name__}, got {type(arg).__name__}")


class FakeLibNvml:
    """The functions of libnvidia-ml.so.1 that the adapter reaches, over a few fake GPUs."""

    GPU, MIG, GI, CI, EVENTS = 0x1000, 0x2000, 0x3000, 0x4000, 0x5000

    def __init__(self, gpus: list[FakeGpu], driver: str = "580.159.04",
                 init_error: int = SUCCESS) -> None:
        self.gpus = gpus
        self.driver = driver
        self.init_error = init_error
        self.calls: list[str] = []
        self._registered: set[int] = set()

    def install(self, monkeypatch: Any) -> FakeLibNvml:
        """Make ``pynvml`` load this instead of the shared library."""
        monkeypatch.setattr(n, "nvmlLib", _Lib(self))
        monkeypatch.setattr(n, "_nvmlGetFunctionPointer_cache", {})
        return self

    # -- handles ------------------------------------------------------------------------------
    def _gpu(self, h: Any) -> FakeGpu | None:
        a = _addr(h)
        i = a - self.GPU
        return self.gpus[i] if 0 <= i < len(self.gpus) else None

    def _mig(self, h: Any) -> tuple[FakeGpu, GpuInstance, int] | None:
        a = _addr(h) - self.MIG
        if a < 0 or a >= 0x1000:
            return None
        g = self.gpus[a // 64]
        devs = g.mig_devices()
        return (g, *devs[a % 64]) if a % 64 < len(devs) else None

    def _gi(self, h: Any) -> tuple[FakeGpu, GpuInstance] | None:
        a = _addr(h) - self.GI
        if a < 0 or a >= 0x1000:
            return None
        g = self.gpus[a // 64]
        gi = g.gis.get(a % 64)
        return (g, gi) if gi else None

    def _ci(self, h: Any) -> tuple[FakeGpu, GpuInstance, int] | None:
        a = _addr(h) - self.CI
        if a < 0 or a >= 0x10000:
            return None
        g = self.gpus[a // 4096]
        gi = g.gis.get((a % 4096) // 64)
        ci = a % 64
        return (g, gi, ci) if gi and ci in gi.cis else None

    def _profile(self, g: FakeGpu, pid: int) -> Any:
        for p in g.profiles:
            if p[1] == pid:
                return p
        return None

    # -- the C functions ----------------------------------------------------------------------
    def nvmlInitWithFlags(self, flags: int) -> int:
        return self.init_error

    def nvmlShutdown(self) -> int:
        return SUCCESS

    def nvmlSystemGetDriverVersion(self, buf: Any, size: Any) -> int:
        buf.value = self.driver.encode()
        return SUCCESS

    def nvmlDeviceGetCount_v2(self, count: Any) -> int:
        _set(count, len(self.gpus))
        return SUCCESS

    def nvmlDeviceGetHandleByIndex_v2(self, index: Any, dev: Any) -> int:
        if not 0 <= index.value < len(self.gpus):
            return INVALID
        _set_handle(dev, self.GPU + index.value)
        return SUCCESS

    def nvmlDeviceGetHandleByUUID(self, uuid: Any, dev: Any) -> int:
        want = uuid.value.decode()
        for i, g in enumerate(self.gpus):
            if g.uuid == want:
                _set_handle(dev, self.GPU + i)
                return SUCCESS
        return NOT_FOUND

    def nvmlDeviceGetName(self, h: Any, buf: Any, size: Any) -> int:
        g = self._gpu(h)
        if g is not None:
            buf.value = g.name.encode()
            return SUCCESS
        m = self._mig(h)
        if m is None:
            return INVALID
        g, gi, _ = m
        buf.value = f"{g.name} MIG {self._profile(g, gi.profile_id)[2]}".encode()
        return SUCCESS

    def nvmlDeviceGetUUID(self, h: Any, buf: Any, size: Any) -> int:
        g = self._gpu(h)
        if g is not None:
            buf.value = g.uuid.encode()
            return SUCCESS
        m = self._mig(h)
        if m is None:
            return INVALID
        g, gi, ci = m
        buf.value = f"MIG-{g.uuid[4:]}-{gi.gi_id}-{ci}".encode()
        return SUCCESS

    def nvmlDeviceGetMemoryInfo(self, h: Any, mem: Any) -> int:
        g = self._gpu(h)
        if g is not None:
            total, used = g.memory_mib, g.used_mib
        else:
            m = self._mig(h)
            if m is None:
                return INVALID
            total, used = self._profile(m[0], m[1].profile_id)[5], 0
        mem._obj.total, mem._obj.used = total * MIB, used * MIB
        mem._obj.free = (total - used) * MIB
        return SUCCESS

    def nvmlDeviceGetCudaComputeCapability(self, h: Any, major: Any, minor: Any) -> int:
        g = self._gpu(h)
        if g is None:
            return INVALID
        _set(major, g.cc[0])
        _set(minor, g.cc[1])
        return SUCCESS

    def nvmlDeviceGetMigMode(self, h: Any, current: Any, pending: Any) -> int:
        g = self._gpu(h)
        if g is None:
            return INVALID
        if not g.profiles:
            return NOT_SUPPORTED
        _set(current, int(g.mig))
        _set(pending, int(g.mig))
        return SUCCESS

    def nvmlDeviceGetMaxMigDeviceCount(self, h: Any, count: Any) -> int:
        g = self._gpu(h)
        if g is None:
            return INVALID
        _set(count, 7 if g.profiles else 0)
        return SUCCESS

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: Any, index: Any, mig: Any) -> int:
        g = self._gpu(h)
        if g is None:
            return INVALID
        if not g.mig:
            return NOT_SUPPORTED
        if index.value >= len(g.mig_devices()):
            return NOT_FOUND
        _set_handle(mig, self.MIG + self.gpus.index(g) * 64 + index.value)
        return SUCCESS

    def nvmlDeviceGetGpuInstanceId(self, h: Any, out: Any) -> int:
        m = self._mig(h)
        if m is None:
            return NOT_SUPPORTED
        _set(out, m[1].gi_id)
        return SUCCESS

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, h: Any, dev: Any) -> int:
        m = self._mig(h)
        if m is None:
            return INVALID
        _set_handle(dev, self.GPU + self.gpus.index(m[0]))
        return SUCCESS

    def nvmlDeviceGetGpuInstanceById(self, h: Any, gi_id: Any, gi: Any) -> int:
        g = self._gpu(h)
        if g is None:
            return INVALID
        if not g.mig:
            return NOT_SUPPORTED
        want = _int(gi_id)
        if want not in g.gis:
            return NOT_FOUND
        _set_handle(gi, self.GI + self.gpus.index(g) * 64 + want)
        return SUCCESS

    def _profile_info(self, h: Any, index: Any, info: Any, v2: bool) -> int:
        g = self._gpu(h)
        if g is None:
            return INVALID
        idx = _int(index)
        if idx >= n.NVML_GPU_INSTANCE_PROFILE_COUNT - 1:
            return INVALID
        for p in g.profiles:
            if p[0] == idx:
                o = info._obj
                if v2 and o.version != n.nvmlGpuInstanceProfileInfo_v2:
                    return n.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
                o.id, o.sliceCount, o.instanceCount = p[1], p[3], p[7]
                o.multiprocessorCount, o.memorySizeMB, o.copyEngineCount = p[6], p[5], p[3]
                if v2:
                    o.name = f"MIG {p[2]}".encode()
                return SUCCESS
        return NOT_SUPPORTED

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h: Any, index: Any, info: Any) -> int:
        return self._profile_info(h, index, info, v2=False)

    def nvmlDeviceGetGpuInstanceProfileInfoV(self, h: Any, index: Any, info: Any) -> int:
        return self._profile_info(h, index, info, v2=True)

    def nvmlDeviceGetGpuInstancePossiblePlacements_v2(self, h: Any, pid: Any, arr: Any,
                                                      count: Any) -> int:
        g = self._gpu(h)
        if g is None:
            return INVALID
        p = self._profile(g, _int(pid))
        if p is None:
            return INVALID
        starts = p[8]
        if arr is None:
            _set(count, len(starts))
            return SUCCESS
        if count._obj.value < len(starts):
            _set(count, len(starts))
            return INSUFFICIENT_SIZE
        for k, s in enumerate(starts):
            arr[k].start, arr[k].size = s, p[4]
        _set(count, len(starts))
        return SUCCESS

    def nvmlDeviceGetGpuInstances(self, h: Any, pid: Any, arr: Any, count: Any) -> int:
        g = self._gpu(h)
        if g is None:
            return INVALID
        if not g.mig:
            return NOT_SUPPORTED
        want = _int(pid)
        gis = [gi for gi in sorted(g.gis.values(), key=lambda x: x.start)
               if gi.profile_id == want]
        if arr is None or len(arr) < len(gis):
            return INSUFFICIENT_SIZE if arr is not None else INVALID
        for k, gi in enumerate(gis):
            arr[k] = ctypes.cast(ctypes.c_void_p(self.GI + self.gpus.index(g) * 64 + gi.gi_id),
                                 n.c_nvmlGpuInstance_t)
        _set(count, len(gis))
        return SUCCESS

    def nvmlGpuInstanceGetInfo(self, gi: Any, info: Any) -> int:
        found = self._gi(gi)
        if found is None:
            return INVALID
        g, inst = found
        o = info._obj
        o.device = ctypes.cast(ctypes.c_void_p(self.GPU + self.gpus.index(g)), n.c_nvmlDevice_t)
        o.id, o.profileId = inst.gi_id, inst.profile_id
        o.placement.start, o.placement.size = inst.start, inst.size
        return SUCCESS

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, h: Any, pid: Any, placement: Any,
                                                 gi: Any) -> int:
        g = self._gpu(h)
        if g is None:
            return INVALID
        if not g.mig:
            return NOT_SUPPORTED
        pl = _pointee(placement, n.c_nvmlGpuInstancePlacement_t)
        p = self._profile(g, _int(pid))
        if p is None or pl.start not in p[8] or pl.size != p[4]:
            return INVALID
        mine = set(range(pl.start, pl.start + pl.size))
        for other in g.gis.values():
            if mine & set(range(other.start, other.start + other.size)):
                return INSUFFICIENT_RESOURCES
        if sum(x.profile_id == p[1] for x in g.gis.values()) >= p[7]:
            return INSUFFICIENT_RESOURCES
        gi_id = max(g.gis, default=0) + 1
        g.gis[gi_id] = GpuInstance(gi_id, p[1], pl.start, pl.size, p[3])
        _set_handle(gi, self.GI + self.gpus.index(g) * 64 + gi_id)
        self.calls.append(f"create {p[2]}@{pl.start}")
        return SUCCESS

    def nvmlGpuInstanceDestroy(self, gi: Any) -> int:
        found = self._gi(gi)
        if found is None:
            return INVALID
        g, inst = found
        if inst.cis:
            return IN_USE
        del g.gis[inst.gi_id]
        self.calls.append(f"destroy {self._profile(g, inst.profile_id)[2]}@{inst.start}")
        return SUCCESS

    def nvmlGpuInstanceGetComputeInstanceProfileInfoV(self, gi: Any, index: Any, eng: Any,
                                                      info: Any) -> int:
        found = self._gi(gi)
        if found is None:
            return INVALID
        idx = _int(index)
        slices = _CI_SLICES.get(idx)
        if slices is None or slices > found[1].slices:
            return NOT_SUPPORTED
        info._obj.id, info._obj.sliceCount = idx, slices
        info._obj.instanceCount = found[1].slices // slices
        return SUCCESS

    def nvmlGpuInstanceCreateComputeInstance(self, gi: Any, ci_pid: Any, ci: Any) -> int:
        found = self._gi(gi)
        if found is None:
            return INVALID
        g, inst = found
        want = _int(ci_pid)
        slices = _CI_SLICES.get(want)
        used = sum(_CI_SLICES[c] for c in inst.cis.values())
        if slices is None or used + slices > inst.slices:
            return INSUFFICIENT_RESOURCES
        ci_id = max(inst.cis, default=-1) + 1
        inst.cis[ci_id] = want
        _set_handle(ci, self.CI + self.gpus.index(g) * 4096 + inst.gi_id * 64 + ci_id)
        return SUCCESS

    def nvmlGpuInstanceGetComputeInstances(self, gi: Any, ci_pid: Any, arr: Any,
                                           count: Any) -> int:
        found = self._gi(gi)
        if found is None:
            return INVALID
        g, inst = found
        want = _int(ci_pid)
        cis = [c for c, p in sorted(inst.cis.items()) if p == want]
        if arr is None or len(arr) < len(cis):
            return INSUFFICIENT_SIZE if arr is not None else INVALID
        for k, c in enumerate(cis):
            arr[k] = ctypes.cast(ctypes.c_void_p(
                self.CI + self.gpus.index(g) * 4096 + inst.gi_id * 64 + c),
                n.c_nvmlComputeInstance_t)
        _set(count, len(cis))
        return SUCCESS

    def nvmlComputeInstanceDestroy(self, ci: Any) -> int:
        found = self._ci(ci)
        if found is None:
            return INVALID
        _, inst, c = found
        del inst.cis[c]
        return SUCCESS

    def nvmlDeviceGetComputeRunningProcesses_v3(self, h: Any, count: Any, arr: Any) -> int:
        g = self._gpu(h)
        if g is None:
            return INVALID
        if not g.pids:
            _set(count, 0)
            return SUCCESS
        if arr is None or count._obj.value < len(g.pids):
            _set(count, len(g.pids))
            return INSUFFICIENT_SIZE
        for k, pid in enumerate(g.pids):
            arr[k].pid, arr[k].usedGpuMemory = pid, 100 * MIB
        _set(count, len(g.pids))
        return SUCCESS

    def nvmlDeviceGetProcessUtilization(self, h: Any, arr: Any, count: Any, since: Any) -> int:
        """The samples newer than ``since`` (NVML: NOT_FOUND when there is none; a first
        call without a buffer asks for the count)."""
        g = self._gpu(h)
        if g is None:
            return INVALID
        ts = since.value if hasattr(since, "value") else int(since)
        new = [x for x in g.samples if x[1] > ts]
        if not new:
            return NOT_FOUND
        if arr is None or count._obj.value < len(new):
            _set(count, len(new))
            return INSUFFICIENT_SIZE
        for k, (pid, stamp, sm) in enumerate(new):
            arr[k].pid, arr[k].timeStamp, arr[k].smUtil, arr[k].memUtil = pid, stamp, sm, 0
        _set(count, len(new))
        return SUCCESS

    def nvmlDeviceGetUtilizationRates(self, h: Any, util: Any) -> int:
        g = self._gpu(h)
        if g is None:
            return INVALID
        if g.mig:
            return NOT_SUPPORTED
        util._obj.gpu, util._obj.memory = g.util, g.util // 2
        return SUCCESS

    def nvmlEventSetCreate(self, es: Any) -> int:
        _set_handle(es, self.EVENTS)
        return SUCCESS

    def nvmlDeviceRegisterEvents(self, h: Any, types: Any, es: Any) -> int:
        g = self._gpu(h)
        if g is None or _addr(es) != self.EVENTS:
            return INVALID
        if not types.value & n.nvmlEventTypeXidCriticalError:
            return INVALID
        self._registered.add(self.gpus.index(g))
        return SUCCESS

    def nvmlEventSetWait_v2(self, es: Any, data: Any, timeout_ms: Any) -> int:
        for i in sorted(self._registered):
            g = self.gpus[i]
            if g.events:
                o = data._obj
                o.device = ctypes.cast(ctypes.c_void_p(self.GPU + i), n.c_nvmlDevice_t)
                o.eventType = n.nvmlEventTypeXidCriticalError
                o.eventData = g.events.pop(0)
                return SUCCESS
        return TIMEOUT

    def nvmlEventSetFree(self, es: Any) -> int:
        return SUCCESS


class _Lib:
    """What ``CDLL('libnvidia-ml.so.1')`` would be: an attribute per exported function; an
    unknown name is an AttributeError, which pynvml turns into NVML_ERROR_FUNCTION_NOT_FOUND."""

    def __init__(self, fake: FakeLibNvml) -> None:
        self._fake = fake

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("nvml"):
            raise AttributeError(name)
        if name == "nvmlErrorString":
            return _ErrorString()
        fn = getattr(self._fake, name)  # AttributeError for functions not modelled
        fake = self._fake

        def call(*args: Any) -> int:
            fake.calls.append(name)
            return int(fn(*args))

        return call


_MESSAGES = {
    INVALID: "Invalid Argument", NOT_SUPPORTED: "Not Supported", NOT_FOUND: "Not Found",
    INSUFFICIENT_SIZE: "Insufficient Size", n.NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    TIMEOUT: "Timeout", IN_USE: "In use by another client",
    INSUFFICIENT_RESOURCES: "Insufficient Resources",
}


class _ErrorString:
    """nvmlErrorString: pynvml sets ``restype = c_char_p`` and gets bytes back."""

    restype: Any = None

    def __call__(self, code: int) -> bytes:
        return _MESSAGES.get(code, "Unknown Error").encode()
