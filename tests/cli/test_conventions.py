"""What every command owes a new user (issue 18, first contact), walked over the real CLI:
one exit-code table, ``-o json`` on every listing and status command, ``--log-format`` on every
long-running component, whole lines in a pipe, and help texts without raw docstrings, ``%%``,
hidden flags or promises the command does not keep."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice import kubectl_plugin
from gpuslice.cli import _build_parser, main
from gpuslice.cli.common import DeprecatedAlias

ROOT = Path(__file__).resolve().parents[2]
FAKE_CLUSTER = str(ROOT / "examples" / "fake-cluster.yaml")
PROFILE = ("model,gpu,slice_kind,slice_size,batch,procs,throughput_rps,latency_ms\n"
           "m,A100-80GB,mig,1,4,1,200,20\nm,A100-80GB,mig,2,4,1,420,10\n"
           "m,A100-80GB,mig,7,4,1,1400,3\n")


def parsers(p: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[
        tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sp in a.choices.items():
                yield from parsers(sp, (*path, name))


def kubectl_parser() -> argparse.ArgumentParser:
    """kubectl gpuslice's parser, caught as it parses --help."""
    seen: list[argparse.ArgumentParser] = []
    real = argparse.ArgumentParser.parse_args

    def spy(self: argparse.ArgumentParser, *a: object, **k: object) -> object:
        seen.append(self)
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = spy  # type: ignore[method-assign,assignment]
    try:
        kubectl_plugin.main(["status"])
    except SystemExit:
        pass
    finally:
        argparse.ArgumentParser.parse_args = real  # type: ignore[method-assign]
    return seen[0]


ALL = [*parsers(_build_parser()), *((("kubectl", *p), sp)
                                    for p, sp in parsers(kubectl_parser()))]


@pytest.mark.parametrize(("path", "parser"), ALL, ids=[" ".join(p) or "gpuslice" for p, _ in ALL])
def test_help_texts(path: tuple[str, ...], parser: argparse.ArgumentParser) -> None:
    text = parser.format_help()
    assert "%%" not in text and "%(" not in text  # argparse formatting left in
    assert "``" not in text and ":func:" not in text  # a raw docstring
    # the only flags left out of the help are former spellings, kept with a deprecation note
    hidden = [a.option_strings for a in parser._actions if a.help == argparse.SUPPRESS
              and not isinstance(a, DeprecatedAlias)]
    assert hidden == [], f"undocumented flags: {hidden}"
    assert parser.description, "every command says what it does"
    if path == ("replan",):
        assert "Nothing is applied" not in text and "With --apply the change is made" in text


LONG_RUNNING = [("extender",), ("webhook",), ("node-agent",), ("router",), ("reconfig", "run"),
                ("up",), ("dra-driver",), ("dra-allocator",)]


@pytest.mark.parametrize("path", LONG_RUNNING, ids=[" ".join(p) for p in LONG_RUNNING])
def test_long_running_components_take_log_format(path: tuple[str, ...]) -> None:
    parser = dict(parsers(_build_parser()))[path]
    (opt,) = [a for a in parser._actions if "--log-format" in a.option_strings]
    assert tuple(opt.choices or ()) == ("text", "json") and opt.default == "text"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "p.csv").write_text(PROFILE)
    (tmp_path / "s.yaml").write_text("- {name: a, model: m, rate: 300, slo_ms: 100}\n")
    (tmp_path / "none.yaml").write_text("gpus: []\n")
    (tmp_path / "mp.yaml").write_text("version: v1\nmig-configs:\n  all-1g:\n"
                                      "    - devices: all\n      mig-enabled: true\n"
                                      "      mig-devices: {1g.10gb: 7}\n")
    return {k: str(tmp_path / v) for k, v in (("prof", "p.csv"), ("svc", "s.yaml"),
                                              ("none", "none.yaml"), ("mp", "mp.yaml"),
                                              ("plan", "plan.json"), ("dir", "state"))}


def test_every_listing_and_status_command_speaks_json(
        files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    def as_json(argv: list[str], code: int = 0) -> object:
        assert main([*argv, "-o", "json"]) == code, argv
        return json.loads(capsys.readouterr().out)

    assert any(g["model"] == "A100-80GB" for g in as_json(["gpus"]))  # type: ignore[union-attr]
    assert len(as_json(["gpus", "--local", "--fake-gpus", "2"])["gpus"]) == 2  # type: ignore[index]
    assert as_json(["mig", "A30"])["maximal_layouts"]  # type: ignore[index]
    assert as_json(["mig", "A30", "--used", "2g.12gb@0"])["fits"]  # type: ignore[index]
    assert as_json(["mig", "A30", "--layout", "4g.24gb@0,2g.12gb@0"], 1)["valid"] is False  # type: ignore[index]
    doc = as_json(["plan", "--profiles", files["prof"], "--services", files["svc"],
                   "--write-json", files["plan"]])
    assert doc["gpus"] == 1  # type: ignore[index]
    assert "changes" in as_json(["replan", "--current", files["plan"], "--profiles",  # type: ignore[operator]
                                 files["prof"], "--services", files["svc"]])
    assert as_json(["status", "--state-dir", files["dir"]], 3) == {
        "status": "not running", "state_dir": files["dir"]}
    assert as_json(["reconfig", "plan", str(ROOT / "deploy/examples/day-night.yaml"),
                    "--fake-cluster", FAKE_CLUSTER])[0]["gpus"] == 2  # type: ignore[index]
    sim = as_json(["simulate", "--policy", "bestfit", "--seeds", "42", "--no-plot", "--out",
                   files["dir"]])
    assert sim["policies"][0]["policy"] == "bestfit"  # type: ignore[index]
    assert kubectl_plugin.main(["status", "--fake-cluster", FAKE_CLUSTER, "-o", "json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["gpus"]) == 3


def test_a_pipe_gets_whole_lines() -> None:
    r = subprocess.run([sys.executable, "-m", "gpuslice.cli", "gpus"], capture_output=True,
                       text=True, timeout=60, check=True, env={"PATH": "/usr/bin:/bin"})
    rows = [line for line in r.stdout.splitlines() if "A100-80GB" in line]
    # the catalogue's widest row, MIG profiles and all, on one line, nothing cut to "…"
    assert rows and max(len(x) for x in rows) > 120 and "…" not in r.stdout
    assert "1g.10gb, 1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb" in r.stdout


@pytest.mark.parametrize(("argv", "code"), [
    (["gpus"], 0),
    (["mig", "A30", "--layout", "4g.24gb@0"], 0),
    (["mig", "A30", "--layout", "4g.24gb@0,2g.12gb@0"], 1),  # a check failed
    (["mig", "NoSuchGPU"], 2),  # bad input
    (["plan", "--profiles", "{prof}"], 2),  # a scenario or --services is missing
    (["plan", "--profiles", "{prof}", "--services", "{svc}"], 0),
    (["status", "--state-dir", "{dir}"], 3),  # not running
    (["mig-apply", "{mp}", "--config", "all-1g", "--fake-gpus", "{none}"], 1),  # no GPU
    (["mig-apply", "{mp}", "--config", "nope", "--fake-gpus", "{none}"], 2),
    (["profile", "no such model"], 2),  # checked before looking for a GPU
    (["profile", "tiny", "--device", "-1"], 2),
    (["bench", "sharing", "--fake-timer", "resnet50@H100-SXM", "--workload", "tiny",
      "--warmup-s", "0", "--window-s", "0.2", "--replicas", "1", "--parts", "throughput",
      "--out", "{dir}"], 1),  # 1 replica: no gain over time-slicing, a check fails
])
def test_exit_codes(files: dict[str, str], argv: list[str], code: int) -> None:
    assert main([a.format(**files) for a in argv]) == code


def test_usage_errors_exit_2_and_ctrl_c_130(files: dict[str, str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--no-such-flag"])
    assert exc.value.code == 2
    p = subprocess.Popen([sys.executable, "-m", "gpuslice.cli", "simulate", "--seeds", "42-60",
                          "--workers", "1", "--no-plot", "--out", files["dir"]],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    p.stdout.readline()  # the scenario's line: it is replaying
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "interrupted" in err
