"""What a claim's allocation means on this node: the devices to prepare, each checked as the
last line of defense behind the scheduler (a whole GPU held by another claim, a MIG placement
that clashes, shares over-committing their GPU, MPS on two GPUs in one claim)."""

from __future__ import annotations

from typing import Any

from gpuslice.adapters.nvml.port import NvmlPort
from gpuslice.core import dra
from gpuslice.core.catalog import MigGeometry
from gpuslice.core.errors import ValidationError
from gpuslice.core.mig import MigPlacement, layout_problems
from gpuslice.services.dra_driver.config import ClaimError, ClaimRef, DraConfig


class ClaimPlanner:
    def __init__(self, cfg: DraConfig, nvml: NvmlPort) -> None:
        self.cfg, self.nvml = cfg, nvml

    def _configs(self, allocation: dict[str, Any]) -> list[tuple[list[str], dra.Config]]:
        out = []
        devices = _object(allocation.get("devices"), "status.allocation.devices")
        for i, cfg in enumerate(_objects(devices.get("config"),
                                         "status.allocation.devices.config")):
            opaque = _object(cfg.get("opaque"), f"status.allocation.devices.config[{i}].opaque")
            if opaque.get("driver") != self.cfg.driver:
                continue  # another driver's
            requests = cfg.get("requests") or []
            if not isinstance(requests, list) or not all(isinstance(r, str) for r in requests):
                raise ClaimError(f"status.allocation.devices.config[{i}].requests: expected a "
                                 f"list of request names, got {requests!r}")
            where = f"status.allocation.devices.config[{i}].opaque.parameters"
            try:
                decoded = dra.decode_config(opaque.get("parameters"), where)
            except ValidationError as exc:
                raise ClaimError(f"bad opaque config: {exc}") from None
            out.append((list(requests), decoded))
        return out

    def plan(self, c: ClaimRef, allocation: dict[str, Any], pool: dra.PoolPlan,
             prepared: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        """The devices of claim ``c``'s allocation to prepare, checked against ``pool`` (what
        this node publishes) and ``prepared`` (the checkpoint's claims, UID -> entry)."""
        configs = self._configs(allocation)
        results = [r for r in _objects(_object(allocation.get("devices"),
                                               "status.allocation.devices").get("results"),
                                       "status.allocation.devices.results")
                   if r.get("driver") == self.cfg.driver]
        # what other claims hold; admin-access results hold nothing (resource/v1 types.go,
        # DeviceRequestAllocationResult.AdminAccess: the device may be in use by others)
        others = {uid: {**e, "devices": [x for x in e["devices"] if not x.get("admin")]}
                  for uid, e in prepared.items() if uid != c.uid}
        entries: list[dict[str, Any]] = []
        for i, r in enumerate(results):
            where = f"status.allocation.devices.results[{i}]"
            if r.get("pool") != self.cfg.node:
                raise ClaimError(f"{where}.pool: {r.get('pool')!r} is not this node's pool "
                                 f"({self.cfg.node})")
            ref = pool.devices.get(str(r.get("device")))
            if ref is None:
                raise ClaimError(f"{where}.device: {r.get('device')!r} is not a device this "
                                 "driver publishes on this node")
            applied = dra.config_for(configs, str(r.get("request", "")))
            e: dict[str, Any] = {"request": str(r.get("request", "")), "pool": r["pool"],
                                 "device": r["device"], "type": ref.type,
                                 "gpu": ref.gpu_uuid, "index": ref.gpu_index}
            wrong = [type(x).__name__ for x in applied
                     if not isinstance(x, _CONFIG_FOR[ref.type])]
            if wrong:
                raise ClaimError(f"{where}: a {wrong[0]} does not apply to a {ref.type} device "
                                 f"({r['device']}); use {_CONFIG_FOR[ref.type].__name__}")
            last = applied[-1] if applied else None
            if r.get("adminAccess"):
                # monitoring / management access: the device as it is, no limits, no effects
                e.update(admin=True, shareID=str(r.get("shareID") or ""), profile=ref.profile,
                         start=ref.start, migUUID=ref.mig_uuid)
                entries.append(e)
                continue
            mine = [x for x in entries if not x.get("admin")]
            if ref.type == dra.TYPE_SHARE:
                e.update(_share(r, ref, last, where, [*(x for o in others.values()
                                                         for x in o["devices"]), *mine]))
            elif ref.type == dra.TYPE_MIG:
                e.update(profile=ref.profile, start=ref.start, migUUID=ref.mig_uuid)
                if isinstance(last, dra.MigConfig):
                    e.update(strategy=last.strategy,
                             mpsPct=last.mps.active_thread_percentage,
                             mpsMiB=last.mps.pinned_memory_mib, processes=last.mps.processes)
                clash = self._mig_clash(ref, others, mine)
                if clash:
                    raise ClaimError(f"{where}.device {r['device']}: {clash}")
            else:
                e.update(_whole(r, ref, last, where, others, mine))
            entries.append(e)
        targets = sorted({t for t in map(_mps_target, entries) if t})
        if len(targets) > 1:
            raise ClaimError(
                f"MPS on {len(targets)} GPUs or MIG devices in one claim ({', '.join(targets)}): "
                "a CUDA process talks to one MPS control daemon (one CUDA_MPS_PIPE_DIRECTORY, "
                "one CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), so a container cannot hold MPS shares "
                "of two GPUs; ask for each GPU's share in its own claim, used by its own "
                "container")
        return entries

    def _mig_clash(self, ref: dra.DeviceRef, others: dict[str, Any],
                   entries: list[dict[str, Any]]) -> str:
        """Why a MIG placement cannot be prepared next to those already held ("" if it can):
        the last line of defense behind the scheduler's counters."""
        geo = self._geometry(ref.gpu_uuid)
        held = [x for o in others.values() for x in o["devices"]] + entries
        layout = [MigPlacement(x["start"], geo.profile(x["profile"])) for x in held
                  if x.get("type") == dra.TYPE_MIG and x["gpu"] == ref.gpu_uuid]
        if any((p.start, p.profile.name) == (ref.start, ref.profile) for p in layout):
            return "this MIG placement is prepared for another claim already"
        problems = layout_problems(geo, [*layout, MigPlacement(ref.start,
                                                               geo.profile(ref.profile))])
        return problems[0] if problems else ""

    def _geometry(self, gpu_uuid: str) -> MigGeometry:
        from gpuslice.core import catalog

        g = next(g for g in self.nvml.devices() if g.uuid == gpu_uuid)
        model = catalog.lookup(g.model)
        assert model is not None and model.mig is not None
        return model.mig


def _object(value: object, where: str) -> dict[str, Any]:
    """``value`` as an object (None: empty), else a claim error naming ``where``."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ClaimError(f"{where}: expected an object, got {type(value).__name__}")
    return value


def _objects(value: object, where: str) -> list[dict[str, Any]]:
    """``value`` as a list of objects (None: empty), else a claim error naming ``where``."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ClaimError(f"{where}: expected a list, got {type(value).__name__}")
    for i, x in enumerate(value):
        if not isinstance(x, dict):
            raise ClaimError(f"{where}[{i}]: expected an object, got {type(x).__name__}")
    return value


def _mps_target(e: dict[str, Any]) -> str:
    """The MPS daemon a prepared device's clients talk to ("" when none)."""
    if e.get("admin"):
        return ""
    if e.get("type") == dra.TYPE_SHARE:
        return str(e["gpu"])
    if e.get("strategy") == "MPS":
        return f"{e['gpu']}/{e['profile']}@{e['start']}" if e.get("type") == dra.TYPE_MIG \
            else str(e["gpu"])
    return ""


_CONFIG_FOR: dict[str, type] = {dra.TYPE_SHARE: dra.MpsConfig, dra.TYPE_MIG: dra.MigConfig,
                                dra.TYPE_GPU: dra.GpuConfig}


def _share(r: dict[str, Any], ref: dra.DeviceRef, last: object, where: str,
           held_by: list[dict[str, Any]]) -> dict[str, Any]:
    """A share's entry fields: its ID and caps (from ``consumedCapacity`` and the MPS
    settings of ``last``, the config that applies), refused when the shares of its GPU
    already prepared (``held_by``: every other device entry, this claim's too) leave too
    little."""
    share = r.get("shareID")
    if not share:
        raise ClaimError(f"{where}.shareID: missing for a device that allows multiple "
                         "allocations (DRAConsumableCapacity off in the scheduler?)")
    if not isinstance(share, str):
        raise ClaimError(f"{where}.shareID: expected a string, got {share!r}")
    mps = last.mps if isinstance(last, dra.MpsConfig) else dra.MpsSettings()
    try:
        caps = dra.share_caps(_object(r.get("consumedCapacity"), f"{where}.consumedCapacity"),
                              ref.memory_mib, mps, f"{where}.consumedCapacity")
    except ValidationError as exc:
        raise ClaimError(str(exc)) from None
    held = [dra.ShareCaps(x["threadPct"], x["memoryMiB"]) for x in held_by
            if x.get("type") == dra.TYPE_SHARE and x["gpu"] == ref.gpu_uuid]
    problems = dra.share_problems(held, caps, ref.memory_mib)
    if problems:
        raise ClaimError(f"share {share} of GPU {ref.gpu_index} refused: {problems[0]}")
    return {"shareID": share, "threadPct": caps.thread_pct, "memoryMiB": caps.memory_mib,
            "processes": mps.processes}


def _whole(r: dict[str, Any], ref: dra.DeviceRef, last: object, where: str,
           others: dict[str, Any], mine: list[dict[str, Any]]) -> dict[str, Any]:
    """A whole GPU's entry fields (its sharing from ``last``, a GpuConfig), refused when
    another claim has it prepared or this claim names it twice."""
    holder = next((f"{o['namespace']}/{o['name']}" for o in others.values()
                   for x in o["devices"] if x["device"] == r["device"]), None)
    if holder:
        raise ClaimError(f"{where}.device {r['device']} is prepared for claim {holder} "
                         "already")
    if any(x["device"] == r["device"] for x in mine):
        raise ClaimError(f"{where}.device {r['device']} is allocated twice in this claim (a "
                         "whole GPU is one allocation)")
    if not isinstance(last, dra.GpuConfig):
        return {}
    return {"strategy": last.strategy, "interval": last.interval,
            "mpsPct": last.mps.active_thread_percentage, "mpsMiB": last.mps.pinned_memory_mib,
            "processes": last.mps.processes}
