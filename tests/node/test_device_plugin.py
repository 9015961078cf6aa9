"""The node agent's device plugin on the real kubelet (device manager, PodResources) and
containerd (CDI): what each container actually sees is what the strategy promises.

Upstream rules exercised here, by the real components rather than read: the kubelet's device
manager (kubernetes pkg/kubelet/cm/devicemanager/manager.go, ``Allocate`` called per container,
devices of init containers reused by app containers), the CRI's CDI devices field and the
``cdi.k8s.io/`` annotations resolved by containerd (containerd internal/cri/server
container_create_linux.go, ``WithCDI``)."""

from __future__ import annotations

import time

import pytest

from gpuslice.devcluster import wait_until
from tests.node.helpers import MPS_PIPE, NodeEnv, busybox_pod

UUID_PREFIX = "GPU-"


def assigned_gpu(env: NodeEnv, name: str) -> str:
    """The GPU UUID the extender's assignment names for the pod."""
    from gpuslice.adapters.kube.annotation import decode
    from gpuslice.core.assignment import ANNOTATION

    a = decode(env.pod(name)["metadata"]["annotations"][ANNOTATION])
    return a.containers[0].gpus[0].uuid


@pytest.mark.parametrize("strategy", ["envvar", "volume-mounts", "cdi-annotations", "cdi-cri"])
def test_each_device_list_strategy_reaches_the_container(env: NodeEnv, strategy: str) -> None:
    agent = env.start_agent("--device-list-strategy", strategy)
    name = f"frac-{strategy}"
    try:
        env.create(busybox_pod(name, milli=500, memory=20000))
        r = env.report(name)
        gpu = assigned_gpu(env, name)
        # MPS slice: its caps in env, the daemon's pipe folder and /dev/shm mounted
        assert r.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50", r.text
        assert r.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20000M"
        pipe = r.env["CUDA_MPS_PIPE_DIRECTORY"]
        assert pipe in r.mount_points and "/dev/shm" in r.mount_points
        assert (MPS_PIPE / gpu).is_dir()
        devices = r.char_devices()
        if strategy == "envvar":
            assert r.env["NVIDIA_VISIBLE_DEVICES"] == gpu
        elif strategy == "volume-mounts":
            assert r.env["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
            assert f"/var/run/nvidia-container-devices/{gpu}" in r.mount_points
        else:  # CDI: containerd injected the spec's device nodes (stand-ins: 1,3)
            assert "NVIDIA_VISIBLE_DEVICES" not in r.env
            assert {"nvidiactl", "nvidia-uvm"} <= set(devices), r.dev
            gpus = [d for d in devices if d.startswith("nvidia") and d[6:].isdigit()]
            assert len(gpus) == 1 and devices[gpus[0]] == (1, 3), r.dev
    finally:
        env.delete(name)
        env.stop_agent(agent)


def test_a_burst_bound_concurrently_gives_each_pod_its_own_share(env: NodeEnv) -> None:
    """Eight pods of different shares created at once: kube-scheduler binds them through the
    extender one after another without waiting for each other's writes, so their Bindings
    commit in any order. The real kubelet admits them in the order its watch delivers them;
    the device plugin matches each Allocate to the waiting assignment first in that order
    (the pods' resourceVersions). Every container must see its own pod's share: its own
    assignment, thread percentage and memory cap."""
    import json

    agent = env.start_agent()
    sizes = [100, 110, 120, 130, 140, 150, 160, 170]
    names = [f"burst-{i}" for i in range(len(sizes))]
    try:
        pods = [busybox_pod(n, milli=m, memory=1000 + m) for n, m in zip(names, sizes,
                                                                          strict=True)]
        env.dev.kubectl("create", "-f", "-", input=json.dumps(
            {"apiVersion": "v1", "kind": "List", "items": pods}))
        for n, m in zip(names, sizes, strict=True):
            r = env.report(n)
            assert r.env["GPUSLICE_ASSIGNMENT"] == f"default/{n}", (n, r.text)
            assert r.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(m // 10), (n, r.text)
            assert r.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={1000 + m}M", (n, r.text)
            assert r.env["NVIDIA_VISIBLE_DEVICES"] == assigned_gpu(env, n)
    finally:
        env.delete(*names)
        env.stop_agent(agent)


def test_whole_gpu_multi_container_and_init_container(env: NodeEnv) -> None:
    agent = env.start_agent()
    try:
        env.create(busybox_pod("whole", milli=1000))
        r = env.report("whole")
        gpu = assigned_gpu(env, "whole")
        assert r.env["NVIDIA_VISIBLE_DEVICES"] == gpu
        assert not any(k.startswith("CUDA_MPS_") for k in r.env), r.env
        # two containers each with a slice, an init container with one too
        env.create(busybox_pod("multi", milli=300, memory=10000, containers=2, init=True))
        reports = [env.report("multi", c) for c in ("c0", "c1")]
        for c, rep in zip(("c0", "c1"), reports, strict=True):
            assert rep.env["GPUSLICE_CONTAINER"] == c
            assert rep.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
            assert rep.env["NVIDIA_VISIBLE_DEVICES"].startswith(UUID_PREFIX)
        init = env.dev.kubectl("logs", "multi", "-n", "default", "-c", "warmup").stdout
        assert "GPUSLICE_CONTAINER=warmup" in init
    finally:
        env.delete("whole", "multi")
        env.stop_agent(agent)


def test_devices_of_a_deleted_pod_go_to_the_next(env: NodeEnv) -> None:
    """Both GPUs whole to one pod; deleted; the next two-GPU pod is admitted with them."""
    agent = env.start_agent()
    try:
        env.create(busybox_pod("both-1", gpus=2))
        first = env.report("both-1").env["NVIDIA_VISIBLE_DEVICES"].split(",")
        assert len(first) == 2
        env.delete("both-1")
        env.create(busybox_pod("both-2", gpus=2))
        second = env.report("both-2").env["NVIDIA_VISIBLE_DEVICES"].split(",")
        assert sorted(second) == sorted(first)
    finally:
        env.delete("both-2")
        env.stop_agent(agent)


def test_kubelet_restart_keeps_pods_and_takes_the_plugin_back(env: NodeEnv) -> None:
    agent = env.start_agent()
    try:
        env.create(busybox_pod("before", milli=500, memory=10000))
        env.report("before")
        cid = env.pod("before")["status"]["containerStatuses"][0]["containerID"]
        env.node.restart_kubelet()
        # the plugin registers again (a new kubelet.sock) and new pods are admitted
        env.create(busybox_pod("after", milli=500, memory=10000))
        r = env.report("after")
        assert r.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        st = env.pod("before")["status"]["containerStatuses"][0]
        assert st["containerID"] == cid and st["restartCount"] == 0 and "running" in st["state"]
        assert "register" in env.agent_log().lower()
    finally:
        env.delete("before", "after")
        env.stop_agent(agent)


def test_a_faulty_gpus_pods_and_a_kubelet_restart_reject_no_running_pod(
        env: NodeEnv) -> None:
    """Two pods of 900 milli, one per GPU; the agent restarts and finds GPU 0 faulty (XID
    79): the GPU leaves the inventory, but the node's gpu-milli total keeps the 900 its pod
    holds (1900, not 1000). A kubelet restart then admits both running pods again against
    allocatable (the kubelet re-runs admission on restart; an extended resource present but
    too small is "OutOf..."): both keep their containers."""
    agent = env.start_agent()
    try:
        env.create(busybox_pod("left", milli=900))
        env.create(busybox_pod("right", milli=900))
        ids = {}
        for n in ("left", "right"):
            env.report(n)
            ids[n] = env.pod(n)["status"]["containerStatuses"][0]["containerID"]
        env.stop_agent(agent, kill=True)
        agent = env.start_agent(faults={0: [79]})
        wait_until("the faulty GPU's share kept in the node's total", lambda: env.allocatable()
                   .get("gpuslice.io/gpu-milli") == "1900", 60)
        env.node.restart_kubelet()
        wait_until("the plugin registered again", lambda: int(
            env.allocatable().get("gpuslice.io/gpu", "0")) > 0, 60)
        time.sleep(5)  # the kubelet's admission of the running pods has run
        for n, cid in ids.items():
            st = env.pod(n)["status"]
            assert st.get("phase") == "Running", (n, st.get("reason"), st.get("message"))
            c = st["containerStatuses"][0]
            assert c["containerID"] == cid and c["restartCount"] == 0, (n, c)
    finally:
        env.delete("left", "right")
        env.stop_agent(agent)


def test_mig_instances_through_the_device_plugin(env: NodeEnv) -> None:
    """Two MIG 3g pods on an A100 with two 3g instances: each container gets its own instance
    (the MIG UUID the assignment names) through the real device manager."""
    from gpuslice.adapters.kube.annotation import decode
    from gpuslice.core.assignment import ANNOTATION

    agent = env.start_agent(gpus=1, mig="3g.40gb@0,3g.40gb@4")
    try:
        for i in range(2):
            env.create(busybox_pod(f"mig-{i}", milli=429, isolation="mig"))
        seen = []
        for i in range(2):
            r = env.report(f"mig-{i}")
            a = decode(env.pod(f"mig-{i}")["metadata"]["annotations"][ANNOTATION])
            share = a.containers[0].gpus[0]
            assert share.mig_profile == "3g.40gb"
            seen.append(r.env["NVIDIA_VISIBLE_DEVICES"])
        assert len(set(seen)) == 2 and all(s.startswith("MIG-") for s in seen), seen
    finally:
        env.delete("mig-0", "mig-1")
        env.stop_agent(agent)
