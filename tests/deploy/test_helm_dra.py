"""The DRA path in the Helm chart (``path: dra``): one ``helm install`` serves either path. With
``path=dra`` the chart renders exactly deploy/dra's and deploy/dra-allocator's objects (the
driver DaemonSet, its RBAC, the DeviceClasses, the claim allocator) and the MPS host, and
none of the device-plugin path's objects (node agent, extender, second scheduler, webhook,
reconfig); every object validates against the 1.35 schemas (resource.k8s.io/v1); a cluster
older than 1.34 is refused; the values reach the driver's and the allocator's command lines,
which the CLI accepts."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.test_helm_chart import CHART, HELM_ONLY_LABELS, NAMESPACE, by_key, helm
from tests.deploy.test_manifests import ROOT

DRA_VERSION = "1.36.0"


def chart(*sets: str, version: str = DRA_VERSION, values: Path | None = None,
          ) -> subprocess.CompletedProcess[str]:
    args = [helm(), "template", "gpuslice", str(CHART), "--namespace", NAMESPACE,
            "--kube-version", version, "--set", "path=dra"]
    if values is not None:
        args += ["-f", str(values)]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)


def chart_docs(*sets: str, values: Path | None = None) -> list[dict[str, Any]]:
    out = chart(*sets, values=values)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def kustomize(folder: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: cannot render deploy/ with kustomize")
    out = subprocess.run([kubectl, "kustomize", str(ROOT / "deploy" / folder)], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_path_dra_renders_the_objects_of_deploy_dra_and_the_allocator() -> None:
    want = by_key(kustomize("dra") + kustomize("dra-allocator"))
    del want[("Namespace", NAMESPACE)]  # helm install --create-namespace owns it
    # the MPS host is one object of both paths, compared on the device-plugin path
    # (test_helm_chart); here it is the chart's own
    del want[("DaemonSet", "gpuslice-mps-host")]
    for key, d in want.items():  # kustomize does not know DeviceClasses are cluster-scoped
        if key[0] == "DeviceClass":
            d["metadata"].pop("namespace")
    got = by_key(chart_docs("image.digest="))
    for d in got.values():
        for label in HELM_ONLY_LABELS:
            d["metadata"].get("labels", {}).pop(label, None)
    for key, obj in want.items():
        assert key in got, key
        assert got[key] == obj, key
    # and nothing else but the MPS host and the SliceSchedule CRD (kept: a path switch must not
    # delete the schedules): none of the device-plugin path's node agent, extender, second
    # scheduler, webhook, reconfig controller or the Secrets they wait for (an install would
    # wait on them forever)
    assert sorted(got) == sorted([*want, ("DaemonSet", "gpuslice-mps-host"), (
        "CustomResourceDefinition", "sliceschedules.gpuslice.io")])


def test_every_object_validates_against_the_1_35_schemas() -> None:
    for d in chart_docs() + chart_docs("dra.fakeGpus=2"):
        kubernetes_validate.validate(d, "1.35", strict=True)


@pytest.mark.parametrize("sets", [["path=dra"], ["path=dra", "dra.fakeGpus=2"]])
def test_helm_lint_strict_passes_on_the_dra_path(sets: list[str]) -> None:
    args = [helm(), "lint", "--strict", str(CHART), "--kube-version", DRA_VERSION]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_cluster_older_than_1_34_is_refused_on_the_dra_path() -> None:
    out = chart(version="1.33.2")
    assert out.returncode != 0 and "path=dra needs Kubernetes 1.34 or newer" in out.stderr


def test_dra_values_reach_command_lines_the_cli_accepts() -> None:
    from gpuslice.cli import _build_parser

    obj = by_key(chart_docs("dra.mode=whole", "dra.extraArgs[0]=--gpu-mode=1=mig",
                            "dra.allocator.extraArgs[0]=--interval=1",
                            "dra.nodeSelector.gpuslice\\.io/path=dra"))
    driver = obj[("DaemonSet", "gpuslice-dra-driver")]["spec"]["template"]["spec"]
    cmd = driver["containers"][0]["command"]
    assert cmd[0] == "gpuslice"
    args = _build_parser().parse_args(cmd[1:])
    assert (args.command, args.mode, args.gpu_mode) == ("dra-driver", "whole", ["1=mig"])
    assert driver["nodeSelector"] == {"nvidia.com/gpu.present": "true", "gpuslice.io/path": "dra"}
    alloc = obj[("Deployment", "gpuslice-dra-allocator")]["spec"]["template"]["spec"]
    args = _build_parser().parse_args(alloc["containers"][0]["args"])
    assert args.command == "dra-allocator" and args.interval == 1.0
    assert ("Deployment", "gpuslice-dra-allocator") not in by_key(
        chart_docs("dra.allocator.enabled=false"))
    assert not [k for k in by_key(chart_docs("dra.deviceClasses=false"))
                if k[0] == "DeviceClass"]
    bad = chart("dra.mode=half")
    assert bad.returncode != 0 and "mode" in bad.stderr


def test_fake_gpus_render_the_dra_fake_gpus_overlays_driver_and_mps_host(tmp_path: Path) -> None:
    """``dra.fakeGpus`` is deploy/overlays/dra-fake-gpus as a value (the real node's install
    test uses it): the same driver (``--fake-gpus``, ``--dev-dir``, the init container making
    the device nodes' look-alikes) and stand-in MPS daemons, on the nodes it is pointed at."""
    fake = {"gpuslice.io/fake-gpus": "true", "nvidia.com/gpu.present": None}
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"image": {"digest": ""}, "dra": {
        "fakeGpus": 2, "nodeSelector": fake}, "nodeAgent": {"nodeSelector": fake}}))
    got = by_key(chart_docs("dra.fakeGpus=2", values=values))
    want = by_key(kustomize("overlays/dra-fake-gpus"))
    for name in ("gpuslice-dra-driver", "gpuslice-mps-host"):
        assert got[("DaemonSet", name)]["spec"] == want[("DaemonSet", name)]["spec"], name
    # without it, the real GPUs: no stand-ins, no init container
    real = by_key(chart_docs())
    assert "--fake" not in real[("DaemonSet", "gpuslice-mps-host")]["spec"]["template"][
        "spec"]["containers"][0]["args"]
    driver = real[("DaemonSet", "gpuslice-dra-driver")]["spec"]["template"]["spec"]
    assert "initContainers" not in driver
    assert not [a for a in driver["containers"][0]["command"] if a.startswith("--fake")]
    bad = chart("dra.fakeGpus=-1")
    assert bad.returncode != 0 and "fakeGpus" in bad.stderr
