"""The demo's plain event printer (``--no-live``) prints every event exactly once, also when
other threads (kubelets, the scheduler, the extender) add events while it prints."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gpuslice.demo.runtime import EventLog
from gpuslice.demo.scenario import Display


def test_an_event_added_while_printing_is_printed_at_the_next_tick(
        capsys: pytest.CaptureFixture[str]) -> None:
    log = EventLog()
    display = Display(SimpleNamespace(log=log), live=False)  # type: ignore[arg-type]
    real_print = display.console.print
    added = []

    def print_and_race(*args: Any, **kwargs: Any) -> None:
        real_print(*args, **kwargs)
        if not added:  # a kubelet thread logs while the first line is printed
            added.append(True)
            log.add("kubelet", "container of demo/r-0 exited (-9)")

    display.console.print = print_and_race  # type: ignore[method-assign]
    log.add("crash", "killed demo/r-0")
    display.tick()
    display.tick()
    display.tick()
    out = capsys.readouterr().out
    assert out.count("killed demo/r-0") == 1, out
    assert out.count("container of demo/r-0 exited") == 1, out


def test_an_install_hint_keeps_its_extra_on_the_terminal(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 54: ``pip install '/src/gpuslice[gpu]'`` in an event is printed as written (rich
    took ``[gpu]`` for markup and dropped it), by the line printer and by the live view."""
    from rich.console import Console

    log = EventLog()
    text = "nvidia-ml-py is not installed: pip install '/src/gpuslice[gpu]'"
    log.add("node", text)
    display = Display(SimpleNamespace(log=log, phases=[], samples=[]), live=False)  # type: ignore[arg-type]
    display.tick()
    assert text in capsys.readouterr().out
    console = Console(width=200, record=True)
    console.print(display.render())
    assert text in console.export_text()
