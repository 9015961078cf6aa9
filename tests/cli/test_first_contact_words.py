"""First contact, round three (issue 54): one reader and one message for a YAML file, one exit
code for "not running", missing arguments said in words, the token of an unknown option and a
close command named, one row per policy, and a MIG config that cannot be applied said so with
what it would take."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuslice.cli import main
from tests.cli.test_bad_input import run

BAD_YAML = "a: [1\nb: 2\n"


def test_up_and_plan_say_a_yaml_error_alike(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_YAML)
    code_up, up = run(["up", str(bad), "--fake-gpus", "1", "--state-dir",
                       str(tmp_path / "st")], capsys)
    code_plan, plan = run(["plan", "--profiles", "builtin:a100-80gb", "--services", str(bad)],
                          capsys)
    assert code_up == code_plan == 2
    assert up == plan, (up, plan)
    assert "\\n" not in up and "<unicode string>" not in up and len(up) < 200, up
    assert "at line 2 column 2" in up


def test_switch_with_nothing_running_exits_3_as_status_does(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = ["--state-dir", str(tmp_path / "none")]
    assert main(["status", *state]) == 3
    capsys.readouterr()
    assert main(["switch", "x", *state]) == 3
    err = capsys.readouterr().err.strip()
    assert err == f"gpuslice: error: local mode is not running (state: {tmp_path / 'none'}); " \
        "gpuslice up starts it"


@pytest.mark.parametrize(("argv", "says"), [
    (["plan"], "--profiles is missing: expected a profile folder or CSV"),
    (["simulate", "--trace", "{x}"], "--nodes is missing: expected a node list CSV to go "
                                     "with --trace"),
    (["replan", "--current", "{bad}"], "--profiles is missing: expected"),
    (["node-agent", "--key-file", "{key}", "--fake-gpus", "1"],
     "--node is missing: expected the node's name (or $NODE_NAME)"),
])
def test_a_missing_argument_is_said_in_words(argv: list[str], says: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    files = {"x": tmp_path / "x.csv", "bad": tmp_path / "bad.json",
             "key": tmp_path / "key"}
    files["x"].write_text("name,cpu_milli\n")
    files["bad"].write_text("{}")
    files["key"].write_text("test-key-0123456789abcdef")
    code, err = run([a.format(**files) for a in argv], capsys)
    assert code == 2
    assert says in err and "None" not in err, err


def test_simulate_names_a_missing_trace_before_a_missing_node_list(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["simulate", "--trace", str(tmp_path / "nofile.csv"), "--no-plot"], capsys)
    assert code == 2
    assert err.startswith("gpuslice: error: --trace: expected a pod list CSV file") and \
        "nofile.csv: no such file" in err, err


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """argparse's exit: the code and the error line (after the usage)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "".join(lines) and ": error: " in lines[-1], lines
    return int(exc.value.code or 0), lines[-1]


def test_an_unknown_option_without_a_command_is_named(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _usage_error(["--nonsense"], capsys)
    assert code == 2
    assert "unrecognized arguments: --nonsense" in err and "which command?" in err, err


@pytest.mark.parametrize(("argv", "close"), [(["simulat"], "simulate"),
                                             (["bench", "sharin"], "sharing"),
                                             (["plan", "--objective", "cst"], "cost")])
def test_a_close_command_or_choice_is_suggested(argv: list[str], close: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _usage_error(argv, capsys)
    assert code == 2 and err.endswith(f"(did you mean {close}?)"), err


def test_ours_and_frag_strand_are_one_row(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--variant", "embedded", "--policy", "frag-strand,ours,fgd",
                 "--seeds", "42", "--no-plot", "--out", str(tmp_path / "s"), "-o",
                 "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [p["policy"] for p in doc["policies"]] == ["frag-strand", "fgd"]


MIG_CONFIG = ("version: v1\nmig-configs:\n  c:\n  - devices: [0]\n    mig-enabled: true\n"
              "    mig-devices: {1g.10gb: 7}\n")


@pytest.mark.parametrize("dry_run", [True, False])
def test_mig_apply_on_a_gpu_without_mig_says_what_it_would_take(
        dry_run: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mp = tmp_path / "mp.yaml"
    mp.write_text(MIG_CONFIG)
    code = main(["mig-apply", str(mp), "--config", "c", "--fake-gpus", "1",
                 *(["--dry-run"] if dry_run else [])])
    out = capsys.readouterr().out
    assert code == 1, out  # the config cannot be applied to this GPU as it stands
    assert "nothing to change" not in out
    assert "MIG mode is disabled on this GPU and the config asks for MIG: enable it first " \
           "(sudo nvidia-smi -i 0 -mig 1" in out
    assert out.count("create 1g.10gb@") == 7
