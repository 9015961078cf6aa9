"""Inputs of the re-plans by measured use: a plan of the shipped profiles with slices of
their own per service, and per-pod metrics as the node agents export them (the real
:class:`~gpuslice.services.pod_usage.PodUsage` over a fake NVML and API server)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from gpuslice.adapters.profiles import builtin
from gpuslice.core import catalog
from gpuslice.core.mig import MigPlacement
from gpuslice.core.planner import FleetType, Plan, PlannedGpu, Service, Slot, best_configs
from gpuslice.core.planner.options import slice_profiles
from gpuslice.core.profiles import ProfileSet
from gpuslice.planning.run import PlanRun, load_profiles, to_json

GPU = "A100-80GB"
SIZES = slice_profiles(catalog.resolve(GPU).mig)  # type: ignore[arg-type]


def profiles() -> ProfileSet:
    return load_profiles(builtin.resolve("profiles", "builtin:a100-80gb", "--profiles"))


def plan_of(profs: ProfileSet, slices: list[tuple[int, Service, int, int]]) -> Plan:
    """A plan of (GPU index, service, compute slices, start) slices, each with the planner's
    configuration for its size."""
    gpus: dict[int, list[Slot]] = {}
    for gi, svc, size, start in slices:
        cfg = best_configs(profs, svc, GPU, 0.45)[size]
        gpus.setdefault(gi, []).append(Slot(MigPlacement(start, SIZES[size]), (cfg,)))
    return Plan(tuple(PlannedGpu(i, GPU, tuple(sorted(s, key=lambda x: x.placement.key)))
                      for i, s in sorted(gpus.items())), "gpus", float(len(gpus)), 0.0, "test")


def write_plan(path: Path, plan: Plan, services: list[Service]) -> Path:
    run = PlanRun(plan, services, [], 0.0, 0.0, 1, {}, [], {}, fleet=(FleetType(GPU),))
    path.write_text(json.dumps(to_json(run)))
    return path


def write_services(path: Path, services: list[Service]) -> Path:
    path.write_text(yaml.safe_dump({"services": [
        {"name": s.name, "model": s.model, "rate": s.rate, "slo_ms": s.slo_ms}
        for s in services]}))
    return path


@dataclass(frozen=True)
class PodUse:
    """One pod of a service on its own GPU: what it uses and the share it was given."""

    service: str
    pod: str
    used_mib: int
    sm_pct: float | None  # of the whole GPU; None: no sample
    milli: int
    memory_mib: int


def agent_metrics(node: str, pods: list[PodUse]) -> str:
    """The /metrics text a node agent serves for these pods (one GPU each), measured by the
    node agent's own code."""
    from prometheus_client import CollectorRegistry, generate_latest

    from gpuslice.adapters.kube.annotation import encode
    from gpuslice.adapters.kube.fake import FakeApiServer
    from gpuslice.adapters.nvml.port import FakeNvml, GpuProcess
    from gpuslice.adapters.proc.pods import PodProcess
    from gpuslice.core.assignment import Assignment, ContainerAssignment, GpuShare, Mode, sign
    from gpuslice.services.pod_usage import PodUsage

    key = b"k" * 24
    api = FakeApiServer()
    nvml = FakeNvml.simulated(len(pods))
    owner: dict[int, tuple[str, str]] = {}
    for i, (use, dev) in enumerate(zip(pods, nvml.devices(), strict=True)):
        p = api.add_pod({"metadata": {"name": use.pod, "namespace": "ml",
                                      "labels": {"gpuslice.io/service": use.service}},
                         "spec": {"nodeName": node, "containers": [{"name": "server"}]},
                         "status": {"containerStatuses": [
                             {"name": "server", "containerID": f"containerd://c{i}"}]}})
        a = Assignment("ml", use.pod, p["metadata"]["uid"], node, (ContainerAssignment(
            "server", Mode.MPS, (GpuShare(dev.uuid, use.milli, use.memory_mib),)),), "t1")
        api.patch_pod_annotations("ml", use.pod, {"gpuslice.io/assignment":
                                                  encode(sign(a, key))},
                                  p["metadata"]["resourceVersion"])
        nvml.set_processes(dev.uuid, [GpuProcess(100 + i, use.used_mib, use.sm_pct)])
        owner[100 + i] = (p["metadata"]["uid"], f"c{i}")

    def pod_of_pid(pid: int) -> PodProcess | None:
        return PodProcess(pid, *owner[pid]) if pid in owner else None

    registry = CollectorRegistry()
    PodUsage(node, nvml, api, registry, keys=(key,), pod_of_pid=pod_of_pid).step()
    return str(generate_latest(registry).decode())
