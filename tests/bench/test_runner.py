"""Co-located benchmark workers (real timer, the tiny NumPy workload): all start on GO, and a
worker that finishes its window first keeps its load on until every worker has reported."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

from gpuslice.bench.runner import WorkerSpec, run_together


def test_a_worker_done_first_holds_its_load_until_stop() -> None:
    w = subprocess.Popen([sys.executable, "-m", "gpuslice.bench.worker", "--workload", "tiny",
                          "--batches", "4", "--warmup-s", "0.05", "--window-s", "0.1"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert w.stdin is not None and w.stdout is not None
    try:
        assert json.loads(w.stdout.readline()) == {"ready": True}
        w.stdin.write("GO\n")
        w.stdin.flush()
        row = json.loads(w.stdout.readline())
        assert row["batch"] == 4 and row["throughput"] > 0
        assert json.loads(w.stdout.readline()) == {"holding": True}
        time.sleep(0.3)
        assert w.poll() is None  # still running batches
        w.stdin.write("STOP\n")
        w.stdin.flush()
        done = json.loads(w.stdout.readline())
        assert done["done"] and done["held_batches"] > 0
        assert w.wait(10) == 0
    finally:
        if w.poll() is None:
            w.kill()


def test_run_together_stops_holding_workers_after_the_last_report() -> None:
    short = WorkerSpec("tiny", (2,), 0.05, 0.1)
    long = WorkerSpec("tiny", (2, 8), 0.05, 0.4)
    t0 = time.monotonic()
    rows = run_together([short, long, short], uuid.uuid4().hex[:12])
    assert time.monotonic() - t0 < 20
    assert [[r["batch"] for r in mine] for mine in rows] == [[2], [2, 8], [2]]
    assert all(r["throughput"] > 0 for mine in rows for r in mine)  # type: ignore[operator]
