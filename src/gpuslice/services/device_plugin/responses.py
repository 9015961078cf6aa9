"""What Allocate answers: the container's environment, mounts and annotations, by the
configured device list strategies, and the CDI spec of the devices."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpuslice.adapters.dra.cdi import device_node
from gpuslice.adapters.files import write_atomic
from gpuslice.adapters.kube.objects import PRIORITY_ANNOTATION
from gpuslice.adapters.kubelet import deviceplugin_pb2 as pb
from gpuslice.adapters.mps import PIPE_IN_CONTAINER, ensure_client_mounts, pinned_mem_limit
from gpuslice.core import catalog, migmps
from gpuslice.core.assignment import ContainerAssignment, GpuShare, Mode
from gpuslice.core.errors import GpusliceError
from gpuslice.core.model import PRIORITIES
from gpuslice.services.device_plugin.config import (
    CDI_ANNOTATION_PREFIX,
    CDI_KIND,
    CDI_VERSION,
    VOLUME_MOUNTS_ROOT,
    cdi_device_name,
)
from gpuslice.services.device_plugin.state import PluginState, _Admission


class Responses(PluginState):
    """What Allocate hands the container runtime, and the CDI spec."""

    def _thread_pct(self, share: GpuShare) -> int:
        """The MPS thread cap: milli/10 of the GPU, or inside a MIG instance that share of the
        instance (214 milli of the GPU in a 3g of 7 is half the instance)."""
        if not share.mig_profile:
            return max(1, share.milli // 10)
        model = next((catalog.lookup(g.model) for g in self.nvml.devices()
                      if g.uuid == share.uuid), None)
        if model is None or model.mig is None:
            raise GpusliceError(f"GPU {share.uuid}: no MIG geometry for its model")
        return migmps.thread_pct(share.milli, model.mig.profile(share.mig_profile).compute_slices,
                                 model.mig.compute_slices)

    def _runtime_response(self, devices: list[str], envs: dict[str, str],
                          mounts: list[pb.Mount],
                          annotations: dict[str, str]) -> pb.ContainerAllocateResponse:
        """How the container runtime learns the devices (``devices``: GPU or MIG UUIDs), by
        the configured device list strategies (NVIDIA's device plugin's names)."""
        envs, mounts, annotations = dict(envs), list(mounts), dict(annotations)
        cdi: list[pb.CDIDevice] = []
        names = [f"{CDI_KIND}={cdi_device_name(d)}" for d in devices]
        self.write_cdi_spec()  # the spec names these devices (none: no CDI strategy)
        for strategy in self.cfg.device_list_strategy:
            if strategy == "envvar":
                envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(devices)
            elif strategy == "volume-mounts":
                envs["NVIDIA_VISIBLE_DEVICES"] = VOLUME_MOUNTS_ROOT
                mounts.extend(pb.Mount(container_path=f"{VOLUME_MOUNTS_ROOT}/{d}",
                                       host_path="/dev/null", read_only=True) for d in devices)
            elif strategy == "cdi-annotations":
                import hashlib

                tag = hashlib.sha256(",".join(devices).encode()).hexdigest()[:16]
                annotations[f"{CDI_ANNOTATION_PREFIX}gpuslice_{tag}"] = ",".join(names)
            elif strategy == "cdi-cri":
                cdi.extend(pb.CDIDevice(name=n) for n in names)
        return pb.ContainerAllocateResponse(envs=envs, mounts=mounts, annotations=annotations,
                                            cdi_devices=cdi)

    def _response(self, adm: _Admission, c: ContainerAssignment,
                  ids: list[str]) -> pb.ContainerAllocateResponse:
        a = adm.a
        priority = adm.priority
        shares = list(c.gpus)
        if sorted(g.uuid for g in shares) != sorted(self._gpus_of(ids)):
            # whole GPUs the kubelet reused from an init container: the ones it gave
            shares = [GpuShare(u, 1000, shares[0].memory_mib)
                      for u in sorted(self._gpus_of(ids))]
        gpus = [self._visible(g) for g in shares]
        envs = {"GPUSLICE_ASSIGNMENT": f"{a.namespace}/{a.pod}",
                "GPUSLICE_CONTAINER": c.name}
        mounts = []
        if c.mode is Mode.MPS:
            share = shares[0]
            envs["CUDA_MPS_PIPE_DIRECTORY"] = PIPE_IN_CONTAINER
            envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(self._thread_pct(share))
            if share.memory_mib:  # each of the pod's declared processes gets its part
                envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = pinned_mem_limit(
                    *(adm.per_process(g.memory_mib) for g in shares))
            if priority not in PRIORITIES:
                raise GpusliceError(f"{PRIORITY_ANNOTATION}: expected one of "
                                    f"{', '.join(PRIORITIES)}, got {priority!r}")
            if PRIORITIES[priority] != "0":
                envs["CUDA_MPS_CLIENT_PRIORITY"] = PRIORITIES[priority]
            mounts += [pb.Mount(container_path=c, host_path=h, read_only=False) for h, c in
                       ensure_client_mounts(self.cfg.mps_pipe_dir, gpus[0],
                                            self.cfg.mps_shm_dir)]
        return self._runtime_response(
            gpus, envs, mounts, {"gpuslice.io/pod": f"{a.namespace}/{a.pod}",
                                 "gpuslice.io/container": c.name,
                                 "gpuslice.io/mode": c.mode.value})

    def cdi_spec(self) -> dict[str, Any]:
        """The CDI spec of the devices this plugin hands out (kind gpuslice.io/gpu): one
        CDI device per GPU and per MIG instance, with its device node and the driver's
        control nodes."""
        def node(name: str) -> dict[str, str]:
            return device_node(str(Path(self.cfg.dev_dir) / name), str(self.cfg.dev_dir))

        control = [node(n) for n in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")]
        devices = []
        for g in self.nvml.devices():
            gpu = node(f"nvidia{self.nvml.minor_number(g.uuid)}")
            devices.append({"name": cdi_device_name(g.uuid),
                            "containerEdits": {"deviceNodes": [gpu, *control]}})
            devices.extend({"name": cdi_device_name(m.uuid),
                            "containerEdits": {"deviceNodes": [gpu, *control]}}
                           for m in g.mig)
        return {"cdiVersion": CDI_VERSION, "kind": CDI_KIND, "devices": devices}

    def write_cdi_spec(self) -> Path | None:
        """Write :meth:`cdi_spec` under ``cdi_root`` atomically (a runtime never reads half a
        spec) when it differs from what this plugin wrote last or the file is gone (a MIG
        layout change gives instances new UUIDs; a reboot empties /var/run/cdi); None when
        no CDI strategy is configured. Called at start, after each layout change and before
        each Allocate's answer names its devices."""
        if not any(st.startswith("cdi-") for st in self.cfg.device_list_strategy):
            return None
        target = Path(self.cfg.cdi_root) / f"{CDI_KIND.replace('/', '-')}.json"
        spec = self.cdi_spec()
        with self._cdi_lock:
            if spec != self._cdi_written or not target.exists():
                write_atomic(target, json.dumps(spec, indent=2, sort_keys=True).encode())
                self._cdi_written = spec
        return target
