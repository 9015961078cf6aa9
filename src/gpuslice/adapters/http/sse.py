"""Timing of a server-sent-event token stream as it passes through the proxy (OpenAI-style:
``data: {chunk}`` events separated by a blank line, ending with ``data: [DONE]``).

The proxy forwards every chunk of bytes the moment it arrives; :class:`SseMeter` only looks at
them: it finds the event boundaries, tells the events that carry tokens (non-empty ``content``,
``text`` or ``reasoning_content``, or a tool call) from the others (the role-only first chunk,
an empty usage chunk, ``[DONE]``, comments), reads ``usage.completion_tokens`` where the
stream ends with one (``stream_options.include_usage``), and from the times the events arrived
gives the time to the first token and the time per output token.
"""

from __future__ import annotations

import re

MAX_PARTIAL = 1 << 20  # an event longer than this is passed on without being looked at
_TOKEN = re.compile(rb'"(?:content|text|reasoning_content)"\s*:\s*"(?!")|"tool_calls"\s*:\s*\[\{')
_USAGE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


class SseMeter:
    """Feed it each chunk with the time it arrived; read :meth:`outcome` at the end."""

    __slots__ = ("done", "events", "first", "last", "partial", "start", "usage_tokens")

    def __init__(self, start: float) -> None:
        self.start = start
        self.partial = b""
        self.first: float | None = None
        self.last: float | None = None
        self.events = 0  # events that carried tokens
        self.usage_tokens: int | None = None
        self.done = False

    def feed(self, chunk: bytes, now: float) -> None:
        data = self.partial + chunk if self.partial else chunk
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        pos = 0
        while True:
            end = data.find(b"\n\n", pos)
            if end < 0:
                break
            self._event(data[pos:end], now)
            pos = end + 2
        rest = data[pos:]
        self.partial = rest if len(rest) <= MAX_PARTIAL else b""

    def _event(self, event: bytes, now: float) -> None:
        i = event.find(b"data:")
        if i < 0:
            return  # a comment (keep-alive), or an event with no data
        payload = event[i + 5:].lstrip()
        if payload.startswith(b"[DONE]"):
            self.done = True
            return
        if b'"usage"' in payload:
            m = _USAGE.search(payload)
            if m is not None:
                self.usage_tokens = int(m.group(1))
        if _TOKEN.search(payload) is None:
            return
        self.events += 1
        if self.first is None:
            self.first = now
        self.last = now

    def outcome(self) -> tuple[float | None, float | None, int | None]:
        """(time to first token, time per output token, output tokens); None where the stream
        did not tell (no token, or a single one for TPOT)."""
        if self.first is None:
            return None, None, self.usage_tokens
        tokens = self.usage_tokens if self.usage_tokens else self.events
        ttft = self.first - self.start
        tpot = None
        if tokens > 1 and self.last is not None and self.last > self.first:
            tpot = (self.last - self.first) / (tokens - 1)
        return ttft, tpot, tokens
