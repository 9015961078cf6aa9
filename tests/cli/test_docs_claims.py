"""What README.md and the install guide say, against what is true (issue 54): public sources
only (nothing outside the repository), one DRA figure from one run of docs/scale.md, an
install that works without a published package, and the dev overlay's Secrets said."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
GUIDE = (ROOT / "deploy" / "README.md").read_text()


def test_readme_cites_nothing_outside_the_repository() -> None:
    assert "../shared" not in README and "landscape.md" not in README
    # the comparison's sources are public links
    for repo in ("NVIDIA/k8s-device-plugin", "Project-HAMi/HAMi", "NVIDIA/KAI-Scheduler",
                 "koordinator-sh/koordinator", "volcano-sh/volcano",
                 "NVIDIA/k8s-dra-driver-gpu", "alibaba/clusterdata", "MunQ-Lee/ParvaGPU_SC24"):
        assert f"https://github.com/{repo}" in README, repo


def _latest_dra_run() -> tuple[str, str, str]:
    """(pods/s ratio, claim p50 ms, claim p99 ms) of docs/scale.md's first (latest) section
    "The DRA path at 1000 nodes", the one README links to."""
    scale = (ROOT / "docs" / "scale.md").read_text()
    section = scale[scale.index("### The DRA path at 1000 nodes"):]
    section = section[:section.index("\n### ", 10)]
    ratio = re.search(r"^Ratio ([\d.]+);", section, re.M)
    claim = re.search(r"with gpuslice dra-allocator (\d+) / (\d+)(?: \(goal|;)", section)
    assert ratio and claim, section[:500]
    return ratio.group(1), claim.group(1), claim.group(2)


def test_readme_gives_one_dra_figure_from_one_run() -> None:
    ratio, _, p99 = _latest_dra_run()
    said = re.findall(r"allocates a claim (\S+) ms \(p99\)", " ".join(README.split()))
    assert said == [p99, p99], said  # the table and the paragraph below it
    assert README.count(f"binds {ratio}x the pods/s") >= 2
    assert not re.search(r"\d{3}-\d{3} ms \(p99\)|\d{3}-\d{3} ms at p99", README)


def test_install_says_how_to_install_without_a_published_package() -> None:
    for text in (" ".join(README.split()), " ".join(GUIDE.split())):
        # the one mention of the index's name says it is for later
        later = "`pip install 'gpuslice[kube]'` will work once it is published"
        assert "pip install 'gpuslice[" not in text.replace(later, "")
        assert "pip install '.[kube]'" in text
    assert "python -m build" in README and "python -m build" in GUIDE


def test_the_dev_overlay_says_it_needs_the_tls_secrets() -> None:
    text = " ".join(GUIDE.split())
    at = text.index("kubectl apply -k deploy/overlays/dev")
    assert "TLS Secrets it does not make: create both first" in text[at:at + 300]
    overlay = (ROOT / "deploy" / "overlays" / "dev" / "kustomization.yaml").read_text()
    assert "gpuslice-extender-tls" in overlay and "gpuslice-scheduler-tls" in overlay
