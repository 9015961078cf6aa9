"""Identical warnings once per window with a count (cli.common.RepeatFilter): the DRA
allocator retrying a refused claim every pass logged 182 identical lines in one second."""

from __future__ import annotations

import json
import logging

import pytest

from gpuslice.cli.common import RepeatFilter, setup_logging


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_identical_warning_passes_once_a_window_then_with_the_count() -> None:
    clock = Clock()
    f = RepeatFilter(60.0, clock)
    seen: list[logging.LogRecord] = []

    def warn(msg: str, *args: object, level: int = logging.WARNING) -> None:
        record = logging.LogRecord("gpuslice.x", level, __file__, 1, msg, args, None)
        if f.filter(record):
            seen.append(record)

    c1 = "problem: claim %s: not allocated: API server: 422 Invalid"
    for i in range(182):  # one second of passes
        clock.now = 100.0 + i / 182
        warn(c1, "ml/c1")
    warn(c1, "ml/c2")  # another claim: its own line
    warn("allocated %s", "ml/c3", level=logging.INFO)  # below WARNING: never held back
    warn("allocated %s", "ml/c3", level=logging.INFO)
    assert [r.getMessage() for r in seen] == [
        "problem: claim ml/c1: not allocated: API server: 422 Invalid",
        "problem: claim ml/c2: not allocated: API server: 422 Invalid",
        "allocated ml/c3", "allocated ml/c3"]
    seen.clear()
    clock.now = 130.0
    warn(c1, "ml/c1")  # still inside the minute
    assert seen == []
    clock.now = 160.5  # a minute after the first: it passes, with what was held back
    warn(c1, "ml/c1")
    (again,) = seen
    assert again.getMessage() == ("problem: claim ml/c1: not allocated: API server: 422 "
                                  "Invalid (and 182 more like it since it was last logged)")
    assert again.repeated == 182  # type: ignore[attr-defined]
    seen.clear()
    seen.clear()
    clock.now = 170.0  # the same error but for the address of a connection object in it
    warn("problem: API server unreachable: %s", "<HTTPConnection object at 0x7f3a2b1c0d90>")
    warn("problem: API server unreachable: %s", "<HTTPConnection object at 0x7f3a2b1c4410>")
    assert len(seen) == 1
    seen.clear()
    clock.now = 500.0  # long quiet: forgotten, passes as new
    warn(c1, "ml/c1")
    assert [r.getMessage() for r in seen] == [
        "problem: claim ml/c1: not allocated: API server: 422 Invalid"]


def test_setup_logging_holds_repeats_back_when_asked(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    try:
        log = setup_logging("json", "dra-allocator", repeats_every_s=60.0)
        for _ in range(50):
            log.warning("problem: %s", "claim ml/c1: refused")
        log.info("still here")
        lines = [json.loads(x) for x in capsys.readouterr().err.splitlines()]
        assert [(x["level"], x["msg"]) for x in lines] == [
            ("warning", "problem: claim ml/c1: refused"), ("info", "still here")]
        log = setup_logging("json", "extender")  # not asked: every line passes
        for _ in range(3):
            log.warning("same")
        assert len(capsys.readouterr().err.splitlines()) == 3
    finally:
        root = logging.getLogger("gpuslice")
        for h in list(root.handlers):
            root.removeHandler(h)
        root.propagate = True
