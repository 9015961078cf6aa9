"""``gpuslice profile`` on a CPU: the whole pipeline (workers started together, warm-up and
windows, CSV rows, resume, plot) with the fake timer, the cmd: protocol, and clear errors."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

from gpuslice.adapters.profiles.files import read_own_profiles
from gpuslice.cli import main
from gpuslice.core.sizing import Tenant, size_slices
from gpuslice.core.speedmodel import service_time_s

FAKE = ["--fake-timer", "resnet50@H100-SXM", "--warmup-s", "0.5", "--window-s", "2"]


def test_fake_timer_profile_matches_the_known_model_and_resumes(tmp_path: Path,
                                                                 capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "p.csv"
    assert main(["profile", "tiny", "--name", "resnet50", "--out", str(out), "--caps",
                 "20,50", "--batches", "1,8", "--procs", "1,2", *FAKE]) == 0
    pts = read_own_profiles(out).points
    assert len(pts) == 2 * 2 * 2
    for p in pts:
        t = service_time_s("resnet50", "H100-SXM", p.slice_size / 100, p.batch)
        t *= 1 + 0.05 * (p.procs - 1)
        assert p.latency_s == pytest.approx(t, rel=1e-3)
        assert p.throughput == pytest.approx(p.batch / t, rel=1e-3)
    assert (tmp_path / "p.png").stat().st_size > 1000
    capsys.readouterr()
    # resume: only the configurations not in the file yet are measured
    assert main(["profile", "tiny", "--name", "resnet50", "--out", str(out), "--caps",
                 "20,50,100", "--batches", "1,8", "--procs", "1,2", *FAKE]) == 0
    assert "measured 4 configuration(s)" in capsys.readouterr().out
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12 and len({tuple(r.values()) for r in rows}) == 12
    # the sizing reads what was measured
    sized = size_slices([Tenant("lc", "resnet50", slo_ms=60.0), Tenant("be", "resnet50")],
                        read_own_profiles(out), "H100-SXM", step=10, min_pct=10)
    assert sized[0].p99_ms <= 60.0 and sum(s.thread_pct for s in sized) <= 100


def _worker(*args: str) -> tuple[int, list[dict[str, float]]]:
    import json
    import subprocess

    r = subprocess.run([sys.executable, "-m", "gpuslice.bench.worker", "--no-wait", *args],
                       capture_output=True, text=True, timeout=60, check=False)
    return r.returncode, [json.loads(x) for x in r.stdout.splitlines() if x.strip()]


def test_a_command_speaking_the_run_ok_protocol_is_measured(tmp_path: Path) -> None:
    prog = tmp_path / "model.py"
    prog.write_text("import sys, time\nfor line in sys.stdin:\n"
                    "    n = int(line.split()[1])\n    time.sleep(0.002 * n)\n"
                    "    print('OK', flush=True)\n")
    code, docs = _worker("--workload", f"cmd:{sys.executable} {prog}", "--batches", "1,4",
                         "--warmup-s", "0.05", "--window-s", "0.3")
    assert code == 0 and docs[-1]["done"] is True
    by_batch = {int(d["batch"]): d for d in docs if "batch" in d}
    assert by_batch[1]["p50_ms"] >= 2.0 and by_batch[4]["p50_ms"] >= 8.0
    assert by_batch[4]["throughput"] == pytest.approx(4000 / by_batch[4]["p50_ms"], rel=0.3)
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nfor line in sys.stdin:\n    print('ERR out of memory', "
                   "flush=True)\n")
    code, docs = _worker("--workload", f"cmd:{sys.executable} {bad}", "--window-s", "0.1")
    assert code == 1 and "out of memory" in str(docs[-1]["error"])


def test_missing_pieces_are_named(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    code = main(["profile", "resnet50", "--out", str(tmp_path / "p.csv")])
    err = capsys.readouterr().err
    assert code == 1  # the arguments are fine; what they need is not here (docs/cli.md: exit codes)
    assert "nvidia-ml-py is not installed" in err or "no NVIDIA GPU" in err or \
        "PyTorch is not installed" in err
    from gpuslice.bench.worker import main as worker

    assert worker(["--workload", "resnet50", "--no-wait"]) == 1
    out = capsys.readouterr().out
    assert "PyTorch is not installed" in out or "error" in out
    assert main(["profile", "tiny", "--caps", "0,200", *FAKE]) == 2
    assert "--caps" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(480)  # four fake-timed profiles of 84 windows: ~90 s on 2 idle cores
def test_the_planner_plans_with_mps_profiles(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    import yaml

    out = tmp_path / "p.csv"
    for model in ("resnet50", "bert-base", "mobilenet-v3", "embedder"):
        assert main(["profile", "tiny", "--name", model, "--out", str(out), "--caps",
                     "10,15,20,30,50,60,100", "--batches", "1,2,4,8", "--procs", "1,2,3",
                     "--fake-timer", f"{model}@H100-SXM", "--warmup-s", "0.05",
                     "--window-s", "0.2"]) == 0
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({"services": [
        {"name": "r", "model": "resnet50", "rate": 300, "slo_ms": 100},
        {"name": "b", "model": "bert-base", "rate": 60, "slo_ms": 300}]}))
    capsys.readouterr()
    assert main(["plan", "--profiles", str(out), "--services", str(tmp_path / "s.yaml"),
                 "--write-json", str(tmp_path / "plan.json")]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["valid"] and plan["gpus"] >= 1 and not plan["slo_violations"]
