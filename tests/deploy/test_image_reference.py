"""The image reference is written in one place, deploy/image.env; every install path must say the
same: the Helm chart's values, the images: stanza of each kustomization that deploys a container
(the production overlay adds the digest; scripts/build-image.sh --pin rewrites it), and so every
container that kustomize or Helm renders from deploy/ runs that image; its tag is the package
version."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import gpuslice

ROOT = Path(__file__).resolve().parents[2]
# the images deploy/ runs that are not gpuslice's: the second scheduler and the example workloads
THIRD_PARTY = {"registry.k8s.io/kube-scheduler", "nvcr.io/nvidia/tritonserver",
               "nvcr.io/nvidia/pytorch", "vllm/vllm-openai"}
# the install paths that pin the digest (the others name the image by tag, as a dev cluster
# loads it from scripts/build-image.sh's archive)
PINNED = {"deploy/overlays/production", "helm"}


def image_env() -> dict[str, str]:
    lines = (ROOT / "deploy" / "image.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def test_image_env_names_a_tag_that_is_the_package_version_and_a_digest() -> None:
    env = image_env()
    assert env["IMAGE_TAG"] == gpuslice.__version__
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", env["IMAGE_DIGEST"]), env["IMAGE_DIGEST"]
    assert re.fullmatch(r"[a-z0-9.-]+(:\d+)?(/[a-z0-9._-]+)+", env["IMAGE_REPOSITORY"])


def test_production_overlay_and_chart_pin_the_image_of_image_env() -> None:
    env = image_env()
    kust = yaml.safe_load((ROOT / "deploy/overlays/production/kustomization.yaml").read_text())
    # deploy/base has named the image already: the overlay's stanza matches that name
    [stanza] = kust["images"]
    assert (stanza["name"], stanza["newName"], str(stanza["newTag"]), stanza["digest"]) == \
        (env["IMAGE_REPOSITORY"], env["IMAGE_REPOSITORY"], env["IMAGE_TAG"], env["IMAGE_DIGEST"])
    chart = ROOT / "deploy" / "helm" / "gpuslice"
    values = yaml.safe_load((chart / "values.yaml").read_text())["image"]
    assert (values["repository"], str(values["tag"]), values["digest"]) == \
        (env["IMAGE_REPOSITORY"], env["IMAGE_TAG"], env["IMAGE_DIGEST"])
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    assert meta["appVersion"] == meta["version"] == gpuslice.__version__


# examples a guide applies with ``kubectl apply -f`` (no kustomize to name the image): they
# say the reference of deploy/image.env by tag, as the dev cluster imports the image
APPLIED_AS_IS = {"try-locally.yaml"}


def test_examples_applied_as_is_name_the_image_of_image_env_by_tag() -> None:
    env = image_env()
    for name in APPLIED_AS_IS:
        [path] = (ROOT / "deploy").rglob(name)
        images = re.findall(r"^\s*(?:- )?image:\s*(\S+)", path.read_text(), flags=re.M)
        assert images and set(images) == {f"{env['IMAGE_REPOSITORY']}:{env['IMAGE_TAG']}"}, \
            (path, images)


def test_manifests_name_the_placeholder_their_kustomization_replaces() -> None:
    """Every gpuslice container in the manifests under deploy/ (the chart aside) says ``gpuslice``
    with no tag: the name and tag are those of its kustomization's images: stanza, not of the
    file (so a new manifest cannot bring its own)."""
    found = []
    for path in sorted((ROOT / "deploy").rglob("*.yaml")):
        if "helm" in path.relative_to(ROOT / "deploy").parts or path.name == "kustomization.yaml":
            continue
        if path.name in APPLIED_AS_IS:
            continue
        for image in re.findall(r"^\s*(?:- )?image:\s*(\S+)", path.read_text(), flags=re.M):
            if image.split(":")[0] not in THIRD_PARTY:
                found.append((str(path.relative_to(ROOT)), image))
    assert len(found) >= 6 and all(image == "gpuslice" for _, image in found), found


def _kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("kubectl is needed to render deploy/ under CI")
        pytest.skip("kubectl not installed: cannot render deploy/ with kustomize")
    return found


def _kustomizations() -> list[str]:
    return sorted(str(p.parent.relative_to(ROOT))
                  for p in (ROOT / "deploy").rglob("kustomization.yaml"))


def _images(obj: Any) -> Iterator[str]:
    """The image of every container, init container and ephemeral container in ``obj``, at any
    depth (a Pod's spec, a Deployment's template, a Job's, ...)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in ("containers", "initContainers", "ephemeralContainers") \
                    and isinstance(value, list):
                yield from (c["image"] for c in value)
            else:
                yield from _images(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _images(value)


def _check_images(where: str, docs: list[dict[str, Any]]) -> None:
    env = image_env()
    ref = f"{env['IMAGE_REPOSITORY']}:{env['IMAGE_TAG']}"
    want = f"{ref}@{env['IMAGE_DIGEST']}" if where in PINNED else ref
    images = [i for d in docs for i in _images(d)]
    ours = [i for i in images if i.rsplit(":", 1)[0] not in THIRD_PARTY]
    assert ours, f"{where}: no gpuslice container"
    assert set(ours) == {want}, (where, sorted(set(ours)))


def test_every_kustomization_names_the_built_image() -> None:
    """``kubectl kustomize`` of each kustomization under deploy/: every container that is not a
    third-party image (THIRD_PARTY) runs the image of deploy/image.env, by tag, and with its
    digest where the path pins it (PINNED)."""
    kustomizations = _kustomizations()
    assert {"deploy/base", "deploy/dra", "deploy/dra-allocator", "deploy/dra/examples",
            "deploy/examples", "deploy/overlays/dev", "deploy/overlays/production"} <= \
        set(kustomizations)
    kubectl = _kubectl()
    for k in kustomizations:
        out = subprocess.run([kubectl, "kustomize", str(ROOT / k)], check=True,
                             capture_output=True, text=True, timeout=60).stdout
        _check_images(k, [d for d in yaml.safe_load_all(out) if d])


def test_the_chart_names_the_built_image() -> None:
    """``helm template`` of the chart as the install guide runs it (no --kube-version): every
    container runs the pinned image of deploy/image.env."""
    from tests.deploy.test_helm_chart import CHART, helm

    out = subprocess.run([helm(), "template", "gpuslice", str(CHART)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    _check_images("helm", [d for d in yaml.safe_load_all(out.stdout) if d])


@pytest.mark.parametrize("where", ["helm", "deploy/base"])
def test_a_foreign_image_is_caught(where: str) -> None:
    """The check itself: a container that names another image fails it."""
    spec = {"initContainers": [{"image": "ghcr.io/x/fake-replica:1"}],
            "containers": [{"image": "registry.k8s.io/kube-scheduler:v1"}]}
    docs = [{"kind": "Pod", "spec": spec}]
    with pytest.raises(AssertionError):
        _check_images(where, docs)


def test_the_pin_rewriter_finds_one_digest_line_in_each_file() -> None:
    """scripts/build-image.sh --pin rewrites the first ``digest:`` line of the overlay and the
    chart values and IMAGE_DIGEST of image.env: each must exist, and be the image's."""
    for path, pattern in [("deploy/image.env", r"^IMAGE_DIGEST=(.*)$"),
                          ("deploy/overlays/production/kustomization.yaml", r"^\s+digest: (.*)$"),
                          ("deploy/helm/gpuslice/values.yaml", r"^\s+digest: (.*)$")]:
        values = re.findall(pattern, (ROOT / path).read_text(), flags=re.M)
        assert values[:1] == [image_env()["IMAGE_DIGEST"]], path
