"""Packaging: --version, the optional dependencies (extras) and what the components import at
start-up, the image's dependency lock against pyproject.toml."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import gpuslice
from gpuslice._version import revision

ROOT = Path(__file__).resolve().parents[2]
# a module finder that makes these packages look absent, as in the container image
BLOCK = """
import sys
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _Absent())
"""


def python(code: str, blocked: tuple[str, ...] = (),
           **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK.format(blocked=set(blocked)) + code],
                          capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, **env}, cwd=ROOT)


@pytest.mark.parametrize("main", ["gpuslice.cli", "gpuslice.kubectl_plugin"])
def test_version_prints_version_and_revision(main: str) -> None:
    out = python(f"import {main} as m; m.main(['--version'])")
    assert out.returncode == 0, out.stderr
    name = "gpuslice" if main == "gpuslice.cli" else "kubectl gpuslice"
    assert out.stdout.strip() == f"{name} {gpuslice.__version__} (revision {revision()})"


def test_revision_in_a_checkout_is_git_describe_and_unknown_elsewhere(tmp_path: Path) -> None:
    """Run from src/ of this checkout, the revision is ``git describe``; the same module copied
    out of any checkout (an installed copy without baked build info) says ``unknown``."""
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True, cwd=ROOT, check=False)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    code = "from gpuslice._version import revision; print(revision())"
    here = python(code, PYTHONPATH=str(ROOT / "src"))
    assert here.returncode == 0, here.stderr
    assert here.stdout.strip().startswith(head.stdout.strip())
    (tmp_path / "gpuslice").mkdir()
    for name in ("__init__.py", "_version.py"):
        (tmp_path / "gpuslice" / name).write_text((ROOT / "src" / "gpuslice" / name).read_text())
    elsewhere = python(code, PYTHONPATH=str(tmp_path))
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert elsewhere.stdout.strip() == "unknown"


def test_a_wheel_built_from_a_git_checkout_carries_its_revision(tmp_path: Path) -> None:
    """``pip install .`` / ``pip wheel .`` of a checkout (not editable): setup.py writes
    ``gpuslice/_build_info.py`` with the checkout's ``git describe``, so the installed
    ``gpuslice --version`` names the revision it was built from, not "unknown"."""
    import importlib.util
    import zipfile

    describe = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"],
                              capture_output=True, text=True, cwd=ROOT, check=False)
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True, cwd=ROOT, check=False)
    if describe.returncode != 0 or head.returncode != 0:
        pytest.skip("not a git checkout")
    if (ROOT / "src" / "gpuslice" / "_build_info.py").exists():
        pytest.skip("src/gpuslice/_build_info.py exists: a wheel takes that one")
    # the build requirements of this environment when it has them (the dev extra's
    # grpcio-tools; no index needed), else pip's isolated build environment
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("grpc_tools") else []
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps",
                            *isolation, "-w", str(tmp_path), "-q"],
                           capture_output=True, text=True, timeout=300, check=False)
    assert built.returncode == 0, built.stdout + built.stderr
    [wheel] = tmp_path.glob("gpuslice-*.whl")
    with zipfile.ZipFile(wheel) as z:
        info = z.read("gpuslice/_build_info.py").decode()
        # deploy/dra's files the DRA demo reads (deploy/ is no package): copied in as they are
        for rel in ("dra/deviceclasses.yaml", "dra/examples/claims.yaml"):
            assert z.read(f"gpuslice/demo/deploy/{rel}") == (ROOT / "deploy" / rel).read_bytes()
        assert "gpuslice/_build_info.py" in z.read(
            next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))).decode()
    [revision_built] = re.findall(r'^REVISION = "(.*)"$', info, flags=re.M)
    # the tree may turn dirty or clean while the test runs: the commit is what must match
    assert revision_built.removesuffix("-dirty") == \
        describe.stdout.strip().removesuffix("-dirty"), info
    assert head.stdout.strip() in revision_built
    # run from the wheel (a pure-Python wheel imports as a zip), outside the checkout
    out = subprocess.run([sys.executable, "-c", "import gpuslice._version as v; "
                          "print(v.__file__); print(v.version_line('gpuslice')); "
                          "from gpuslice.demo.dra import manifests; print(len(manifests()))"],
                         capture_output=True, text=True, timeout=60, check=False,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(wheel)})
    assert out.returncode == 0, out.stderr
    where, line, found = out.stdout.splitlines()
    assert where.startswith(str(wheel)), where
    assert found == "6"  # the DRA demo's three DeviceClasses and three templates, the wheel's
    assert line == f"gpuslice {gpuslice.__version__} (revision {revision_built})"


def test_components_start_without_the_plotting_and_solver_libraries() -> None:
    out = python("""
from gpuslice.cli import main
import gpuslice.services.extender, gpuslice.services.node_agent, gpuslice.services.router
import gpuslice.services.reconfig, gpuslice.services.mig_executor, gpuslice.kubectl_plugin
for c in ("extender", "node-agent", "router", "reconfig", "mig-apply"):
    try:
        main([c, "--help"])
    except SystemExit as e:
        assert e.code == 0, (c, e.code)
print(sorted({m.split(".")[0] for m in sys.modules} & {"scipy", "matplotlib"}))
""", blocked=("scipy", "matplotlib"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "[]"


@pytest.mark.parametrize(("code", "extra"), [
    ("from gpuslice.adapters.optional import pyplot; pyplot()", "plot"),
    ("from gpuslice.core.planner import _scipy_optimize; _scipy_optimize()", "planner"),
    ("from gpuslice.cli import main; sys.exit(main(['simulate', '--seeds', '42']))", "plot"),
])
def test_a_missing_optional_library_names_its_extra(code: str, extra: str) -> None:
    out = python(code, blocked=("scipy", "matplotlib"))
    assert out.returncode != 0
    assert f"pip install 'gpuslice[{extra}]'" in out.stdout + out.stderr


def test_matplotlib_config_goes_to_the_temp_dir_when_home_cannot_hold_it(
        tmp_path: Path) -> None:
    home = tmp_path / "not-a-directory"
    home.write_text("")  # ~/.config/matplotlib cannot be created under a file
    out = python("import os; from gpuslice.adapters.optional import pyplot; pyplot(); "
                 "print(os.environ['MPLCONFIGDIR'])", HOME=str(home), TMPDIR=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(tmp_path / "gpuslice-matplotlib-"))
    assert "Matplotlib" not in out.stderr  # no "created a temporary cache directory" warning


def test_the_image_lock_satisfies_pyproject() -> None:
    """deploy/image/requirements.txt (scripts/lock-image-deps.py) pins a version satisfying
    each runtime requirement of the image (the default dependencies minus the plot and planner
    extras, plus kube and gpu), and leaves the plot and planner packages out."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import importlib

        lock_mod = importlib.import_module("lock-image-deps")
    finally:
        sys.path.pop(0)
    pins = {}
    for line in (ROOT / "deploy" / "image" / "requirements.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            m = re.match(r"([a-z0-9-]+)==(\S+) --hash=sha256:[0-9a-f]{64}$", line)
            assert m, line
            pins[m.group(1)] = m.group(2)
    for text in lock_mod.image_requirements():
        req = Requirement(text)
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        assert name in pins, f"{name} is not in the image lock"
        assert req.specifier.contains(pins[name], prereleases=True), (text, pins[name])
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for extra in ("plot", "planner"):
        for text in project["optional-dependencies"][extra]:
            assert Requirement(text).name not in pins


def test_the_image_licence_label_is_the_distributions() -> None:
    """Both image builds (scripts/build-image.sh, the Containerfile) label the image with the
    distribution's SPDX licence expression (pyproject.toml: the ParvaGPU profiles it ships are
    MIT), without building it."""
    license_ = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    assert license_ == "Apache-2.0 AND MIT"
    script = (ROOT / "scripts" / "build-image.sh").read_text()
    assert re.findall(r'"org\.opencontainers\.image\.licenses=([^"]*)"', script) == [license_]
    containerfile = (ROOT / "Containerfile").read_text()
    assert re.findall(r'org\.opencontainers\.image\.licenses="([^"]*)"', containerfile) == \
        [license_]


def test_the_stubs_are_written_by_a_grpcio_tools_the_images_grpcio_can_load() -> None:
    """protoc's stubs refuse to load under a grpcio older than the grpcio-tools that wrote
    them (``GRPC_GENERATED_VERSION``): the build backend's grpcio-tools (pyproject.toml, the one
    ``pip wheel .`` and the image use) is pinned, at or below the image's pinned grpcio
    (deploy/image/requirements.txt). A grpcio-tools left free once crashed the image's node
    agent at start."""
    from packaging.version import Version

    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    (tools,) = [Requirement(r) for r in build if Requirement(r).name == "grpcio-tools"]
    pins = [s for s in tools.specifier if s.operator == "=="]
    assert pins, f"the build backend's grpcio-tools is not pinned: {tools}"
    image = re.search(r"^grpcio==([0-9.]+)", (ROOT / "deploy" / "image" /
                                              "requirements.txt").read_text(), re.M)
    assert image is not None, "deploy/image/requirements.txt pins no grpcio"
    assert Version(pins[0].version) <= Version(image.group(1)), (tools, image.group(0))
