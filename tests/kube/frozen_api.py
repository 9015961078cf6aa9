"""A frozen API server: kube-apiserver that accepts connections and reads requests but never
answers them (what a node sees while etcd or the control plane hangs), then recovers."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler

from tests.kube.rest_fake import RestApiServer


class FrozenApiServer(RestApiServer):
    """:class:`RestApiServer` that, while :attr:`frozen` is set, holds every request without
    an answer until it is thawed (then the connection is closed, still without one)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = threading.Event()
        self._thawed = threading.Event()
        self._held = 0
        self.arrived = 0  # requests held since the start, answered by now or not
        self._held_lock = threading.Lock()

    @property
    def held(self) -> int:
        """Requests held unanswered right now."""
        with self._held_lock:
            return self._held

    def freeze(self) -> None:
        self._thawed.clear()
        self.frozen.set()

    def thaw(self) -> None:
        self.frozen.clear()
        self._thawed.set()

    def wait_arrived(self, n: int, timeout_s: float = 5.0) -> bool:
        """Whether ``n`` requests have been held since the start, waiting up to
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.arrived < n:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        if not self.frozen.is_set():
            super()._handle(h)
            return
        with self._held_lock:
            self._held += 1
            self.arrived += 1
        try:
            while not self._thawed.wait(0.1) and not self._stop.is_set():
                pass
        finally:
            with self._held_lock:
                self._held -= 1
        h.close_connection = True  # never answered

    def stop(self) -> None:
        self.thaw()
        super().stop()
