"""``gpuslice profile openai:URL``: a generative profile row of an OpenAI-compatible server.

At each concurrency level, that many clients send streamed chat completions back to back (a
prompt of about ``prompt_tokens`` tokens, ``max_tokens`` = ``output_tokens`` with vLLM's
``ignore_eos`` so that every answer has that length) for ``warmup_s`` + ``window_s`` seconds.
Requests sent after the warm-up and answered within the window give the TTFT (send to the first
token) and TPOT (the mean gap after it); every token that arrives within the window counts
towards the output tokens per second. The row (``core.generative.point_from_levels``) goes to
the generative profile CSV, replacing one of the same model, GPU and slice."""

from __future__ import annotations

import asyncio
import csv
import io
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson

from gpuslice.adapters.outputs import write_files
from gpuslice.adapters.profiles.files import GEN_COLUMNS, read_generative_profiles
from gpuslice.core.errors import Unavailable, ValidationError
from gpuslice.core.generative import GenerativePoint, LevelMeasure, point_from_levels

PREFIX = "openai:"


@dataclass(frozen=True)
class OpenAIProfileOptions:
    url: str  # the API's base, http://HOST:PORT/v1
    model: str  # what the requests name
    gpu: str
    slice_kind: str
    slice_size: int
    out: Path
    name: str = ""  # the model in the CSV (default: model)
    concurrency: tuple[int, ...] = (1, 4, 16)
    prompt_tokens: int = 1000
    output_tokens: int = 200
    warmup_s: float = 5.0
    window_s: float = 30.0
    ignore_eos: bool = True


def parse_url(spec: str) -> str:
    """``openai:http://HOST:PORT/v1`` -> the base URL (no trailing slash)."""
    url = spec.removeprefix(PREFIX).rstrip("/")
    if not url.startswith(("http://", "https://")) or "://" not in url[:8] or len(url) < 10:
        raise ValidationError("workload", "openai:http://HOST:PORT/v1 (the API's base URL)",
                              spec)
    return url


@dataclass
class _Level:
    start: float
    warm: float
    end: float
    prompt_guess: int  # the prompt's tokens where the server sends no usage
    tokens_in_window: int = 0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)


def _body(opts: OpenAIProfileOptions) -> bytes:
    # "word" repeated, a token or so each; the row uses the server's own count (usage)
    text = " ".join(["word"] * max(1, opts.prompt_tokens - 8))
    doc: dict[str, object] = {
        "model": opts.model, "stream": True, "max_tokens": opts.output_tokens,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": text}]}
    if opts.ignore_eos:
        doc["ignore_eos"] = True
    return orjson.dumps(doc)


def _has_token(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or choice.get("text") or delta.get("reasoning_content"):
            return True
    return False


async def _one(session: aiohttp.ClientSession, url: str, body: bytes, lv: _Level) -> None:
    sent = time.monotonic()
    times: list[float] = []
    prompt = 0
    async with session.post(url, data=body,
                            headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            text = (await resp.text())[:300]
            raise Unavailable(f"{url} answered {resp.status}: {text}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = orjson.loads(line[5:])
            usage = event.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
                prompt = usage["prompt_tokens"]
            if _has_token(event):
                now = time.monotonic()
                times.append(now)
                if lv.warm <= now <= lv.end:
                    lv.tokens_in_window += 1
    if sent >= lv.warm and times and times[-1] <= lv.end and len(times) >= 2:
        lv.ttft.append(times[0] - sent)
        lv.tpot.append((times[-1] - times[0]) / (len(times) - 1))
        lv.prompt.append(prompt or lv.prompt_guess)


async def _client(session: aiohttp.ClientSession, url: str, body: bytes, lv: _Level) -> None:
    while time.monotonic() < lv.end:
        await _one(session, url, body, lv)


async def measure_level(opts: OpenAIProfileOptions, concurrency: int) -> LevelMeasure:
    """``concurrency`` clients for the warm-up and the window; the streams still running at
    its end are cancelled (the server aborts them)."""
    now = time.monotonic()
    lv = _Level(now, now + opts.warmup_s, now + opts.warmup_s + opts.window_s,
                opts.prompt_tokens)
    url, body = f"{opts.url}/chat/completions", _body(opts)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(_client(session, url, body, lv))
                 for _ in range(concurrency)]
        done, pending = await asyncio.wait(tasks, timeout=lv.end - time.monotonic())
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for t in done:
            if (exc := t.exception()) is not None:
                raise exc
    n = len(lv.ttft)

    def pct(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q)) * 1000 if xs else 0.0

    return LevelMeasure(concurrency, n, float(np.mean(lv.prompt)) if n else 0.0,
                        pct(lv.ttft, 50), pct(lv.ttft, 99),
                        float(np.mean(lv.tpot)) * 1000 if n else 0.0, pct(lv.tpot, 99),
                        lv.tokens_in_window / opts.window_s)


def run_openai_profile(opts: OpenAIProfileOptions,
                       progress: Callable[[str, int, int], None] | None = None
                       ) -> tuple[GenerativePoint, list[LevelMeasure]]:
    """Measure every concurrency level, then write the row into ``opts.out``."""
    levels: list[LevelMeasure] = []
    for i, c in enumerate(opts.concurrency):
        if progress is not None:
            progress(f"concurrency {c}", i, len(opts.concurrency))
        try:
            levels.append(asyncio.run(measure_level(opts, c)))
        except (aiohttp.ClientError, OSError) as exc:
            raise Unavailable(f"{opts.url} did not answer as an OpenAI-compatible server: "
                              f"{exc}") from None
    point = point_from_levels(opts.name or opts.model, opts.gpu, opts.slice_kind,
                              opts.slice_size, levels)
    write_row(opts.out, point)
    return point, levels


def write_row(out: Path, point: GenerativePoint) -> None:
    """``point`` into the generative profile CSV ``out`` (made when missing), in place of a
    row of the same model, GPU and slice."""
    rows = read_generative_profiles(out) if out.is_file() and out.stat().st_size else []
    key = (point.model, point.gpu, point.slice_kind, point.slice_size)
    rows = [r for r in rows if (r.model, r.gpu, r.slice_kind, r.slice_size) != key] + [point]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(GEN_COLUMNS)
    for r in rows:
        w.writerow([r.model, r.gpu, r.slice_kind, r.slice_size, f"{r.prefill_tokens_per_s:g}",
                    f"{r.decode_tokens_per_s:g}", r.max_seqs])
    text = buf.getvalue()
    write_files({out: lambda path: path.write_text(text, encoding="utf-8")}, "--out")
