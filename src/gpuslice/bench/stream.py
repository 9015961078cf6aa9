"""One streamed chat completion, timed at the client: the time to the first token from a given
start (a request's scheduled send time, for open-loop load) and the time per output token
after it, read from the server-sent events as they arrive
(:class:`~gpuslice.adapters.http.sse.SseMeter`). Used by ``benchmarks/router_llm.py`` and by
``gpuslice demo``'s generative service."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from gpuslice.adapters.http.sse import SseMeter
from gpuslice.core.errors import ValidationError


def prompt_text(tokens: int) -> str:
    """A prompt of about ``tokens`` tokens (about four characters a token)."""
    return "word " * max(1, int(tokens * 4 / 5))


def chat_body(model: str, prompt_tokens: int, max_tokens: int) -> dict[str, object]:
    """A streamed chat completion of a ``prompt_tokens``-token prompt asking for
    ``max_tokens`` tokens, with the usage chunk at the end (the output's length)."""
    if not isinstance(model, str) or not model.strip():
        raise ValidationError("model", "a model name", model)
    for field, value in (("prompt_tokens", prompt_tokens), ("max_tokens", max_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValidationError(field, "a whole number of tokens >= 1", value)
    return {"model": model, "messages": [{"role": "user", "content": prompt_text(prompt_tokens)}],
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}


@dataclass(frozen=True, slots=True)
class StreamResult:
    """How one streamed request went: its HTTP status (-1: no answer, or the connection broke
    or timed out), the time to the first token and per output token after it (seconds; None
    where the stream did not tell), the output tokens, and whether it ended with ``[DONE]``."""

    status: int
    ttft_s: float | None
    tpot_s: float | None
    tokens: int | None
    done: bool

    @property
    def complete(self) -> bool:
        """Answered 200 and streamed to its end."""
        return self.status == 200 and self.done


async def stream_chat(session: aiohttp.ClientSession, url: str, body: dict[str, object],
                      start: float, clock: Callable[[], float] = time.perf_counter
                      ) -> StreamResult:
    """POST ``body`` to ``url`` and read the stream to its end; the times count from
    ``start`` (on ``clock``)."""
    meter = SseMeter(start)
    status = -1
    try:
        async with session.post(url, json=body) as r:
            status = r.status
            async for chunk in r.content.iter_any():
                meter.feed(chunk, clock())
    except (aiohttp.ClientError, TimeoutError):
        status = -1
    ttft, tpot, tokens = meter.outcome()
    return StreamResult(status, ttft, tpot, tokens, meter.done)
