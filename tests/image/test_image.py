"""The container image, run the way a pod runs it: scripts/build-image.sh builds it (or reuses its
cached build of the same inputs), umoci unpacks it, runc runs it as UID 65532 with a read-only
root filesystem and /tmp (a tmpfs) the only writable path, without a network.

Needs root, runc, umoci and the build script's tools (mmdebstrap, skopeo); skipped without them
outside CI, a failure under CI (.ci/run installs them). GPUSLICE_IMAGE_JSON names the image.json
of a build already made (.ci/run builds before the tests, so the build's minutes are not spent
inside a test's timeout).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import gpuslice

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = ["extender", "node-agent", "router", "reconfig", "mig-apply"]
SIZE_GOAL = 300_000_000
# a build without a cache takes minutes (the module's first test waits for it); runs are seconds
pytestmark = pytest.mark.timeout(1800)


def _missing_tools() -> list[str]:
    tools = [t for t in ("runc", "umoci", "skopeo", "mmdebstrap") if shutil.which(t) is None]
    return tools + (["root"] if os.geteuid() != 0 else [])


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    given = os.environ.get("GPUSLICE_IMAGE_JSON")
    if given:
        return dict(json.loads(Path(given).read_text()))
    missing = _missing_tools()
    if missing:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"the image smoke test needs {', '.join(missing)} under CI")
        pytest.skip(f"needs {', '.join(missing)} (apt-get install mmdebstrap umoci skopeo runc)")
    out = tmp_path_factory.mktemp("image")
    subprocess.run([str(ROOT / "scripts" / "build-image.sh"), "--out", str(out)], check=True,
                   timeout=3000)
    return dict(json.loads((out / "image.json").read_text()))


@pytest.fixture(scope="module")
def bundle(image: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    missing = [t for t in _missing_tools() if t in ("runc", "umoci", "root")]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} to run the image")
    where = tmp_path_factory.mktemp("bundle") / "b"
    subprocess.run(["umoci", "unpack", "--image", f"{image['layout']}:{image['tag']}",
                    str(where)], check=True, capture_output=True, timeout=300)
    yield where
    shutil.rmtree(where, ignore_errors=True)


def run(bundle: Path, *args: str, writable: str = "/tmp") -> subprocess.CompletedProcess[str]:
    """``args`` in the image under runc, as its configured user (65532), root read-only, a tmpfs
    on ``writable``; the environment and working directory are the image's."""
    cfg_path = bundle / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["process"]["args"] = list(args)  # instead of the image's entrypoint
    cfg["process"]["terminal"] = False
    cfg["root"]["readonly"] = True
    cfg["mounts"] = [m for m in cfg["mounts"] if m["destination"] != writable] + [
        {"destination": writable, "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "nodev", "mode=1777", "size=64m"]}]
    cfg["process"]["rlimits"] = [{"type": "RLIMIT_NOFILE", "hard": 4096, "soft": 4096}]
    cfg_path.write_text(json.dumps(cfg))
    state = bundle.parent / "runc-state"
    return subprocess.run(["runc", "--root", str(state), "run", "--bundle", str(bundle),
                           f"gpuslice-smoke-{uuid.uuid4().hex[:10]}"],
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_image_runs_as_65532_on_a_read_only_root(bundle: Path) -> None:
    cfg = json.loads((bundle / "config.json").read_text())
    assert (cfg["process"]["user"]["uid"], cfg["process"]["user"]["gid"]) == (65532, 65532)
    out = run(bundle, "/opt/gpuslice/bin/python", "-c", """
import os, pathlib
print(os.getuid(), os.getgid())
pathlib.Path("/tmp/w").write_text("x")
try:
    pathlib.Path("/opt/gpuslice/w").write_text("x")
except OSError as e:
    print("root fs:", e.strerror)
""")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["65532 65532", "root fs: Read-only file system"]


def test_version_names_the_version_and_the_revision_baked_at_build(
        bundle: Path, image: dict[str, Any]) -> None:
    for prog, name in (("gpuslice", "gpuslice"), ("kubectl-gpuslice", "kubectl gpuslice")):
        out = run(bundle, prog, "--version")
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == \
            f"{name} {gpuslice.__version__} (revision {image['revision']})"


def test_every_component_starts_to_its_help(bundle: Path) -> None:
    top = run(bundle, "gpuslice", "--help")
    assert top.returncode == 0, top.stderr
    components = COMPONENTS + (["dra-driver"] if "dra-driver" in top.stdout else [])
    for component in components:
        out = run(bundle, "gpuslice", component, "--help")
        assert out.returncode == 0, (component, out.stderr)
        assert out.stdout.startswith(f"usage: gpuslice {component}"), (component, out.stdout)
        assert out.stderr == "", (component, out.stderr)  # no warning (matplotlib config, ...)


def test_components_import_no_plotting_or_solver_and_those_name_their_extra(
        bundle: Path) -> None:
    """The image leaves out matplotlib and scipy: every component's modules import without them,
    and the commands that need them say which extra to install."""
    out = run(bundle, "python", "-c", """
import sys
import gpuslice.cli, gpuslice.kubectl_plugin
import gpuslice.services.extender, gpuslice.services.node_agent, gpuslice.services.router
import gpuslice.services.reconfig, gpuslice.services.mig_executor
import gpuslice.adapters.kube.client, gpuslice.adapters.nvml.real
import kubernetes.client, pynvml
print(sorted({m.split(".")[0] for m in sys.modules} & {"scipy", "matplotlib"}))
from gpuslice.core.errors import MissingDependency
from gpuslice.adapters.optional import pyplot
from gpuslice.core.planner import _scipy_optimize
for need in (pyplot, _scipy_optimize):
    try:
        need()
    except MissingDependency as e:
        print(e)
""")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "[]"
    assert "pip install 'gpuslice[plot]'" in lines[1]
    assert "pip install 'gpuslice[planner]'" in lines[2]


def test_labels_and_size(image: dict[str, Any]) -> None:
    layout = Path(image["layout"])
    blob = layout / "blobs" / "sha256"
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads((blob / index["manifests"][0]["digest"].split(":")[1]).read_text())
    assert index["manifests"][0]["digest"] == image["digest"]
    config = json.loads((blob / manifest["config"]["digest"].split(":")[1]).read_text())
    labels = config["config"]["Labels"]
    assert labels["org.opencontainers.image.version"] == gpuslice.__version__
    assert labels["org.opencontainers.image.revision"] == image["revision"]
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0 AND MIT"
    assert labels["org.opencontainers.image.source"].startswith("https://")
    assert manifest["annotations"] == labels
    assert config["config"]["User"] == "65532:65532"
    assert image["uncompressed_bytes"] <= SIZE_GOAL, image["uncompressed_bytes"]


def test_deploy_pins_the_digest_of_this_build(image: dict[str, Any]) -> None:
    """deploy/image.env (and through it the production overlay and the chart) pins the digest
    the build script makes from these sources. The image depends only on the image's inputs
    (not on deploy/, docs or tests), so pinning does not change what it pins."""
    if image["revision"].endswith("-dirty"):
        pytest.skip("the image's inputs have uncommitted changes: nothing to compare a pin with")
    env = dict(line.split("=", 1) for line in (ROOT / "deploy" / "image.env").read_text()
               .splitlines() if line and not line.startswith("#"))
    assert env["IMAGE_DIGEST"] == image["digest"], (
        "the image's inputs changed since deploy/image.env was pinned: run "
        "scripts/build-image.sh --pin and commit deploy/")
