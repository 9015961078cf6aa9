"""The command line's surface (issue 30): one spelling per idea (the old ones kept, hidden, with a
deprecation note), help on every option and examples in every command's help, an unknown
option refused by the command it was given to, a command group without its command, one "no
GPU" error, and the output fixes (simulate's table, the demo's bind line, reconfig plan's
current layouts)."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice import kubectl_plugin
from gpuslice.cli import _build_parser, main
from gpuslice.cli.common import DeprecatedAlias

ROOT = Path(__file__).resolve().parents[2]
FAKE_CLUSTER = str(ROOT / "examples" / "fake-cluster.yaml")
DAY_NIGHT = str(ROOT / "deploy" / "examples" / "day-night.yaml")
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


ALL = list(parsers(_build_parser()))
IDS = [" ".join(p) or "gpuslice" for p, _ in ALL]


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    """``gpuslice ARGV`` that argparse refuses: its stderr lines (exit code 2 checked)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


# ---- help: every option, examples in every command ------------------------------------------


@pytest.mark.parametrize(("path", "parser"), ALL, ids=IDS)
def test_every_option_has_help_and_every_command_examples(
        path: tuple[str, ...], parser: argparse.ArgumentParser) -> None:
    silent = [a.option_strings or [a.dest] for a in parser._actions
              if not isinstance(a, (argparse._HelpAction, DeprecatedAlias,
                                    argparse._SubParsersAction))
              and not (a.help or "").strip()]
    assert silent == [], f"options without help: {silent}"
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            assert all((c.help or "").strip() for c in a._choices_actions)
    text = parser.format_help()
    tail = text[text.index("examples:"):] if "examples:" in text else ""
    lines = [x.strip() for x in tail.splitlines()[1:]]
    assert 1 <= len(lines) <= 2, f"the help ends with one or two examples:\n{text}"
    assert lines[0].startswith(f"gpuslice {' '.join(path)}".rstrip())
    assert text.rstrip().endswith(lines[-1])


def example_lines() -> list[str]:
    out = []
    for _, parser in ALL:
        for line in (parser.epilog or "").splitlines():
            if line.strip().startswith("gpuslice "):
                out.append(line.strip())
    return out


@pytest.mark.parametrize("line", example_lines())
def test_the_examples_parse(line: str, capsys: pytest.CaptureFixture[str]) -> None:
    """What the examples show is a command line gpuslice takes, in its current spelling."""
    args = _build_parser().parse_args(shlex.split(line)[1:])
    assert callable(args.handler)
    assert capsys.readouterr().err == ""  # no deprecation note


# ---- unknown options, missing commands ------------------------------------------------------


@pytest.mark.parametrize(("argv", "prog"), [
    (["plan", "--no-such-flag"], "gpuslice plan"),
    (["bench", "sharing", "--no-such-flag"], "gpuslice bench sharing"),
    (["reconfig", "plan", "--no-such-flag"], "gpuslice reconfig plan"),
    (["status", "extra"], "gpuslice status"),
])
def test_an_unknown_option_gets_its_commands_usage(
        argv: list[str], prog: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(argv, capsys)
    assert err[0].startswith(f"usage: {prog} ")
    assert err[-1].startswith(f"{prog}: error: unrecognized arguments: {argv[-1]}")
    assert "simulate" not in "\n".join(err)  # not the top level's list of commands


def test_an_unknown_option_suggests_a_close_one(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(["plan", "--exmaple"], capsys)
    assert err[-1] == ("gpuslice plan: error: unrecognized arguments: --exmaple (--exmaple: did "
                       "you mean --example?)")


@pytest.mark.parametrize(("argv", "names"), [
    (["bench"], ["sharing (time-slicing vs MPS"]),
    (["reconfig"], ["run (the controller", "plan (what a schedule would change"]),
    ([], ["simulate", "plan", "bench", "dev-cluster"]),
], ids=["bench", "reconfig", "gpuslice"])
def test_a_group_without_its_command_lists_them(
        argv: list[str], names: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(argv, capsys)
    prog = " ".join(["gpuslice", *argv])
    assert err[-1].startswith(f"{prog}: error: which command? '{prog}' needs one of: ")
    assert all(n in err[-1] for n in names)
    assert f"'{prog} COMMAND --help'" in err[-1] and "required" not in err[-1]


# ---- one spelling per idea, the old ones kept -------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    return _build_parser().parse_args(argv)


@pytest.mark.parametrize(("old", "new", "attr", "value"), [
    (["status", "--json"], ["status", "-o", "json"], "output", "json"),
    (["reconfig", "plan", "--json"], ["reconfig", "plan", "-o", "json"], "output", "json"),
    (["plan", "--json", "p.json"], ["plan", "--write-json", "p.json"], "write_json",
     Path("p.json")),
    (["replan", "--json", "p.json"], ["replan", "--write-json", "p.json"], "write_json",
     Path("p.json")),
    (["node-agent", "--key-file", "k", "--fake", "inv.yaml"],
     ["node-agent", "--key-file", "k", "--fake-gpus", "inv.yaml"], "fake_gpus", "inv.yaml"),
    (["dra-driver", "--fake", "inv.yaml"], ["dra-driver", "--fake-gpus", "inv.yaml"],
     "fake_gpus", "inv.yaml"),
    (["mig-apply", "f.yaml", "--config", "c", "--fake", "inv.yaml"],
     ["mig-apply", "f.yaml", "--config", "c", "--fake-gpus", "inv.yaml"], "fake_gpus",
     "inv.yaml"),
    (["dra-driver", "--allocator-lease", "none"], ["dra-driver", "--lease", "none"], "lease",
     "none"),
    (["dra-allocator", "--lease-namespace", "ns", "--lease-name", "l"],
     ["dra-allocator", "--lease", "ns/l"], "lease", "ns/l"),
    (["dra-allocator", "--lease-name", "l"],
     ["dra-allocator", "--lease", "gpuslice-system/l"], "lease", "gpuslice-system/l"),
    # issue 54: an output folder is --out, a listening address --listen/--admin HOST:PORT
    (["plan", "--export", "d"], ["plan", "--out", "d"], "out", Path("d")),
    (["replan", "--export", "d"], ["replan", "--out", "d"], "out", Path("d")),
    (["up", "s.yaml", "--port", "9000", "--admin-port", "9001"],
     ["up", "s.yaml", "--listen", "127.0.0.1:9000", "--admin", "127.0.0.1:9001"], "listen",
     "127.0.0.1:9000"),
], ids=["status --json", "reconfig plan --json", "plan --json", "replan --json",
        "node-agent --fake", "dra-driver --fake", "mig-apply --fake",
        "dra-driver --allocator-lease", "dra-allocator --lease-namespace/--lease-name",
        "dra-allocator --lease-name", "plan --export", "replan --export",
        "up --port/--admin-port"])
def test_old_spellings_work_with_a_deprecation_note(
        old: list[str], new: list[str], attr: str, value: object,
        capsys: pytest.CaptureFixture[str]) -> None:
    now = parse(new)
    assert capsys.readouterr().err == ""
    before = parse(old)
    notes = capsys.readouterr().err.strip().splitlines()
    assert getattr(before, attr) == getattr(now, attr) == value
    assert vars(before) == vars(now)
    olds = [a for a in old if a.startswith("--") and a not in new]
    assert len(notes) == len(olds)
    for note, flag in zip(notes, olds, strict=True):
        assert re.fullmatch(rf"gpuslice [a-z -]+: note: {flag} is deprecated and will be "
                            r"removed; use \S+( \S+)?", note), note


@pytest.mark.parametrize("path", [("status",), ("reconfig", "plan"), ("plan",), ("replan",),
                                  ("node-agent",), ("dra-driver",), ("dra-allocator",),
                                  ("mig-apply",)], ids=" ".join)
def test_old_spellings_are_not_in_the_help(path: tuple[str, ...]) -> None:
    text = dict(ALL)[path].format_help()
    for old in ("--json ", "--json\n", "--fake ", "--fake\n", "--allocator-lease",
                "--lease-name", "--lease-namespace"):
        assert old not in text, (path, old)


@pytest.mark.parametrize(("path", "olds"), [
    (("plan",), ("--export",)), (("replan",), ("--export",)),
    (("up",), ("--port", "--admin-port")), (("router",), ("--kube-api",))],
    ids=["plan", "replan", "up", "router"])
def test_issue_54_old_spellings_are_hidden(path: tuple[str, ...], olds: tuple[str, ...],
                                           ) -> None:
    usage = dict(ALL)[path].format_help()
    for old in olds:
        assert re.search(rf"{old}\b(?!-)", usage) is None, (path, old)


def test_plan_write_json_and_the_old_json(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "p.csv").write_text(PROFILE)
    (tmp_path / "s.yaml").write_text("- {name: a, model: m, rate: 300, slo_ms: 100}\n")
    base = ["plan", "--profiles", str(tmp_path / "p.csv"), "--services", str(tmp_path / "s.yaml")]
    assert main([*base, "--write-json", str(tmp_path / "new.json")]) == 0
    assert "deprecated" not in capsys.readouterr().err
    assert main([*base, "--json", str(tmp_path / "old.json")]) == 0
    assert "note: --json is deprecated and will be removed; use --write-json" in \
        capsys.readouterr().err
    new, old = (json.loads((tmp_path / f).read_text()) for f in ("new.json", "old.json"))
    assert new["gpus"] == old["gpus"] == 1


def test_status_json_flag_still_means_o_json(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--state-dir", str(tmp_path), "--json"]) == 3
    out = capsys.readouterr()
    assert json.loads(out.out) == {"status": "not running", "state_dir": str(tmp_path)}
    assert "note: --json is deprecated and will be removed; use -o/--output json" in out.err


# ---- no GPU: one exit code, one message ---------------------------------------------------------


def test_no_gpu_is_one_error_naming_fake_gpus(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """select exited 2 and gpus --local 1 for the same missing GPU; now every command that
    needs one exits 1 with the same line, which says how to try it without one."""
    none = tmp_path / "none.yaml"
    none.write_text("gpus: []\n")
    state = tmp_path / "state"
    errors = {}
    for argv in (["select", "--memory", "1G", "--state-dir", str(state)], ["gpus", "--local"],
                 ["up", str(ROOT / "examples/local/tiny.yaml"), "--state-dir", str(state)]):
        assert main([*argv, "--fake-gpus", str(none)]) == 1, argv
        out = capsys.readouterr()
        assert out.out == ""
        errors[argv[0]] = out.err
    assert len(set(errors.values())) == 1, errors
    (line,) = errors["select"].splitlines()
    assert line == ("gpuslice: error: no GPU: the fake inventory lists no GPU; to try it "
                    "without one, --fake-gpus N simulates N GPUs (--fake-gpus FILE reads a "
                    "YAML inventory)")
    assert not state.exists()  # up stopped before starting anything
    # -o json: the document on stdout, the same error on stderr
    assert main(["gpus", "--local", "--fake-gpus", str(none), "-o", "json"]) == 1
    out = capsys.readouterr()
    assert json.loads(out.out)["gpus"] == [] and out.err == errors["select"]


def test_no_nvml_is_the_same_error(monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import gpuslice.adapters.nvml.real
    from gpuslice.adapters.nvml.port import NullNvml

    monkeypatch.setattr(gpuslice.adapters.nvml.real, "load",
                        lambda: NullNvml("nvmlInit failed: NVML Shared Library Not Found"))
    codes = [main(["select", "--state-dir", str(tmp_path)]), main(["gpus", "--local"])]
    err = capsys.readouterr().err.splitlines()
    assert codes == [1, 1] and err[0] == err[1]
    assert err[0].startswith("gpuslice: error: no GPU: nvmlInit failed") and \
        "--fake-gpus N simulates N GPUs" in err[0]


# ---- reconfig plan: the file after the options; current layouts as status shows them ---------


def test_reconfig_plan_takes_the_file_after_the_options(
        capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["reconfig", "plan", "--at", "23:00", "--fake-cluster", FAKE_CLUSTER, DAY_NIGHT],
                 ["reconfig", "plan", DAY_NIGHT, "--at", "23:00", "--fake-cluster", FAKE_CLUSTER],
                 ["reconfig", "plan", "--at", "23:00", DAY_NIGHT, "--fake-cluster", FAKE_CLUSTER]):
        assert main([*argv, "-o", "json"]) == 0, argv
        assert json.loads(capsys.readouterr().out)[0]["target"] == "batch"


def test_reconfig_plan_names_the_layout_kubectl_status_shows(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The fake cluster's node agent reported no layout: the plan takes each GPU's from the
    inventory, the source kubectl gpuslice status reads, not "(not reported yet)"."""
    assert kubectl_plugin.main(["status", "--fake-cluster", FAKE_CLUSTER, "-o", "json"]) == 0
    shown = {g["uuid"]: g["mig"] for g in json.loads(capsys.readouterr().out)["gpus"]}
    assert main(["reconfig", "plan", DAY_NIGHT, "--fake-cluster", FAKE_CLUSTER, "--at", "23:00",
                 "-o", "json"]) == 0
    changes = {c["gpu"]: c for c in json.loads(capsys.readouterr().out)[0]["changes"]}
    assert changes["GPU-a-1"]["from"] == ",".join(shown["GPU-a-1"]) == "3g.40gb@0,3g.40gb@4"
    assert changes["GPU-a-1"]["blocked"] is None
    assert shown["GPU-a-0"] is None  # MIG disabled: status shows no MIG
    assert changes["GPU-a-0"]["from"] == "MIG disabled"
    assert "MIG mode is disabled" in changes["GPU-a-0"]["blocked"]
    assert main(["reconfig", "plan", DAY_NIGHT, "--fake-cluster", FAKE_CLUSTER,
                 "--at", "23:00"]) == 0
    table = capsys.readouterr().out
    assert "not reported" not in table and "3g.40gb@0,3g.40gb@4" in table


def test_reconfig_plan_a_gpu_already_in_the_layout_is_no_change(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = yaml.safe_load(Path(DAY_NIGHT).read_text())
    doc["spec"]["layouts"]["batch"] = {"mig": {"mig-devices": {"3g.40gb": 2}}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    assert main(["reconfig", "plan", str(tmp_path / "s.yaml"), "--fake-cluster", FAKE_CLUSTER,
                 "--at", "23:00", "-o", "json"]) == 0
    (res,) = json.loads(capsys.readouterr().out)
    assert [c["gpu"] for c in res["changes"]] == ["GPU-a-0"] and res["gpus"] == 2


# ---- simulate's table, the demo's bind line ------------------------------------------------------


def test_simulate_table_names_each_policy(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--policy", "bestfit,gpu-packing", "--seeds", "42", "--no-plot",
                 "--workers", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ours" not in out  # the column said "ours mean ± sd" on every policy's row
    header = next(x for x in out.splitlines() if "policy" in x)
    assert "measured mean ± sd" in header
    rows = [x for x in out.splitlines() if "±" in x and "policy" not in x]
    assert [r.split()[1] for r in rows] == ["bestfit", "gpu-packing"]


class _Api:
    def __init__(self) -> None:
        self.pod = {"metadata": {"name": "p", "namespace": "ml", "uid": "u"},
                    "spec": {"containers": []}}

    def list_nodes(self) -> list[dict[str, Any]]:
        return [{"metadata": {"name": n}} for n in ("n0", "n1", "n2")]

    def list_pods(self) -> list[dict[str, Any]]:
        return [self.pod]


@pytest.mark.parametrize(("fits", "line", "score"), [
    (["n1"], "ml/p -> n1 (the one node of 3 the filter kept)", None),
    (["n1", "n2"], "ml/p -> n2 (score 7/10, the best of the 2 nodes of 3 the filter kept)", 7),
], ids=["one", "two"])
def test_demo_bind_line_counts_what_it_says(fits: list[str], line: str,
                                            score: int | None) -> None:
    """It said "score 3 of 1 feasible node(s)": a score of a lone node kube-scheduler never
    scores, read as "3 of 1"."""
    from gpuslice.demo.cluster import SchedulerSim
    from gpuslice.demo.runtime import EventLog

    log = EventLog()
    sim = SchedulerSim(_Api(), "http://unused", log)  # type: ignore[arg-type]
    calls: list[str] = []

    def post(path: str, doc: dict[str, Any]) -> Any:
        calls.append(path)
        if path == "/filter":
            return {"NodeNames": fits}
        if path == "/prioritize":
            return [{"Host": "n1", "Score": 3}, {"Host": "n2", "Score": 7}]
        return {}

    sim._post = post  # type: ignore[method-assign]
    sim.schedule_once()
    assert calls == (["/filter", "/bind"] if len(fits) == 1
                     else ["/filter", "/prioritize", "/bind"])
    assert [e.text for e in log.events if e.kind == "bind"] == [line]
    assert sim.placed["ml/p"] == (line.split()[2], score)
