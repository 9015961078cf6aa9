"""What prepare does to a node for one planned device, and unprepare undoes: MPS control
daemons (one per GPU or MIG instance, shared by every share on it), MIG instances of
partitionable devices, time-slices, and the CDI device the container runtime applies."""

from __future__ import annotations

import os
from typing import Any

from gpuslice.adapters.dra.cdi import CdiDevice, device_name
from gpuslice.adapters.mps import PIPE_IN_CONTAINER, ensure_client_mounts, pinned_mem_limit
from gpuslice.adapters.mps.keeper import MpsDaemons
from gpuslice.adapters.nvml.port import NvmlError, NvmlPort
from gpuslice.core import dra
from gpuslice.services.dra_driver.config import ClaimError, ClaimRef, DraConfig
from gpuslice.services.mig_executor import MigExecutor


class Effects:
    def __init__(self, cfg: DraConfig, nvml: NvmlPort) -> None:
        self.cfg, self.nvml = cfg, nvml
        self.mig = MigExecutor(nvml)
        # the MPS control daemons this driver keeps (their records name it: it quits them
        # with their GPU's last share) or uses (the node agent's); with cfg.mps_host they are
        # started by `gpuslice mps-host`, so that they outlive this driver's pod
        self.keeper = MpsDaemons(cfg.mps_pipe_dir, "dra-driver", binary=cfg.mps_binary,
                                 host=cfg.mps_host)
        self.mps = self.keeper.daemons  # target (GPU or MIG instance) -> its daemon
        self.ceilings = self.keeper.ceilings  # target -> the limits its servers hold

    def make(self, c: ClaimRef, e: dict[str, Any]) -> CdiDevice:
        """Make one planned device ready (idempotently) and return its CDI device."""
        minor = self._minor(e["gpu"])
        env = {"GPUSLICE_CLAIM": f"{c.namespace}/{c.name}", "GPUSLICE_DEVICE": e["device"]}
        nodes = tuple(os.path.join(self.cfg.dev_dir, n) for n in
                      ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", f"nvidia{minor}"))
        mounts: tuple[tuple[str, str], ...] = ()
        if e.get("admin"):
            target = e["gpu"]
            if e["type"] == dra.TYPE_MIG:  # the instance when it exists, else its GPU
                inst = e.get("migUUID") or self._mig_uuid(e["gpu"], e["profile"], e["start"],
                                                         missing_ok=True)
                if inst:
                    target = inst
                    nodes += self._cap_nodes(e["gpu"], inst)
            env["CUDA_VISIBLE_DEVICES"] = target
            return CdiDevice(device_name(c.uid, e["device"], e.get("shareID", "")), env,
                             nodes, mounts, dev_dir=self.cfg.dev_dir)
        if e["type"] == dra.TYPE_SHARE:
            # MPS caps each client process: the claim's declared processes share the memory
            per_client = _per_process(int(e["memoryMiB"]), e)
            self.ensure_mps(e["gpu"], int(e["threadPct"]), per_client)
            # CUDA_VISIBLE_DEVICES names the one GPU, so that the container's CUDA (and the
            # ordinal 0 of the memory limit) is that GPU whatever else the runtime exposes
            env.update(CUDA_VISIBLE_DEVICES=e["gpu"],
                       CUDA_MPS_PIPE_DIRECTORY=PIPE_IN_CONTAINER,
                       CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(e["threadPct"]),
                       CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=pinned_mem_limit(per_client),
                       GPUSLICE_SHARE=e["shareID"])
            mounts = tuple(ensure_client_mounts(self.cfg.mps_pipe_dir, e["gpu"],
                                                    self.cfg.mps_shm_dir))
            name = device_name(c.uid, e["device"], e["shareID"])
        elif e["type"] == dra.TYPE_MIG:
            if not e.get("migUUID"):  # a partitionable device: its instance is made here
                self.mig.ensure_instance(e["gpu"], e["profile"], e["start"])
            mig_uuid = e.get("migUUID") or self._mig_uuid(e["gpu"], e["profile"], e["start"])
            env["CUDA_VISIBLE_DEVICES"] = mig_uuid
            nodes += self._cap_nodes(e["gpu"], mig_uuid)
            if e.get("strategy") == "MPS":
                mounts = self._mps_env(mig_uuid, e, env)
            name = device_name(c.uid, e["device"])
        else:
            env["CUDA_VISIBLE_DEVICES"] = e["gpu"]
            if e.get("strategy") == "MPS":
                mounts = self._mps_env(e["gpu"], e, env)
            if e.get("strategy") == "TimeSlicing":
                self._set_timeslice(e["gpu"], str(e.get("interval") or "Default"))
            name = device_name(c.uid, e["device"])
        return CdiDevice(name, env, nodes, mounts, dev_dir=self.cfg.dev_dir)

    def undo(self, entry: dict[str, Any], others: list[dict[str, Any]]) -> None:
        """Undo what :meth:`make` did for a checkpointed claim ``entry``: the GPU's default
        time-slice back, its MIG instances destroyed unless ``others`` (the devices other
        claims hold) use them, and the MPS daemon of a GPU quit once no other claim's share
        or MPS device is on it, when this driver started it (one it adopted, the node
        agent's, stays). No API server is needed: the checkpoint says it all."""
        for e in entry["devices"]:
            if e.get("admin"):
                continue  # admin access made nothing
            if e.get("strategy") == "TimeSlicing" and e.get("interval", "Default") != "Default":
                self._set_timeslice(e["gpu"], "Default")  # the next claim's default
            if e.get("type") == dra.TYPE_MIG and not e.get("migUUID") and not any(
                    not x.get("admin") and x.get("type") == dra.TYPE_MIG
                    and x["gpu"] == e["gpu"]
                    and (x["profile"], x["start"]) == (e["profile"], e["start"])
                    for x in others):
                try:
                    self.mig.remove_instance(e["gpu"], e["profile"], e["start"])
                except NvmlError as exc:
                    raise ClaimError(f"MIG instance {e['profile']}@{e['start']} on GPU "
                                     f"{e['gpu']} not removed: {exc}") from None
        for gpu in {g for g in map(_gpu_mps, entry["devices"]) if g} - \
                {g for g in map(_gpu_mps, others) if g}:
            if self.keeper.owns(gpu):
                self.keeper.quit(gpu)

    def _minor(self, gpu: str) -> int:
        """The GPU's device minor from NVML (``/dev/nvidia<minor>``: not its index, which
        differs from it on many servers)."""
        try:
            return self.nvml.minor_number(gpu)
        except NvmlError as exc:
            raise ClaimError(f"GPU {gpu}: no device minor number: {exc}") from None

    def _cap_nodes(self, gpu: str, mig_uuid: str) -> tuple[str, ...]:
        """The MIG device's GPU- and compute-instance capability nodes
        (``/dev/nvidia-caps/nvidia-cap<N>``, from /proc/driver/nvidia/capabilities)."""
        from gpuslice.adapters.nvml.caps import cap_node

        try:
            gi, ci = self.nvml.mig_cap_minors(gpu, mig_uuid)
        except NvmlError as exc:
            raise ClaimError(f"MIG device {mig_uuid}: its capability device nodes are "
                             f"unknown: {exc}") from None
        return cap_node(self.cfg.dev_dir, gi), cap_node(self.cfg.dev_dir, ci)

    def _set_timeslice(self, gpu: str, interval: str) -> None:
        """Apply a GpuConfig's ``sharing.timeSlicing.interval`` to the GPU; a GPU or driver
        that cannot fails the claim, naming the field, instead of ignoring it."""
        from gpuslice.adapters.nvml.port import TIMESLICE_LEVELS

        try:
            self.nvml.set_timeslice(gpu, TIMESLICE_LEVELS[interval])
        except NvmlError as exc:
            raise ClaimError(f"opaque config sharing.timeSlicing.interval {interval!r} cannot "
                             f"be applied to GPU {gpu}: {exc}") from None

    def _mps_env(self, target: str, e: dict[str, Any], env: dict[str, str]
                 ) -> tuple[tuple[str, str], ...]:
        mib = _per_process(int(e["mpsMiB"]), e) if e.get("mpsMiB") else None
        self.ensure_mps(target, int(e.get("mpsPct") or 100), mib)
        env["CUDA_MPS_PIPE_DIRECTORY"] = PIPE_IN_CONTAINER
        if e.get("mpsPct"):
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(e["mpsPct"])
        if mib:
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = pinned_mem_limit(mib)
        return tuple(ensure_client_mounts(self.cfg.mps_pipe_dir, target, self.cfg.mps_shm_dir))

    def _mig_uuid(self, gpu: str, profile: str, start: int, missing_ok: bool = False) -> str:
        g = next((g for g in self.nvml.devices() if g.uuid == gpu), None)
        inst = next((m for m in (g.mig if g else ()) if (m.profile, m.start) ==
                     (profile, start)), None)
        if inst is None and missing_ok:
            return ""
        if inst is None:
            raise ClaimError(f"GPU {gpu}: the MIG instance {profile}@{start} was created but "
                             "NVML does not list it")
        return inst.uuid

    def ensure_mps(self, target: str, thread_pct: int = 100,
                   memory_mib: int | None = None) -> None:
        """The MPS control daemon of GPU (or MIG instance) ``target`` runs: one per GPU,
        shared by every share on it, in the node agent's pipe directory layout; one already
        running there (the node agent's, or a previous driver's) is used. Its servers' own
        limits cover a client of ``thread_pct`` percent and ``memory_mib`` (None: uncapped)
        and no more than the largest share prepared on it: a client that rewrites its CDI
        environment cannot rise past them (adapters.mps.keeper, shared with the node
        agent)."""
        self.keeper.ensure(target, thread_pct, memory_mib)

    def adopt_mps(self, targets: set[str]) -> list[str]:
        """At start: the daemons an earlier driver kept for the checkpointed claims' shares
        (``targets``), with their ceilings; a record of a target no claim holds any more is
        quit (the claim was unprepared while no driver ran)."""
        adopted = self.keeper.adopt()
        for target in [t for t in adopted if t not in targets]:
            d = self.keeper.daemon(target)
            if not d.healthy() or not d.servers():  # never one with clients
                self.keeper.quit(target)
                adopted.remove(target)
        return adopted

    def stop_mps(self) -> list[str]:
        """Quit the MPS control daemons this driver started or adopted; their targets. For
        local runs (``gpuslice demo --dra``) only: the DaemonSet leaves them running for the
        containers that use them."""
        return [t for t in list(self.mps) if self.keeper.owns(t) and self.keeper.quit(t)]


def _per_process(mib: int, e: dict[str, Any]) -> int:
    """A device's MPS memory cap per client: divided among its declared processes (the
    opaque config's ``mps.processes``; checkpoints written before it: 1)."""
    return max(1, mib // int(e.get("processes") or 1))


def mps_targets(devices: list[dict[str, Any]]) -> set[str]:
    """The GPUs and MIG instances whose MPS daemons checkpointed devices use."""
    out = {g for g in map(_gpu_mps, devices) if g}
    out.update(str(e["migUUID"]) for e in devices
               if e.get("type") == dra.TYPE_MIG and e.get("strategy") == "MPS"
               and e.get("migUUID"))
    return out


def _gpu_mps(e: dict[str, Any]) -> str | None:
    """The GPU whose MPS daemon a checkpointed device uses: a share's, or a whole GPU's under
    an MPS config (a MIG device's daemon is its instance's, left running)."""
    if e.get("type") == dra.TYPE_SHARE or (e.get("type") == dra.TYPE_GPU
                                             and e.get("strategy") == "MPS"):
        return str(e["gpu"])
    return None
