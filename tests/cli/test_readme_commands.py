"""README's and docs/'s commands run from a fresh install (issue 30, inputs that ship).

Every ``gpuslice ...`` command in the fenced shell blocks of README.md and of the docs/ pages
(README first, then the pages in name order; docs/index.md is README's mirror and is not read
twice) that needs no cluster, GPU, network, long run or shared data folder is run, in that
order, by a real shell in one empty working folder, with ``GPUSLICE_DATA`` pointing at an
empty folder: so what they read must ship in the package (``builtin:NAME``, ``--example``,
``--variant embedded``), and an earlier command's output (``plan.json``) is there for a later
one, as for a reader who types them in turn. Which commands are left out is decided by the
explicit rules of ``SKIP`` (each with its reason); anything else is run, so a new README or
docs command is tested unless a rule says why not. ``EXPECTED`` are, per file, commands that
must be found there and run, so the test cannot pass on nothing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
SHELLS = {"bash", "sh", "shell", "console"}

# (pattern searched in the command without its comment, why it is not run here); first match
SKIP: list[tuple[str, str]] = [
    (r"\.\./shared|GPUSLICE_DATA|--compare\b|--variant(?!\s+(?:builtin:)?embedded\b)",
     "the shared data folder (traces, published results), which does not ship"),
    (r"--kubeconfig|--endpointslices|--kube-api|--fake-cluster|\bkubectl\b|\bhelm\b"
     r"|^gpuslice (?:dev-cluster|dra-allocator|dra-driver|reconfig|mig-apply)\b",
     "a Kubernetes cluster"),
    (r"^gpuslice (?:profile|bench|select)\b|--local\b|--gpu\b|nvidia|\bdocker\b|\bpodman\b",
     "a GPU or a container runtime"),
    (r"^gpuslice (?:up|status|down)\b", "local mode: replicas behind a port, until stopped"),
    (r"^gpuslice (?:extender|webhook|node-agent)\b|^gpuslice router\b(?!.*--export)",
     "a server that runs until stopped"),
    (r"^gpuslice demo\b(?!.*--dra)", "the whole demo, about 90 s (tests/demo runs it)"),
    (r"profiles\.csv|router\.json|--key-file|inventory\.yaml",
     "a file the reader writes, or measures on a GPU"),
    (r"https?://|\bcurl\b", "the network"),
]

# per file (relative to the repository), commands (their beginnings) that must be among those run
EXPECTED: dict[str, list[str]] = {
    "README.md": [
        "gpuslice simulate --variant embedded --policy fgd,ours",
        "gpuslice plan --example",
        "gpuslice router --plan plan.json --export istio",
        "gpuslice demo --dra",
    ],
    "docs/simulator.md": ["gpuslice simulate --variant embedded --policy fgd,ours --out"],
    "docs/planner.md": [
        "gpuslice plan --profiles builtin:a100-80gb --scenario 1",
        "gpuslice plan --example",
        "gpuslice plan --profiles builtin:a100-80gb --services builtin:example "
        "--fleet builtin:example",
    ],
    "docs/reconfiguration.md": [
        "gpuslice replan --example",
        "gpuslice replan --current plan.json --profiles builtin:a100-80gb",
    ],
    "docs/router.md": ["gpuslice router --plan plan.json --export istio"],
    "docs/demo.md": ["gpuslice demo --dra"],
}


def documents() -> list[Path]:
    """README.md, then the docs/ pages by name (not index.md and install.md, README's and
    deploy/README.md's mirrors: the install guide's commands need a cluster)."""
    return [README, *sorted(p for p in DOCS.glob("*.md")
                            if p.name not in ("index.md", "install.md"))]


def shell_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, body) of each fenced code block in a shell language."""
    out = []
    for m in re.finditer(r"^```([\w-]*)[^\n]*\n(.*?)^```", text, re.S | re.M):
        if m.group(1).lower() in SHELLS:
            out.append((text.count("\n", 0, m.start(2)) + 1, m.group(2)))
    return out


def _split_outside_quotes(line: str) -> tuple[str, list[str]]:
    """The line without its ``#`` comment, and its parts between ``&&``, ``||`` and ``;``."""
    parts, cur, quote, i = [], "", "", 0
    while i < len(line):
        c = line[i]
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (not cur or cur[-1].isspace()):
            break
        elif line.startswith(("&&", "||"), i) or c == ";":
            parts.append(cur)
            cur = ""
            i += 1 if c == ";" else 2
            continue
        cur += c
        i += 1
    parts.append(cur)
    stripped = " ".join(p.strip() for p in parts)
    return stripped, [" ".join(p.split()) for p in parts if p.strip()]


def readme_commands(text: str) -> list[tuple[int, str]]:
    """(line, command) of every ``gpuslice`` command in the shell blocks, continuation lines
    joined, comments dropped, ``a && b`` split."""
    out = []
    for first, body in shell_blocks(text):
        lines = body.splitlines()
        i = 0
        while i < len(lines):
            start, logical = first + i, ""
            while True:
                line = lines[i]
                i += 1
                code, _ = _split_outside_quotes(line)
                if code.rstrip().endswith("\\") and i < len(lines):
                    logical += code.rstrip()[:-1] + " "
                    continue
                logical += line
                break
            for part in _split_outside_quotes(logical)[1]:
                if part.split()[0] == "gpuslice":
                    out.append((start, part))
    return out


def skip_reason(command: str) -> str | None:
    for pattern, why in SKIP:
        if re.search(pattern, command):
            return why
    return None


def picked(text: str) -> list[tuple[int, str]]:
    return [(line, cmd) for line, cmd in readme_commands(text) if skip_reason(cmd) is None]


def picked_everywhere() -> list[tuple[str, int, str]]:
    """(file, line, command) of the commands to run, README's first, then docs/'s."""
    return [(str(path.relative_to(ROOT)), line, cmd)
            for path in documents() for line, cmd in picked(path.read_text())]


def test_the_parser_reads_blocks_comments_continuations_and_chains() -> None:
    text = ("```bash\n"
            "pip install . && gpuslice demo   # about 90 s\n"
            "gpuslice plan --a x \\\n    --b 'y # not a comment' > out.json  # a comment\n"
            "                                  # a comment's second line\n"
            "kubectl get pods\n"
            "```\n\n```json\n{\"gpuslice\": 1}\n```\n"
            "```\ngpuslice not-shell\n```\n")
    assert readme_commands(text) == [
        (2, "gpuslice demo"),
        (3, "gpuslice plan --a x --b 'y # not a comment' > out.json")]


def test_the_rules_leave_out_what_needs_more_than_an_install() -> None:
    cases = {
        "gpuslice simulate --variant default --seeds 42-51 --compare": "shared data",
        "gpuslice simulate --variant embedded --compare": "shared data",
        "gpuslice simulate --trace ../shared/t.csv --nodes ../shared/n.csv": "shared data",
        "gpuslice extender --key-file key --fake-cluster examples/fake-cluster.yaml":
            "cluster",
        "gpuslice router --config router.json": "server",
        "gpuslice demo": "demo",
        "gpuslice profile resnet50 --out profiles.csv": "GPU",
        "gpuslice up examples/local/tiny.yaml --fake-gpus 1 --detach": "local mode",
        "gpuslice dev-cluster up": "cluster",
    }
    for command, why in cases.items():
        reason = skip_reason(command)
        assert reason is not None and why in reason, (command, reason)
    for command in ("gpuslice simulate --variant embedded --policy fgd,ours",
                    "gpuslice plan --example", "gpuslice demo --dra", "gpuslice --version",
                    "gpuslice router --plan plan.json --export istio --namespace ml"):
        assert skip_reason(command) is None, command


def test_the_readme_and_docs_have_the_expected_commands() -> None:
    found = picked_everywhere()
    missing = [f"{name}: {e}" for name, expected in EXPECTED.items() for e in expected
               if not any(f == name and c.startswith(e) for f, _, c in found)]
    assert not missing, f"commands not found (or left out by a rule): {missing}"


def test_docs_index_is_the_readme_with_its_links_for_docs() -> None:
    """docs/index.md (the site's front page) is what scripts/sync-docs-index.py writes from
    README.md, and none of README's links leads out of docs/ there (mkdocs --strict refuses)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sync_docs_index",
                                                  ROOT / "scripts" / "sync-docs-index.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    want = module.index_from_readme(README.read_text())
    assert (DOCS / "index.md").read_text() == want, \
        "docs/index.md is stale: run python scripts/sync-docs-index.py"
    links = re.findall(r"\]\(([^)#]+)", want)
    assert all((DOCS / link).is_file() for link in links if "://" not in link), links


def test_the_install_guide_is_on_the_site() -> None:
    """Issue 54: deploy/README.md is the site's install.md (what scripts/sync-docs-index.py
    writes, its links to the docs pages made relative to docs/), in mkdocs.yml's nav, and the
    front page links to it."""
    import importlib.util

    import yaml

    spec = importlib.util.spec_from_file_location("sync_docs_index",
                                                  ROOT / "scripts" / "sync-docs-index.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    want = module.install_from_deploy_readme((ROOT / "deploy" / "README.md").read_text())
    assert (DOCS / "install.md").read_text() == want, \
        "docs/install.md is stale: run python scripts/sync-docs-index.py"
    links = re.findall(r"\]\(([^)#]+)", want)
    assert all((DOCS / link).is_file() for link in links if "://" not in link), links
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    assert any(isinstance(item, dict) and "install.md" in item.values() for item in nav), nav
    assert "[deploy/README.md](install.md)" in (DOCS / "index.md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_readme_commands_run_without_shared_data(tmp_path: Path) -> None:
    commands = picked_everywhere()
    assert len(commands) >= sum(map(len, EXPECTED.values()))
    work, empty = tmp_path / "work", tmp_path / "no-data"
    work.mkdir()
    empty.mkdir()
    env = dict(os.environ, GPUSLICE_DATA=str(empty), GPUSLICE_PY=sys.executable,
               COLUMNS="200", MPLBACKEND="Agg")
    if env.get("PYTHONPATH"):  # a checkout run with PYTHONPATH=src: make it absolute
        env["PYTHONPATH"] = os.pathsep.join(str(Path(p).resolve())
                                            for p in env["PYTHONPATH"].split(os.pathsep))
    # the gpuslice of this interpreter, whatever is on PATH
    prelude = 'gpuslice() { "$GPUSLICE_PY" -m gpuslice.cli "$@"; }\nset -e\n'
    failures = []
    for name, line, command in commands:
        proc = subprocess.run(["bash", "-c", prelude + command], cwd=work, env=env,
                              capture_output=True, text=True, timeout=300, check=False)
        if proc.returncode != 0:
            failures.append(f"{name}:{line}: {command}\n  exit {proc.returncode}: "
                            f"{(proc.stderr or proc.stdout).strip()[-800:]}")
    assert not failures, "\n".join(failures)
    assert (work / "plan.json").is_file() and (work / "out" / "manifests.yaml").is_file()


def test_shipped_inputs_are_package_data() -> None:
    """Every file of the shipped inputs is matched by pyproject's package-data (so the wheel
    has it; `pip wheel . && unzip -l` shows them), and the licence of the ParvaGPU profiles
    is a licence file of the distribution."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package = ROOT / "src" / "gpuslice"
    patterns = project["tool"]["setuptools"]["package-data"]["gpuslice"]
    covered = {p for pat in patterns for p in package.glob(pat) if p.is_file()}
    data = package / "adapters" / "profiles" / "data"
    files = {p for p in data.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert files and files <= covered, sorted(str(p) for p in files - covered)
    assert "src/gpuslice/adapters/profiles/data/LICENSE-ParvaGPU" in project["project"][
        "license-files"]
