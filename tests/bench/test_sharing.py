"""``gpuslice bench sharing`` on a CPU with the fake timer (every code path, stand-in numbers),
and the GPU tier (the acceptance figures; skipped without an NVIDIA GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuslice.cli import main
from gpuslice.core import catalog
from gpuslice.core.errors import ValidationError

FAKE = ["--fake-timer", "resnet50@H100-SXM", "--workload", "tiny", "--warmup-s", "0.2",
        "--window-s", "1"]


def test_every_mode_runs_and_the_report_is_written(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    code = main(["bench", "sharing", *FAKE, "--replicas", "4", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    # the stand-in numbers may miss the GPU gates: the exit code says whether any check failed
    assert code == (1 if "FAIL  " in out else 0), out
    res = json.loads((tmp_path / "sharing.json").read_text())
    assert set(res["throughput"]) == {"exclusive-sequential", "time-slicing", "mps",
                                      "gpuslice"}
    assert res["throughput"]["gpuslice"]["caps"] == [25, 25, 25, 25]
    assert res["throughput"]["time-slicing"]["vs_time_slicing"] == 1.0
    assert {"time-slicing", "mps", "gpuslice"} <= set(res["noisy"])
    assert res["memory"]["over_cap"]["ok"] is False
    assert "OutOfMemoryError" in res["memory"]["over_cap"]["error"]
    assert res["memory"]["neighbours_ratio"] == pytest.approx(1.0, abs=0.05)
    assert "PASS  over-cap allocation fails" in out and "fake timer" in out
    assert (tmp_path / "sharing.png").stat().st_size > 1000


def test_caps_come_from_a_profile_when_given(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    prof = tmp_path / "p.csv"
    assert main(["profile", "tiny", "--name", "tiny", "--out", str(prof), "--caps",
                 "10,20,40,70,100", "--batches", "1,8,64", "--procs", "4",
                 "--fake-timer", "resnet50@H100-SXM", "--warmup-s", "0.1",
                 "--window-s", "0.5"]) == 0
    capsys.readouterr()
    code = main(["bench", "sharing", *FAKE, "--replicas", "4", "--parts", "throughput,noisy",
                 "--profile", str(prof), "--out", str(tmp_path / "b")])
    assert code == (1 if "FAIL  " in capsys.readouterr().out else 0)
    res = json.loads((tmp_path / "b" / "sharing.json").read_text())
    assert sum(res["throughput"]["gpuslice"]["caps"]) <= 100
    lc, be = res["noisy"]["caps"]
    assert lc + 3 * be <= 100
    # the fake GPU cannot hold 1.1x the solo p99 next to three others: said, and the default
    assert "no profiled cap meets" in res["noisy"]["sizing"] and (lc, be) == (40, 20)
    assert "memory" not in res


def test_bad_options_are_refused() -> None:
    assert main(["bench", "sharing", *FAKE, "--alloc-mib", "10", "--mem-cap-mib", "20"]) == 2
    assert main(["bench", "sharing", *FAKE, "--parts", "everything"]) == 2
    assert main(["bench", "sharing", *FAKE, "--noisy-splits", "50-30"]) == 2
    assert main(["bench", "sharing", *FAKE, "--noisy-splits", "50/0"]) == 2


def test_the_noisy_neighbour_trade_off_is_swept(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """--noisy-splits runs gpuslice with each LC/BE cap pair after the first (issue 33:
    the trade-off curve when one split misses the goal); the gates pass when some split
    holds both."""
    code = main(["bench", "sharing", *FAKE, "--parts", "noisy", "--noisy-splits",
                 "50/30,60/40", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    res = json.loads((tmp_path / "sharing.json").read_text())
    splits = res["noisy"]["splits"]
    assert [v["caps"] for v in splits] == [[40, 20], [50, 30], [60, 40]]
    assert splits[0]["lc_p99_ms"] == res["noisy"]["gpuslice"]["lc_p99_ms"]
    # the speed model: a larger BE cap gives BE more throughput
    assert splits[0]["be_rps"] < splits[1]["be_rps"] < splits[2]["be_rps"]
    assert "trade-off" in out and "60% / 40%" in out
    met = any(v["lc_p99_vs_solo"] <= 1.1 and v["be_vs_mps"] >= 0.85 for v in splits)
    assert code == (0 if met else 1)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.usefixtures("gpu_with_mps")
def test_sharing_on_a_real_gpu(tmp_path: Path) -> None:
    assert main(["bench", "sharing", "--out", str(tmp_path), "--warmup-s", "3",
                 "--window-s", "8"]) == 0
    res = json.loads((tmp_path / "sharing.json").read_text())
    print(json.dumps(res, indent=1))
    assert res["memory"]["over_cap"]["ok"] is False


def test_the_real_timer_path_runs_every_mode_on_the_chosen_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not the fake timer: the GPU comes from NVML (the real adapter over a fake
    libnvidia-ml), every MPS daemon is started for that GPU's UUID, and the workers (the tiny
    NumPy workload, timed for real) run each mode to the end."""
    from gpuslice.bench.sharing import SharingOptions, run_sharing
    from tests.fake_mps import write_fake_mps
    from tests.nodeagent.libnvml_fake import FakeLibNvml, h100, t4

    FakeLibNvml([t4("GPU-t4"), h100("GPU-h100")]).install(monkeypatch)
    log = tmp_path / "mps.log"
    monkeypatch.setenv("FAKE_MPS_LOG", str(log))
    opts = SharingOptions(workload="tiny", replicas=3, batch=4, lc_batch=1, be_batch=8,
                          be_replicas=2, warmup_s=0.05, window_s=0.2,
                          mps_binary=str(write_fake_mps(tmp_path / "mps-control")),
                          parts=("throughput", "noisy"), device_index=1)
    res = run_sharing(opts)
    assert res["gpu"] == "GPU-h100"
    assert set(res["throughput"]) == {"exclusive-sequential", "time-slicing", "mps", "gpuslice"}
    assert {"time-slicing", "mps", "gpuslice-caps", "gpuslice"} <= set(res["noisy"])
    starts = [line.split() for line in log.read_text().splitlines() if line.startswith("-d")]
    assert len(starts) == 5 and all(s[1] == "GPU-h100" for s in starts), starts
    with pytest.raises(ValidationError, match="--device"):
        run_sharing(SharingOptions(workload="tiny", device_index=7, parts=("throughput",)))


def test_each_mode_runs_as_often_as_asked_and_gpuslice_slices_are_capped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The throughput part through ``run_sharing`` with the workers replaced at their seam:
    the modes interleave run by run, every gpuslice replica gets 100/N % of the threads and
    1/N of the GPU's memory as MPS caps, and the summary's ratios, run-to-run spread,
    per-replica CV and worst p99 come from the workers' reports."""
    from gpuslice.bench import sharing

    calls: list[tuple[str, list[dict[str, str]]]] = []
    rates = {"exclusive-sequential": [100.0], "time-slicing": [60.0, 60.0, 60.0, 60.0],
             "mps": [90.0, 110.0, 90.0, 110.0], "gpuslice": [95.0, 95.0, 95.0, 95.0]}

    def fake_run_together(specs, run_id, errors_ok=False):  # type: ignore[no-untyped-def]
        envs = [s.env for s in specs]
        if len(specs) == 1:
            mode = "exclusive-sequential"
        elif "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in envs[0]:
            mode = "gpuslice"
        else:
            mode = "mps" if envs[0].get("GPUSLICE_FAKE_MODE") == "mps" else "time-slicing"
        calls.append((mode, envs))
        k = sum(1 for m, _ in calls if m == mode)  # this mode's run number
        return [[{"batch": 8, "throughput": r * k, "p99_ms": 5.0 + i + k}]
                for i, r in enumerate(rates[mode])]

    monkeypatch.setattr(sharing, "run_together", fake_run_together)
    res = sharing.run_sharing(sharing.SharingOptions(
        workload="tiny", replicas=4, repeats=2, fake_timer="resnet50@H200",
        parts=("throughput",)))
    order = [m for m, _ in calls]
    assert order == ["exclusive-sequential", "time-slicing", "mps", "gpuslice"] * 2
    for mode, envs in calls:
        if mode == "gpuslice":
            assert [e["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for e in envs] == ["25"] * 4
            mib = catalog.resolve("H200").memory_mib // 4  # the named GPU's memory
            assert {e["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] for e in envs} == {f"0={mib}M"}
        else:
            assert not any("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" in e for e in envs)
    thr = res["throughput"]
    assert res["repeats"] == 2 and thr["gpuslice"]["caps"] == [25] * 4
    # run 2 doubles every rate: means are 1.5x run 1, the spread between runs 2/3 of the mean
    assert thr["time-slicing"]["runs_rps"] == [240.0, 480.0]
    assert thr["gpuslice"]["total_rps"] == 570.0
    assert thr["gpuslice"]["vs_time_slicing"] == pytest.approx(570 / 360, abs=1e-3)
    assert thr["gpuslice"]["vs_one_replica"] == pytest.approx(570 / 150, abs=1e-3)
    assert thr["gpuslice"]["run_spread"] == pytest.approx(2 / 3, abs=1e-3)
    assert thr["gpuslice"]["cv"] == 0.0 and thr["mps"]["cv"] == pytest.approx(0.1)
    assert thr["mps"]["replicas_rps"] == [[90.0, 110.0, 90.0, 110.0],
                                          [180.0, 220.0, 180.0, 220.0]]
    assert thr["time-slicing"]["worst_p99_ms"] == 5.0 + 3 + 2  # last replica, second run
    with pytest.raises(ValidationError, match="--repeats"):
        sharing.SharingOptions(repeats=0)
