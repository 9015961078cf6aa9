"""The NVML port and its fake and null implementations."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from gpuslice.adapters.yamlfile import read_yaml
from gpuslice.core import catalog
from gpuslice.core.catalog import MigProfile
from gpuslice.core.devices import GpuDevice, MigInstance
from gpuslice.core.errors import Unavailable, ValidationError
from gpuslice.core.mig import parse_layout


class NvmlError(Unavailable):
    """An NVML failure, explained: what happened, the usual cause, how to fix it."""


@dataclass(frozen=True, slots=True)
class HealthEvent:
    uuid: str
    xid: int
    description: str


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A process with a CUDA context on a GPU or MIG instance: its PID as NVML reports it
    (the host's PID namespace), the device memory it uses and its share of the GPU's SMs
    over the last sample period, in percent (None where NVML cannot say: utilization
    samples are not given on every GPU, MIG instance or driver)."""

    pid: int
    used_mib: int | None = None
    sm_pct: float | None = None


class NvmlPort(Protocol):
    def driver_version(self) -> str: ...
    def devices(self) -> list[GpuDevice]: ...
    def events(self, timeout_s: float) -> list[HealthEvent]: ...
    def why_empty(self) -> str:
        """Why there are no devices ("" when there are)."""
        ...

    def clients(self, uuid: str) -> int:
        """Processes using the GPU now."""
        ...

    def processes(self, uuid: str) -> list[GpuProcess]:
        """The processes with a compute context on the GPU or MIG instance ``uuid``, MPS
        clients included (each client is a process of its own)."""
        ...

    def usage(self, uuid: str) -> tuple[int, int]:
        """(memory used in MiB, utilisation in % over the last sample period) of the GPU."""
        ...

    def mig_layout(self, uuid: str) -> list[tuple[str, int]]:
        """(profile name, start) of the GPU instances on a MIG-enabled GPU."""
        ...

    def mig_profiles(self, uuid: str) -> list[MigProfile]:
        """The GPU-instance profiles and their possible placements as the driver reports them
        (MIG enabled or not); [] for a GPU that is not MIG-capable."""
        ...

    def destroy_instance(self, uuid: str, profile: str, start: int) -> None: ...

    def create_instance(self, uuid: str, profile: str, start: int) -> None: ...

    def minor_number(self, uuid: str) -> int:
        """The GPU's device minor number (``/dev/nvidia<minor>``, nvmlDeviceGetMinorNumber)."""
        ...

    def mig_cap_minors(self, gpu_uuid: str, mig_uuid: str) -> tuple[int, int]:
        """Minor numbers of ``/dev/nvidia-caps/nvidia-cap<N>`` for the GPU instance and the
        compute instance of MIG device ``mig_uuid`` (see ``adapters.nvml.caps``)."""
        ...

    def set_timeslice(self, uuid: str, level: int) -> None:
        """The GPU's compute time-slice: 0 default, 1 short, 2 medium, 3 long (what
        ``nvidia-smi compute-policy --set-timeslice`` sets)."""
        ...


TIMESLICE_LEVELS = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}


class NullNvml:
    """No driver on this node: no devices, and the reason, instead of a crash loop."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def driver_version(self) -> str:
        return ""

    def devices(self) -> list[GpuDevice]:
        return []

    def events(self, timeout_s: float) -> list[HealthEvent]:
        return []

    def why_empty(self) -> str:
        return self.reason

    def clients(self, uuid: str) -> int:
        return 0

    def processes(self, uuid: str) -> list[GpuProcess]:
        return []

    def usage(self, uuid: str) -> tuple[int, int]:
        raise NvmlError(f"no GPU {uuid}: {self.reason}")

    def mig_layout(self, uuid: str) -> list[tuple[str, int]]:
        raise NvmlError(f"no GPU {uuid}: {self.reason}")

    def mig_profiles(self, uuid: str) -> list[MigProfile]:
        raise NvmlError(f"no GPU {uuid}: {self.reason}")

    def destroy_instance(self, uuid: str, profile: str, start: int) -> None:
        raise NvmlError(f"no GPU {uuid}: {self.reason}")

    def create_instance(self, uuid: str, profile: str, start: int) -> None:
        raise NvmlError(f"no GPU {uuid}: {self.reason}")

    def minor_number(self, uuid: str) -> int:
        raise NvmlError(f"no GPU {uuid}: {self.reason}")

    def mig_cap_minors(self, gpu_uuid: str, mig_uuid: str) -> tuple[int, int]:
        raise NvmlError(f"no GPU {gpu_uuid}: {self.reason}")

    def set_timeslice(self, uuid: str, level: int) -> None:
        raise NvmlError(f"no GPU {uuid}: {self.reason}")


# the model of ``--fake-gpus N``: a common MIG- and MPS-capable data-centre GPU
SIMULATED_MODEL = "A100-80GB"


def _short(value: object) -> object:
    """``value`` for an error message: its text cut short when it is long."""
    text = repr(value)
    return value if len(text) <= 80 else f"{text[:77]}..."


def _whole(value: object, field: str, *, low: int = 0, high: int | None = None) -> int:
    """``value``, a whole number from ``low`` to ``high`` (not a bool, a float or text)."""
    if (not isinstance(value, int) or isinstance(value, bool) or value < low
            or (high is not None and value > high)):
        span = f"from {low} to {high}" if high is not None else f">= {low}"
        raise ValidationError(field, f"a whole number {span}", _short(value))
    return value


def _processes(items: object, where: str) -> list[GpuProcess]:
    """An inventory's ``processes: [{pid, used_mib, sm}]`` of one GPU."""
    if not isinstance(items, list):
        raise ValidationError(where, "a list of {pid, used_mib, sm}", _short(items))
    out = []
    for j, x in enumerate(items):
        if not isinstance(x, dict) or "pid" not in x:
            raise ValidationError(f"{where}[{j}].pid", "a process ID", _short(x))
        sm = x.get("sm")
        out.append(GpuProcess(_whole(x["pid"], f"{where}[{j}].pid", low=1),
                              _whole(x.get("used_mib", 0), f"{where}[{j}].used_mib"),
                              None if sm is None else float(_whole(sm, f"{where}[{j}].sm",
                                                                   high=100))))
    return out


class FakeNvml:
    """GPUs from a YAML inventory, with faults injected by tests or listed in the file::

        driver: "580.95.05"
        gpus:
          - model: A100-80GB            # catalogue name; memory and SMs come from it
            mig: "3g.40gb@0,2g.20gb@4"  # optional: MIG enabled with these instances
            mig_enabled: true           # optional: MIG enabled (with no instance yet)
          - model: G2                   # not in the catalogue: give memory_mib
            memory_mib: 32768
            faults: [79]                # XID errors reported at start
            used_mib: 4096              # optional: memory in use and utilisation % (select)
            utilization: 35
            processes:                  # optional: CUDA processes (pid, MiB, SM %)
              - {pid: 4242, used_mib: 2000, sm: 20}
            minor: 4                    # optional: device minor (/dev/nvidia4), default index

    A MIG device's capability minors (``mig_cap_minors``) are made up (GPU instance
    ``1 + 100 * minor + 2 * (start + 1)``, its compute instance one more) but distinct per
    GPU, instance and level, as the real ones are."""

    def __init__(self, gpus: list[GpuDevice], driver: str = "580.95.05",
                 faults: list[HealthEvent] | None = None,
                 usage: dict[str, tuple[int, int]] | None = None) -> None:
        self._gpus = {g.uuid: g for g in gpus}
        self._order = [g.uuid for g in gpus]
        self._driver = driver
        self._pending = list(faults or [])
        self._cond = threading.Condition()
        self._clients: dict[str, int] = {}
        self._processes: dict[str, list[GpuProcess]] = {}
        # where the processes of a device come from when no test set them: the stand-in MPS
        # daemons' clients on a node with --fake-mps (adapters/mps/standin.py), as NVML
        # lists a real daemon's clients
        self.process_source: Callable[[str], list[GpuProcess]] | None = None
        self._usage: dict[str, tuple[int, int]] = dict(usage or {})
        self._create_failures: dict[str, int] = {}
        self._minors: dict[str, int] = {}
        self.timeslice: dict[str, int] = {}  # what set_timeslice set, per GPU
        self.timeslice_supported = True

    @classmethod
    def simulated(cls, count: int, model: str = SIMULATED_MODEL) -> FakeNvml:
        """``count`` simulated GPUs of ``model`` (``--fake-gpus N``): named and numbered as
        simulated so that nothing mistakes them for real ones."""
        m = catalog.resolve(model)
        gpus = [GpuDevice(i, f"GPU-simulated-{i:02d}", f"simulated {m.name}", m.name,
                          m.memory_mib, m.sms, m.compute_capability)
                for i in range(count)]
        return cls(gpus, "simulated")

    @classmethod
    def from_yaml(cls, path: Path | str, node: str = "node") -> FakeNvml:
        p = Path(path)
        doc = read_yaml(p, str(p), "a YAML inventory of fake GPUs")
        if not isinstance(doc, dict):
            raise ValidationError(f"{p}", "a YAML inventory: a mapping with 'gpus'",
                                  "an empty file" if doc is None else type(doc).__name__)
        items = doc.get("gpus")
        if not isinstance(items, list):
            raise ValidationError(f"{p}: gpus", "a list of GPUs",
                                  "nothing" if items is None else type(items).__name__)
        gpus: list[GpuDevice] = []
        faults: list[HealthEvent] = []
        usage: dict[str, tuple[int, int]] = {}
        minors: dict[str, int] = {}
        procs: dict[str, list[GpuProcess]] = {}
        for i, item in enumerate(items):
            where = f"{p}: gpus[{i}]"
            if not isinstance(item, dict) or "model" not in item:
                raise ValidationError(f"{where}.model", "a GPU model", _short(item))
            if not isinstance(item["model"], str) or not item["model"].strip():
                raise ValidationError(f"{where}.model", "a GPU model name", _short(item["model"]))
            memory = item.get("memory_mib")
            if memory is not None:
                memory = _whole(memory, f"{where}.memory_mib", low=1)
            try:
                model = catalog.resolve(item["model"], memory)
            except ValidationError as exc:  # "gpu model: expected a known model ..."
                raise ValidationError(f"{where}: {exc.field}", exc.expected, exc.got) from None
            uuid = item.get("uuid") or f"GPU-{node}-{i:02d}"
            if not isinstance(uuid, str):
                raise ValidationError(f"{where}.uuid", "a GPU UUID (text)", _short(uuid))
            if any(g.uuid == uuid for g in gpus):
                raise ValidationError(f"{where}.uuid", "a UUID no other GPU has", uuid)
            mig_enabled = item.get("mig_enabled", False)
            if not isinstance(mig_enabled, bool):
                raise ValidationError(f"{where}.mig_enabled", "true or false", _short(mig_enabled))
            text = item.get("mig") or ""
            if not isinstance(text, str):
                raise ValidationError(f"{where}.mig", "a MIG layout like '3g.40gb@0,2g.20gb@4'",
                                      _short(text))
            mig: tuple[MigInstance, ...] = ()
            if text or mig_enabled:
                if model.mig is None:
                    raise ValidationError(f"{where}.mig", "a MIG-capable model", model.name)
                try:
                    layout = parse_layout(model.mig, text)
                except ValidationError as exc:
                    raise ValidationError(f"{where}.mig", exc.expected, exc.got) from None
                mig = tuple(MigInstance(f"MIG-{uuid}-{pl.start}", pl.profile.name, pl.start,
                                        pl.profile.memory_mib) for pl in layout)
            gpus.append(GpuDevice(i, uuid, f"NVIDIA {model.name}", model.name, model.memory_mib,
                                  model.sms, model.compute_capability,
                                  bool(mig) or mig_enabled, mig))
            xids = item.get("faults") or []
            if not isinstance(xids, list):
                raise ValidationError(f"{where}.faults", "a list of XID numbers", _short(xids))
            for j, xid in enumerate(xids):
                x = _whole(xid, f"{where}.faults[{j}]")
                faults.append(HealthEvent(uuid, x, f"injected XID {x}"))
            if "used_mib" in item or "utilization" in item:
                usage[uuid] = (_whole(item.get("used_mib", 0), f"{where}.used_mib"),
                               _whole(item.get("utilization", 0), f"{where}.utilization",
                                      high=100))
            if "minor" in item:
                minors[uuid] = _whole(item["minor"], f"{where}.minor")
            if "processes" in item:
                procs[uuid] = _processes(item["processes"], f"{where}.processes")
        fake = cls(gpus, str(doc.get("driver", "580.95.05")), faults, usage)
        fake._minors.update(minors)
        fake._processes.update(procs)
        return fake

    def driver_version(self) -> str:
        return self._driver

    def devices(self) -> list[GpuDevice]:
        return [self._gpus[u] for u in self._order]

    def why_empty(self) -> str:
        return "" if self._order else "the fake inventory lists no GPU"

    def _gpu(self, uuid: str) -> GpuDevice:
        g = self._gpus.get(uuid)
        if g is None:
            raise NvmlError(f"no GPU {uuid} on this node")
        return g

    def clients(self, uuid: str) -> int:
        return self._clients.get(uuid, 0)

    def set_clients(self, uuid: str, n: int) -> None:
        self._clients[uuid] = n

    def processes(self, uuid: str) -> list[GpuProcess]:
        if uuid in self._processes:
            return list(self._processes[uuid])
        return self.process_source(uuid) if self.process_source is not None else []

    def set_processes(self, uuid: str, procs: list[GpuProcess]) -> None:
        self._processes[uuid] = list(procs)

    def usage(self, uuid: str) -> tuple[int, int]:
        self._gpu(uuid)
        return self._usage.get(uuid, (0, 0))

    def set_usage(self, uuid: str, used_mib: int, utilization_pct: int) -> None:
        self._usage[uuid] = (used_mib, utilization_pct)

    def mig_layout(self, uuid: str) -> list[tuple[str, int]]:
        g = self._gpu(uuid)
        if not g.mig_enabled:
            raise NvmlError(f"MIG mode is disabled on GPU {uuid}")
        return [(m.profile, m.start) for m in g.mig]

    def mig_profiles(self, uuid: str) -> list[MigProfile]:
        model = catalog.lookup(self._gpu(uuid).model)
        return list(model.mig.profiles) if model and model.mig else []

    def destroy_instance(self, uuid: str, profile: str, start: int) -> None:
        g = self._gpu(uuid)
        left = tuple(m for m in g.mig if (m.profile, m.start) != (profile, start))
        if len(left) == len(g.mig):
            raise NvmlError(f"GPU {uuid} has no {profile} instance at {start}")
        self._gpus[uuid] = replace(g, mig=left)

    def fail_next_create(self, uuid: str, times: int = 1) -> None:
        """Make the next ``times`` instance creations on ``uuid`` fail (tests of rollback)."""
        self._create_failures[uuid] = times

    def create_instance(self, uuid: str, profile: str, start: int) -> None:
        g = self._gpu(uuid)
        if self._create_failures.get(uuid, 0) > 0:
            self._create_failures[uuid] -= 1
            raise NvmlError(f"cannot create {profile}@{start} on {uuid}: injected failure "
                            "(NVML_ERROR_INSUFFICIENT_RESOURCES)")
        model = catalog.lookup(g.model)
        if model is None or model.mig is None or not g.mig_enabled:
            raise NvmlError(f"MIG mode is disabled on GPU {uuid}")
        prof = model.mig.profile(profile)
        from gpuslice.core.mig import MigPlacement, layout_problems

        used = [MigPlacement(m.start, model.mig.profile(m.profile)) for m in g.mig]
        problems = layout_problems(model.mig, [*used, MigPlacement(start, prof)])
        if problems:  # NVML_ERROR_INSUFFICIENT_RESOURCES
            raise NvmlError(f"cannot create {profile}@{start} on {uuid}: {problems[0]}")
        inst = MigInstance(f"MIG-{uuid}-{start}", profile, start, prof.memory_mib)
        self._gpus[uuid] = replace(g, mig=(*g.mig, inst))

    def minor_number(self, uuid: str) -> int:
        return self._minors.get(uuid, self._gpu(uuid).index)

    def mig_cap_minors(self, gpu_uuid: str, mig_uuid: str) -> tuple[int, int]:
        g = self._gpu(gpu_uuid)
        inst = next((m for m in g.mig if m.uuid == mig_uuid), None)
        if inst is None:
            raise NvmlError(f"GPU {gpu_uuid} has no MIG device {mig_uuid}")
        gi = inst.start + 1
        base = 1 + 100 * self.minor_number(gpu_uuid)
        return base + 2 * gi, base + 2 * gi + 1

    def set_timeslice(self, uuid: str, level: int) -> None:
        self._gpu(uuid)
        if not self.timeslice_supported:
            raise NvmlError(f"setting the time-slice of GPU {uuid} failed: not supported "
                            "(usual cause: a GPU or driver before R455)")
        self.timeslice[uuid] = level

    def pci_info(self, index: int) -> tuple[str, str]:
        """A made-up PCI bus ID per GPU and one PCIe root for them all."""
        return f"0000:{0x10 + index:02x}:00.0", "pci0000:00"

    def inject(self, uuid: str, xid: int, description: str = "injected") -> None:
        with self._cond:
            self._pending.append(HealthEvent(uuid, xid, description))
            self._cond.notify_all()

    def set_healthy(self, uuid: str, healthy: bool) -> None:
        self._gpus[uuid] = replace(self._gpus[uuid], healthy=healthy)

    def events(self, timeout_s: float) -> list[HealthEvent]:
        with self._cond:
            if not self._pending:
                self._cond.wait(timeout_s)
            out, self._pending = self._pending, []
            return out
