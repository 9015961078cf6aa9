"""The generative examples (issue 52, point 5): deploy/examples/vllm.yaml (vLLM on half an L4)
and triton-openai.yaml (Triton's OpenAI frontend on a quarter) validate against the Kubernetes
schemas, stay out of the examples' kustomization (the dev overlay does not pull their
images and models unasked) and give vLLM the memory fraction ``vllm_memory_fraction`` computes from
the slice's memory and the GPU's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gpuslice.core import catalog
from gpuslice.core.generative import vllm_memory_fraction
from tests.deploy.test_manifests import K8S_VERSION

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples"
FILES = ["vllm.yaml", "triton-openai.yaml"]


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


def kind(name: str, k: str) -> dict[str, Any]:
    (d,) = [d for d in docs(name) if d["kind"] == k]
    return d


def slice_fraction(dep: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """What vllm_memory_fraction gives the Deployment's slice (its gpu-memory on its one GPU
    model), and its container."""
    pod = dep["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    model = catalog.lookup(pod["metadata"]["annotations"]["gpuslice.io/gpu-model"])
    assert model is not None
    mib = int(c["resources"]["limits"]["gpuslice.io/gpu-memory"])
    return vllm_memory_fraction(mib, model.memory_mib), c


@pytest.mark.parametrize("name", FILES)
def test_the_example_validates_and_applies_on_its_own(name: str) -> None:
    for d in docs(name):
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    kust = yaml.safe_load((EXAMPLES / "kustomization.yaml").read_text())
    assert name not in kust["resources"]
    assert f"kubectl apply -f deploy/examples/{name}" in \
        (EXAMPLES.parents[1] / "docs" / "router.md").read_text()


@pytest.mark.parametrize("name", FILES)
def test_the_pods_go_through_gpuslice_and_their_service_finds_them(name: str) -> None:
    dep, svc = kind(name, "Deployment"), kind(name, "Service")
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert pod["spec"]["schedulerName"] == "gpuslice-scheduler"
    assert pod["metadata"]["annotations"]["gpuslice.io/isolation"] == "mps"
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    assert labels["gpuslice.io/service"] == svc["metadata"]["name"]
    assert labels["gpuslice.io/gpu-model"] == pod["metadata"]["annotations"][
        "gpuslice.io/gpu-model"]
    (c,) = pod["spec"]["containers"]
    (port,) = svc["spec"]["ports"]
    assert port["targetPort"] in {p["name"] for p in c["ports"]}
    assert c["readinessProbe"]["httpGet"]["port"] == port["targetPort"]


def test_vllm_gets_the_slices_share_of_the_gpu_memory() -> None:
    want, c = slice_fraction(kind("vllm.yaml", "Deployment"))
    limits = c["resources"]["limits"]
    assert (limits["gpuslice.io/gpu"], limits["gpuslice.io/gpu-milli"]) == ("1", "500")
    assert want == 0.45  # (12288 - 1024) / 24576, rounded down, as the file's comment says
    args = dict(a.removeprefix("--").split("=", 1) for a in c["args"] if a.startswith("--"))
    assert float(args["gpu-memory-utilization"]) == want
    assert "(12288 - 1024) MiB / 24576 MiB = 0.458, rounded down: 0.45" in \
        (EXAMPLES / "vllm.yaml").read_text()
    assert c["command"] == ["vllm", "serve"] and c["args"][0] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert int(args["port"]) == c["ports"][0]["containerPort"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"


def test_triton_serves_its_model_repository_with_the_slices_share() -> None:
    want, c = slice_fraction(kind("triton-openai.yaml", "Deployment"))
    assert c["resources"]["limits"]["gpuslice.io/gpu-milli"] == "250"
    cm = kind("triton-openai.yaml", "ConfigMap")
    engine = json.loads(cm["data"]["model.json"])
    assert want == 0.2 and engine["gpu_memory_utilization"] == want
    assert 'backend: "vllm"' in cm["data"]["config.pbtxt"]
    # python/openai/README.md of triton-inference-server/server: main.py of the frontend,
    # --model-repository and --tokenizer; --openai-port (default 9000) is the container's port
    assert c["command"] == ["python3", "/opt/tritonserver/python/openai/openai_frontend/main.py"]
    args = dict(a.removeprefix("--").split("=", 1) for a in c["args"])
    assert args["tokenizer"] == engine["model"]
    assert int(args["openai-port"]) == c["ports"][0]["containerPort"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    # the repository: MODEL/config.pbtxt and MODEL/1/model.json, from the ConfigMap
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == args["model-repository"])
    pod = kind("triton-openai.yaml", "Deployment")["spec"]["template"]["spec"]
    vol = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    paths = {i["key"]: i["path"] for i in vol["configMap"]["items"]}
    model = paths["config.pbtxt"].split("/")[0]
    assert paths == {"config.pbtxt": f"{model}/config.pbtxt",
                     "model.json": f"{model}/1/model.json"}
    assert vol["configMap"]["name"] == cm["metadata"]["name"]
