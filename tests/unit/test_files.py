"""adapters/files.py: the node side's durable writes. Two writers of one file (the node agent
and the DRA driver in two containers, both PID 1; two threads of one process) never share a
temporary file, so neither fails and a reader sees one writer's whole content."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gpuslice.adapters import files
from gpuslice.adapters.files import write_atomic


def test_writers_with_the_same_pid_do_not_share_a_temporary_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files.os, "getpid", lambda: 1)  # PID 1 in every container
    target = tmp_path / "spec.json"
    errors: list[BaseException] = []

    def writer(payload: bytes) -> None:
        try:
            for _ in range(300):
                write_atomic(target, payload)
        except BaseException as exc:  # what the other writer's rename or truncate causes
            errors.append(exc)

    payloads = [b"a" * 50_000, b"b" * 50_000]
    threads = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert target.read_bytes() in payloads
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.json"]  # no temporary left
