"""Reconfiguration without dropping traffic, on the demo's fake cluster: the real node agents
(MIG layouts on fake NVML), extender (over HTTP) and router (over HTTP), replicas in-process."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Self

import numpy as np
import pytest

from gpuslice.adapters.kube.objects import CORDONED_ANNOTATION
from gpuslice.demo.cluster import (
    Cluster,
    NodeSpec,
    gpu_pod,
)
from gpuslice.services.reconfig import ReconfigController
from tests.reconfig.harness import (
    BATCH,
    INFERENCE,
    PLURAL,
    cluster,
    layouts,
    running,
    schedule,
    status,
    switch_under_load,
    wait,
)

pytestmark = pytest.mark.slow


def test_sixteen_gpus_switch_layouts_and_back_under_load(tmp_path: Path) -> None:
    """Nothing dropped, nothing lost, every GPU in its target layout both ways. Latency under
    the switch is a figure, not a pass mark here: benchmarks/reconfig_under_load.py prints it
    against the same load with no switch, measured in the same run."""
    run = switch_under_load(tmp_path)
    assert len(run.samples) > 1000 and not run.failed, (len(run.failed), run.failed[:5])
    assert run.running == {"alpha": 10, "beta": 10}  # no replica lost
    assert run.wrong == []
    for target in ("batch", "inference"):
        assert len(run.per_gpu[target]) == 16
    assert run.moves >= 20  # every replica was moved at least once, under load
    print(json.dumps({"requests": len(run.samples), "failed": len(run.failed),
                      "moves": run.moves,
                      "p99_ms": {svc: round(run.p99_ms(svc), 1) for svc in ("alpha", "beta")},
                      **{t: {"gpus": len(v), "mean_s": round(float(np.mean(v)), 3),
                             "max_s": round(float(np.max(v)), 3)}
                         for t, v in run.per_gpu.items()}}))


class Killed(BaseException):
    """The controller process died here (a BaseException: a death is no error the controller
    can catch, and step() goes on past any Exception of one schedule)."""


class Dying:
    """The API server as a controller sees it, until it dies after ``calls`` calls of
    ``method``."""

    def __init__(self, api: Any, method: str, calls: int) -> None:
        self.api, self.method, self.left = api, method, calls

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.api, name)
        if name != self.method:
            return fn

        def call(*a: Any, **kw: Any) -> Any:
            if self.left <= 0:
                raise Killed(name)
            self.left -= 1
            return fn(*a, **kw)

        return call


def drive(ctl: ReconfigController, c: Cluster, until: Any, timeout_s: float = 60) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        ctl.step()
        if until(status(c)):
            return
        time.sleep(0.05)
    raise AssertionError(f"not reached: {status(c)}")


def consistent(c: Cluster, target: str, replicas: int) -> None:
    assert wait(lambda: all(running(c, s) == replicas for s in ("alpha", "beta")), 20)
    pods = c.api.list_pods()
    assert len(pods) == 2 * replicas  # nothing lost, nothing duplicated
    assert not any((p["metadata"].get("annotations") or {}).get("gpuslice.io/draining")
                   for p in pods)
    assert set(layouts(c).values()) == {target}
    assert all(not (n["metadata"].get("annotations") or {}).get(CORDONED_ANNOTATION)
               for n in c.api.list_nodes())


@pytest.mark.parametrize(("phase", "method", "calls"), [
    ("Cordoned", None, 0),        # status written, cordon not yet set
    ("Moving", "create_pod", 1),  # dies after the first of several replacements
    ("Draining", "delete_pod", 0),  # replacements ready, old pods not yet deleted
    ("Applying", "patch_node", 0),  # layout not yet asked for
])
def test_a_controller_killed_mid_transition_is_resumed_by_the_next(
        tmp_path: Path, phase: str, method: str | None, calls: int) -> None:
    with cluster(tmp_path, nodes=2, gpus=2, replicas=4) as c:
        c.api.replace_custom(PLURAL, schedule(override="batch"))
        first = ReconfigController(c.api)
        drive(first, c, lambda st: any(g.get("phase") == phase
                                       for g in (st.get("gpus") or {}).values()))
        if method is not None:
            dying = ReconfigController(Dying(c.api, method, calls))  # type: ignore[arg-type]
            with pytest.raises(Killed):
                drive(dying, c, lambda st: False, timeout_s=20)
        second = ReconfigController(c.api)
        drive(second, c, lambda st: (st.get("summary") or {}).get("inTarget") == 4)
        consistent(c, BATCH, 4)


def test_a_failed_layout_change_rolls_the_gpu_back_and_reopens_it(tmp_path: Path) -> None:
    with cluster(tmp_path, nodes=1, gpus=3, replicas=3) as c:
        bad = next(iter(c.nodes["n0"].nvml.devices())).uuid
        c.nodes["n0"].nvml.fail_next_create(bad)
        c.api.replace_custom(PLURAL, schedule(override="batch"))
        ctl = ReconfigController(c.api)
        drive(ctl, c, lambda st: (st.get("summary") or {}).get("inTarget") == 2
              and (st.get("gpus") or {}).get(bad, {}).get("phase") == "Failed"
              and next(x for x in st["conditions"] if x["type"] == "Ready")["reason"]
              == "Failed")
        st = status(c)
        assert "injected failure" in st["gpus"][bad]["message"]
        assert layouts(c)[bad] == INFERENCE  # back to its last good layout
        ready = next(x for x in st["conditions"] if x["type"] == "Ready")
        assert ready["status"] == "False" and ready["reason"] == "Failed"
        assert wait(lambda: all(running(c, s) == 3 for s in ("alpha", "beta")), 20)
        assert not any((n["metadata"].get("annotations") or {}).get(CORDONED_ANNOTATION)
                       for n in c.api.list_nodes())


def test_an_impossible_transition_waits_says_why_and_changes_nothing(tmp_path: Path) -> None:
    with cluster(tmp_path, nodes=1, gpus=2, replicas=7) as c:  # 14 x 1g: both GPUs full
        before = sorted(p["metadata"]["name"] for p in c.api.list_pods())
        c.api.replace_custom(PLURAL, schedule(override="batch"))
        ctl = ReconfigController(c.api)
        for _ in range(5):
            ctl.step()
        st = status(c)
        ready = next(x for x in st["conditions"] if x["type"] == "Ready")
        assert ready["reason"] == "Waiting" and "no room elsewhere for demo/" in ready["message"]
        assert all(g["phase"] == "Waiting" for g in st["gpus"].values())
        assert sorted(p["metadata"]["name"] for p in c.api.list_pods()) == before
        assert set(layouts(c).values()) == {INFERENCE}
        ann = c.api.list_nodes()[0]["metadata"].get("annotations") or {}
        assert not ann.get(CORDONED_ANNOTATION) and "gpuslice.io/mig-desired" not in ann


def test_cli_plan_shows_what_would_change_and_run_once_starts_it(tmp_path: Path,
                                                                  capsys: Any) -> None:
    import yaml

    from gpuslice.adapters.kube.annotation import encode
    from gpuslice.cli import main
    from gpuslice.core.assignment import Assignment, ContainerAssignment, GpuShare, Mode

    inv = [{"uuid": f"GPU-{i}", "index": i, "model": "A100-80GB", "memoryMiB": 81920}
           for i in range(2)]
    lay = {f"GPU-{i}": {"layout": INFERENCE, "state": "success", "message": ""}
           for i in range(2)}
    a = Assignment("ml", "r0", "uid-ml-r0", "n0", (ContainerAssignment(
        "main", Mode.MPS, (GpuShare("GPU-0", 142, 9000),)),), "2026-11-22T10:00:00Z")
    doc = {"nodes": [{"metadata": {"name": "n0", "annotations": {
        "gpuslice.io/inventory": json.dumps(inv), "gpuslice.io/mig-layouts": json.dumps(lay)}}}],
        "pods": [{"metadata": {"name": "r0", "namespace": "ml",
                               "annotations": {"gpuslice.io/assignment": encode(a)}},
                  "spec": {"nodeName": "n0", "containers": [{"name": "main", "resources": {
                      "limits": {"gpuslice.io/gpu-milli": "142"}}}]}}],
        "sliceschedules": [schedule()]}
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(doc))
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(schedule()))
    assert main(["reconfig", "plan", str(tmp_path / "s.yaml"), "--fake-cluster",
                 str(tmp_path / "cluster.yaml"), "--at", "23:00", "-o", "json"]) == 0
    res = json.loads(capsys.readouterr().out)[0]
    assert res["target"] == "batch" and len(res["changes"]) == 2
    first = res["changes"][0]
    assert first["from"] == INFERENCE and first["to"] == BATCH
    assert first["moves"] == ["ml/r0"] and first["blocked"] is None
    assert main(["reconfig", "plan", "--fake-cluster", str(tmp_path / "cluster.yaml"),
                 "--at", "12:00", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["changes"] == []  # daytime: nothing to do
    assert main(["reconfig", "run", "--once", "--fake-cluster", str(tmp_path / "cluster.yaml"),
                 "--at", "23:00"]) == 0
    # the controller logs each step on stderr as it happens
    assert "GPU-1 on n0: cordoned" in capsys.readouterr().err  # the empty GPU goes first
    assert main(["reconfig", "plan", "--at", "25:00", "--fake-cluster",
                 str(tmp_path / "cluster.yaml")]) == 2
    assert "--at" in capsys.readouterr().err


def test_a_gpu_with_mig_disabled_is_reported_and_never_touched(tmp_path: Path) -> None:
    with cluster(tmp_path, nodes=1, gpus=2, replicas=2) as c:
        c.add_node(NodeSpec("plain", ("A100-80GB",)))  # MIG-capable, MIG disabled
        assert wait(lambda: "gpuslice.io/mig-layouts" in (next(
            n for n in c.api.list_nodes() if n["metadata"]["name"] == "plain")["metadata"]
            .get("annotations") or {}), 10)
        c.api.replace_custom(PLURAL, schedule(override="batch"))
        drive(ReconfigController(c.api), c,
              lambda st: (st.get("summary") or {}).get("inTarget") == 2
              and next(x for x in st["conditions"] if x["type"] == "Ready")["reason"]
              == "Failed")
        st = status(c)["gpus"]["GPU-plain-0"]
        assert st["phase"] == "Failed" and "MIG mode is disabled" in st["message"]
        ann = next(n for n in c.api.list_nodes()
                   if n["metadata"]["name"] == "plain")["metadata"]["annotations"]
        assert not ann.get(CORDONED_ANNOTATION) and "gpuslice.io/mig-desired" not in ann


def test_gpu_label_names_stay_valid_for_any_uuid() -> None:
    import re

    from gpuslice.services.reconfig import _label_key

    for u in ("GPU-12345678-1234-1234-1234-123456789abc", "MIG-" + "x" * 80, "GPU-a/b:c"):
        name = "reconfig." + _label_key(u)
        assert len(name) <= 63 and re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?",
                                                 name)


class FakeController:
    """A stand-in for a Kubernetes controller: :meth:`reconcile` every 50 ms on a thread, from
    entering the ``with`` block to leaving it."""

    def __init__(self, c: Cluster) -> None:
        self.c = c
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def reconcile(self) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            self.reconcile()

    def __enter__(self) -> Self:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(5)


class FakeReplicaSets(FakeController):
    """The ReplicaSet controller, as far as this test needs it: keeps ``replicas`` pods owned
    by each ReplicaSet, creating one from its template when one goes (never adopting pods
    without its pod-template-hash, as the real one)."""

    def __init__(self, c: Cluster, sets: dict[str, int]) -> None:
        super().__init__(c)
        self.sets = sets
        self.made = 0

    def reconcile(self) -> None:
        pods = self.c.api.list_pods()
        for rs, n in self.sets.items():
            mine = [p for p in pods if any(r.get("uid") == f"uid-{rs}" for r in
                                           p["metadata"].get("ownerReferences") or [])]
            for _ in range(n - len(mine)):
                self.made += 1
                pod = gpu_pod(f"{rs}-{self.made:03d}", service=rs.split("-")[0],
                              model="resnet50", milli=142, memory_mib=9000,
                              gpu_models="A100-80GB", batch=2)
                pod["metadata"]["labels"]["pod-template-hash"] = "abc123"
                pod["metadata"]["ownerReferences"] = [{
                    "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": rs,
                    "uid": f"uid-{rs}", "controller": True}]
                self.c.api.add_pod(pod)


def serving(c: Cluster, svc: str) -> int:
    """Pods of ``svc`` that are ready and not draining: what the router sends requests to."""
    return sum(1 for p in c.api.list_pods()
               if (p["metadata"].get("labels") or {}).get("gpuslice.io/service") == svc
               and (p.get("status") or {}).get("endpoint")
               and (p["metadata"].get("annotations") or {}).get("gpuslice.io/draining")
               != "true")


def test_replicaset_pods_move_through_stand_ins_and_capacity_never_dips(
        tmp_path: Path) -> None:
    with cluster(tmp_path, nodes=2, gpus=2, replicas=0) as c, \
            FakeReplicaSets(c, {"alpha-rs": 4, "beta-rs": 3}) as rs:
        assert wait(lambda: serving(c, "alpha") == 4 and serving(c, "beta") == 3, 30)
        lows = {"alpha": 4, "beta": 3}
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                for svc, low in lows.items():
                    lows[svc] = min(low, serving(c, svc))
                time.sleep(0.02)

        t = threading.Thread(target=watch)
        t.start()
        try:
            c.api.replace_custom(PLURAL, schedule(override="batch"))
            ctl = ReconfigController(c.api)
            drive(ctl, c, lambda st: (st.get("summary") or {}).get("inTarget") == 4,
                  timeout_s=120)
        finally:
            stop.set()
            t.join()
        assert lows == {"alpha": 4, "beta": 3}  # never fewer serving pods than before
        assert any("waiting for the ReplicaSets" in line for line in ctl.log), ctl.log
        pods = c.api.list_pods()
        assert not [p for p in pods if not p["metadata"].get("ownerReferences")]  # stand-ins gone
        assert wait(lambda: serving(c, "alpha") == 4 and serving(c, "beta") == 3, 20)
        assert set(layouts(c).values()) == {BATCH}
        assert rs.made > 7  # the ReplicaSets replaced the evicted pods


def test_statefulset_pods_are_not_moved_and_the_gpu_waits(tmp_path: Path) -> None:
    with cluster(tmp_path, nodes=1, gpus=2, replicas=0) as c:
        pod = gpu_pod("db-0", service="alpha", model="resnet50", milli=142, memory_mib=9000,
                      gpu_models="A100-80GB")
        pod["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "StatefulSet",
                                               "name": "db", "uid": "uid-db"}]
        c.api.add_pod(pod)
        assert wait(lambda: c.container_of("demo/db-0") is not None, 20)
        c.api.replace_custom(PLURAL, schedule(override="batch"))
        drive(ReconfigController(c.api), c, lambda st: any(
            g.get("phase") == "Waiting" for g in (st.get("gpus") or {}).values()))
        st = status(c)
        waiting = [g for g in st["gpus"].values() if g["phase"] == "Waiting"]
        assert waiting and "managed by a StatefulSet" in waiting[0]["message"]
        assert c.container_of("demo/db-0") is not None  # untouched


def test_room_is_judged_per_mig_instance_as_the_extender_places_slices(tmp_path: Path) -> None:
    """On MIG-enabled GPUs MPS slices go inside instances: 400 milli free on a GPU in four
    small instances is no room for a 200-milli replica. Both GPUs wait and nothing changes
    (judged per GPU, the controller would cordon one and leave its replacement pending)."""
    layout = "2g.20gb@0,2g.20gb@2,2g.20gb@4,1g.10gb@6"
    with cluster(tmp_path, nodes=1, gpus=2, replicas=0, mig=layout) as c:
        for k in range(4):
            c.api.add_pod(gpu_pod(f"p-{k}", service="alpha", model="resnet50", milli=200,
                                  memory_mib=9000, gpu_models="A100-80GB", batch=2))
        assert wait(lambda: all(c.container_of(f"demo/p-{k}") for k in range(4)), 30), \
            c.log.tail(10)
        c.api.replace_custom(PLURAL, schedule(override="batch"))
        ctl = ReconfigController(c.api)
        for _ in range(5):
            ctl.step()
        st = status(c)
        assert all(g["phase"] == "Waiting" for g in st["gpus"].values()), st["gpus"]
        ready = next(x for x in st["conditions"] if x["type"] == "Ready")
        assert "no room elsewhere for demo/p-" in ready["message"], ready
        ann = c.api.list_nodes()[0]["metadata"].get("annotations") or {}
        assert not ann.get(CORDONED_ANNOTATION) and "gpuslice.io/mig-desired" not in ann
