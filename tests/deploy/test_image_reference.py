"""The image reference is written in one place, deploy/image.env; the production overlay, the Helm
chart and the base manifests must say the same (scripts/build-image.sh --pin rewrites them), and
its tag is the package version."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

import gpuslice

ROOT = Path(__file__).resolve().parents[2]


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
    [stanza] = [i for i in kust["images"] if i["name"] == "gpuslice"]
    assert (stanza["newName"], str(stanza["newTag"]), stanza["digest"]) == \
        (env["IMAGE_REPOSITORY"], env["IMAGE_TAG"], env["IMAGE_DIGEST"])
    chart = ROOT / "deploy" / "helm" / "gpuslice"
    values = yaml.safe_load((chart / "values.yaml").read_text())["image"]
    assert (values["repository"], str(values["tag"]), values["digest"]) == \
        (env["IMAGE_REPOSITORY"], env["IMAGE_TAG"], env["IMAGE_DIGEST"])
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    assert meta["appVersion"] == meta["version"] == gpuslice.__version__


def test_base_manifests_name_the_image_the_overlays_replace() -> None:
    """Every gpuslice container in deploy/base and deploy/examples is ``gpuslice:<version>``
    (the name the production overlay's images: stanza rewrites; a dev cluster loads it under
    that name)."""
    found = []
    for path in sorted((ROOT / "deploy").glob("[be]*/*.yaml")):
        for image in re.findall(r"^\s*image:\s*(\S+)", path.read_text(), flags=re.M):
            if "gpuslice" in image.rsplit("/", 1)[-1]:
                found.append((path.name, image))
    assert found and all(image == f"gpuslice:{gpuslice.__version__}" for _, image in found), found


def test_the_pin_rewriter_finds_one_digest_line_in_each_file() -> None:
    """scripts/build-image.sh --pin rewrites the first ``digest:`` line of the overlay and the
    chart values and IMAGE_DIGEST of image.env: each must exist, and be the image's."""
    for path, pattern in [("deploy/image.env", r"^IMAGE_DIGEST=(.*)$"),
                          ("deploy/overlays/production/kustomization.yaml", r"^\s+digest: (.*)$"),
                          ("deploy/helm/gpuslice/values.yaml", r"^\s+digest: (.*)$")]:
        values = re.findall(pattern, (ROOT / path).read_text(), flags=re.M)
        assert values[:1] == [image_env()["IMAGE_DIGEST"]], path
