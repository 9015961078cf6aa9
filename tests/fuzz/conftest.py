"""Print how many inputs each fuzz target tried (docs/testing.md, "Fuzzing")."""

from __future__ import annotations

from typing import Any

from tests.fuzz.helpers import EXAMPLES_ENV, TRIED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not TRIED:
        return
    tr = terminalreporter
    tr.section("fuzz inputs tried")
    for target, n in sorted(TRIED.items()):
        tr.write_line(f"{target:40s} {n:7d}")
    tr.write_line(f"{'total':40s} {sum(TRIED.values()):7d}   (more: {EXAMPLES_ENV}=N)")
