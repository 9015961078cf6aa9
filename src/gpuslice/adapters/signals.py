"""The process's stop signals: SIGTERM (the kubelet stopping the pod, ``kubectl delete``) and
SIGINT (Ctrl-C) as one request to stop cleanly.

A long-running component stops serving, gives up what it holds (its Lease) and exits 0 within
about two seconds, well inside the pod's termination grace period: a component that ignores
SIGTERM is killed only when the grace period ends (30 s by default), and a standby replica
waits for its Lease to lapse besides. One helper for every component (extender, DRA
allocator, reconfig controller, router, node agent), used in two ways:

* threads: ``with StopSignals() as stop: loop_until(stop.event)``; ``StopSignals(cb)`` also
  calls ``cb()`` (e.g. ``agent.stop``) from the handler;
* asyncio: ``StopSignals(event.set).install(loop)`` runs the callbacks on the loop.

The handlers only record the signal and call the callbacks (no logging inside a signal
handler: the interrupted frame may hold the logging lock); the component logs its shutdown
line with :meth:`StopSignals.stopped_line` once it has stopped. ``restore()`` (or leaving the
``with`` block) puts back the handlers that were there before, so that a command run inside
another process (the tests) does not change that process's Ctrl-C.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio
    from types import FrameType, TracebackType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    def __init__(self, *callbacks: Callable[[], object]) -> None:
        self.event = threading.Event()  # set by the first stop signal
        self.received: str | None = None  # its name, e.g. "SIGTERM"
        self._callbacks = list(callbacks)
        self._old: dict[signal.Signals, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def _on_signal(self, signum: int, _frame: FrameType | None = None) -> None:
        first = not self.event.is_set()
        self.received = self.received or signal.Signals(signum).name
        self.event.set()
        if first:
            for cb in self._callbacks:
                cb()

    def install(self, loop: asyncio.AbstractEventLoop | None = None) -> StopSignals:
        """Handle the stop signals: in the main thread (``loop`` None), or on ``loop`` (the
        callbacks then run on it, between two of its callbacks)."""
        self._loop = loop
        for sig in STOP_SIGNALS:
            if loop is None:
                self._old[sig] = signal.signal(sig, self._on_signal)
            else:
                loop.add_signal_handler(sig, self._on_signal, int(sig))
        return self

    def restore(self) -> None:
        for sig in STOP_SIGNALS:
            if self._loop is not None:
                self._loop.remove_signal_handler(sig)
            elif sig in self._old:
                signal.signal(sig, self._old[sig])
        self._old.clear()
        self._loop = None

    def __enter__(self) -> StopSignals:
        return self if self._old or self._loop is not None else self.install()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.restore()

    def stopped_line(self, what: str = "") -> str:
        """``stopped on SIGTERM (what)``: the component's last log line."""
        why = f" on {self.received}" if self.received else ""
        return f"stopped{why}" + (f": {what}" if what else "")
