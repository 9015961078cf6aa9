"""A fake OpenAI-style model server on a slice, for tests, benchmarks and the demo.

It serves ``POST /v1/chat/completions``, ``/v1/completions`` (streamed as server-sent events
or not), ``/v1/embeddings``, ``GET /v1/models``, ``/health`` and ``/metrics`` with vLLM's
metric names (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` and, with ``--v0-metrics``, the older
``vllm:gpu_cache_usage_perc`` instead), and ``GET /fake/stats`` (its own counters, for tests).

The engine is a continuous-batching model of vLLM's: requests wait until the KV cache holds
their prompt and output (``kv_tokens``) and a sequence slot is free (``max_seqs``); each engine
step prefills up to ``chunk_tokens`` prompt tokens (chunked prefill) and decodes one token for
every running sequence whose prompt is done, and lasts ``step_s + step_per_seq_s x decoding
+ prefilled / prefill_tps``. The step that finishes a prompt also yields its first token.
The speeds come from the slice: prefill is compute bound (in proportion to the MIG compute
slices), decode memory bound (in proportion to the memory slices), and the KV cache is what
the slice's memory holds after the weights (:meth:`EngineSpec.for_slice`). Output: exactly
``max_tokens`` tokens (as a benchmark's ``ignore_eos``), else ``--default-output``. A client
that goes away aborts its sequence, as vLLM does.

    python -m gpuslice.adapters.http.fake_llm --port 0 --slice 1g --model m   # "ready PORT"
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import orjson
from aiohttp import web

from gpuslice.adapters.http.fake_replica import run_serving
from gpuslice.adapters.http.openai import ENDPOINTS, OpenAIError, error_body, parse_request

# A100-80GB MIG slices: (compute slices of 7, memory slices of 8, GB)
SLICES = {"1g": (1, 1, 10.0), "2g": (2, 2, 20.0), "3g": (3, 4, 40.0), "4g": (4, 4, 40.0),
          "7g": (7, 8, 80.0)}


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """An engine's speed and capacity. The defaults: a 3B model (Llama-3.2-3B-like: 6.4 GB of
    weights, 112 KiB of KV cache per token) on a whole A100-80GB at
    ``--gpu-memory-utilization 0.9``."""

    prefill_tps: float = 24000.0
    step_s: float = 0.006
    step_per_seq_s: float = 0.00005
    kv_tokens: int = 560_000
    max_seqs: int = 256
    chunk_tokens: int = 2048

    @staticmethod
    def for_slice(name: str, whole: EngineSpec | None = None, weights_gb: float = 7.0,
                  kv_bytes_per_token: int = 114_688, utilization: float = 0.9,
                  time_scale: float = 1.0) -> EngineSpec:
        """The engine on MIG slice ``name`` (1g, 2g, 3g, 4g, 7g): prefill at its share of the
        compute, decode at its share of the memory bandwidth, the KV cache from its memory
        (utilization x memory - weights and activations); all times x ``time_scale``."""
        if name not in SLICES:
            raise ValueError(f"slice: expected one of {', '.join(SLICES)}, got {name!r}")
        w = whole or EngineSpec()
        compute, memory, gb = SLICES[name]
        kv = int(max(0.0, gb * utilization - weights_gb) * 1e9 / kv_bytes_per_token)
        return replace(w, prefill_tps=w.prefill_tps * compute / 7 / time_scale,
                       step_s=w.step_s * 8 / memory * time_scale,
                       step_per_seq_s=w.step_per_seq_s * 8 / memory * time_scale,
                       kv_tokens=max(1, kv))

    def capacity_rps(self, prompt: float, output: float) -> float:
        """Requests/s it sustains at saturation with mean ``prompt`` and ``output`` tokens:
        ``1 / (output x step(c) / c + prompt / prefill_tps)`` with ``c`` the sequences that
        fit (slots and KV cache)."""
        c = max(1.0, min(self.max_seqs, self.kv_tokens / max(1.0, prompt + output)))
        step = self.step_s + self.step_per_seq_s * c
        return 1.0 / (output * step / c + prompt / self.prefill_tps)


@dataclass(eq=False)
class _Seq:
    prompt: int
    output: int
    queue: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    prefilled: int = 0
    generated: int = 0
    aborted: bool = False

    @property
    def reserve(self) -> int:
        return self.prompt + self.output


class Engine:
    """The continuous-batching loop; :meth:`submit` a sequence, read its tokens from its
    queue (an int per token, None at the end)."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.kv_used = 0
        self.wake = asyncio.Event()
        self.stats = {"finished": 0, "aborted": 0, "generated_tokens": 0, "prompt_tokens": 0,
                      "steps": 0}
        self.task: asyncio.Task[None] | None = None

    def submit(self, seq: _Seq) -> None:
        self.waiting.append(seq)
        self.wake.set()

    def abort(self, seq: _Seq) -> None:
        seq.aborted = True
        if seq in self.waiting:
            self.waiting.remove(seq)
            self.stats["aborted"] += 1

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.spec.max_seqs:
            seq = self.waiting[0]
            if self.kv_used + seq.reserve > self.spec.kv_tokens and self.running:
                return  # wait for a finish (a lone request too big runs anyway)
            self.waiting.popleft()
            self.kv_used += seq.reserve
            self.running.append(seq)

    def kv_usage(self) -> float:
        used = sum(s.prompt + s.generated for s in self.running)
        return min(1.0, used / self.spec.kv_tokens)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            self._admit()
            if not self.running:
                self.wake.clear()
                await self.wake.wait()
                deadline = loop.time()
                continue
            for seq in [s for s in self.running if s.aborted]:
                self._finish(seq, aborted=True)  # its client went away: no more work on it
            if not self.running:
                continue
            budget = self.spec.chunk_tokens
            prefill = 0
            finishing_prefill = []
            decoding = []
            for seq in self.running:
                if seq.prefilled < seq.prompt:
                    take = min(budget, seq.prompt - seq.prefilled)
                    if take <= 0:
                        continue
                    seq.prefilled += take
                    budget -= take
                    prefill += take
                    if seq.prefilled >= seq.prompt:
                        finishing_prefill.append(seq)
                else:
                    decoding.append(seq)
            dt = (self.spec.step_s + self.spec.step_per_seq_s * len(decoding)
                  + prefill / self.spec.prefill_tps)
            deadline = max(deadline + dt, loop.time())
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            self.stats["steps"] += 1
            self.stats["prompt_tokens"] += prefill
            self._emit(finishing_prefill + decoding)

    def _emit(self, seqs: list[_Seq]) -> None:
        for seq in seqs:
            if seq.aborted:
                self._finish(seq, aborted=True)
                continue
            seq.generated += 1
            self.stats["generated_tokens"] += 1
            seq.queue.put_nowait(seq.generated)
            if seq.generated >= seq.output:
                self._finish(seq)

    def _finish(self, seq: _Seq, aborted: bool = False) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.kv_used -= seq.reserve
        self.stats["aborted" if aborted else "finished"] += 1
        seq.queue.put_nowait(None)


def _chunk(kind: str, model: str, rid: str, created: int, text: str | None,
           finish: str | None = None, role: bool = False) -> bytes:
    if kind == "chat":
        delta: dict[str, str] = {"role": "assistant", "content": ""} if role else (
            {"content": text} if text is not None else {})
        choice: dict[str, object] = {"index": 0, "delta": delta, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish}
        obj = "text_completion"
    body = orjson.dumps({"id": rid, "object": obj, "created": created, "model": model,
                         "choices": [choice]})
    return b"data: " + body + b"\n\n"


class FakeLlm:
    def __init__(self, model: str, spec: EngineSpec, adapters: Sequence[str] = (),
                 default_output: int = 128, v0_metrics: bool = False) -> None:
        self.model = model
        self.models = [model, *adapters]
        self.adapters = set(adapters)
        self.engine = Engine(spec)
        self.default_output = default_output
        self.v0_metrics = v0_metrics
        self.counter = 0

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.path
        if path in ("/health", "/v2/health/ready", "/healthz"):
            return web.Response(text="")
        if path == "/metrics":
            return web.Response(body=self.metrics(), content_type="text/plain")
        if path == "/fake/stats":
            return web.json_response({**self.engine.stats, "running": len(self.engine.running),
                                      "waiting": len(self.engine.waiting)})
        if path == "/v1/models":
            return web.json_response({"object": "list", "data": [
                {"id": m, "object": "model", "owned_by": "fake"} for m in self.models]})
        kind = ENDPOINTS.get(path)
        if kind is None or request.method != "POST":
            return _error(404, f"no route {request.method} {path}")
        try:
            req = parse_request(kind, await request.read())
        except OpenAIError as exc:
            return _error(exc.status, str(exc), exc.param)
        if req.model not in self.models:
            return _error(404, f"The model `{req.model}` does not exist.", "model")
        out = 0 if kind == "embedding" else (req.max_tokens if req.max_tokens is not None
                                             else self.default_output)
        seq = _Seq(max(1, req.prompt_tokens), max(1, out) * req.choices)
        self.engine.submit(seq)
        try:
            if req.stream and kind != "embedding":
                return await self._stream(request, kind, req.model, seq)
            return await self._whole(kind, req.model, seq)
        except (asyncio.CancelledError, ConnectionError):
            self.engine.abort(seq)
            raise

    async def _stream(self, request: web.BaseRequest, kind: str, model: str,
                      seq: _Seq) -> web.StreamResponse:
        self.counter += 1
        rid, created = f"cmpl-{self.counter}", int(time.time())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        first = True
        while True:
            n = await seq.queue.get()
            if n is None:
                break
            parts = [_chunk(kind, model, rid, created, None, role=True)] if first and \
                kind == "chat" else []
            first = False
            parts.append(_chunk(kind, model, rid, created, f" t{n}"))
            await resp.write(b"".join(parts))
        if seq.aborted:
            return resp
        usage = orjson.dumps({"id": rid, "object": "chat.completion.chunk", "created": created,
                              "model": model, "choices": [], "usage": {
                                  "prompt_tokens": seq.prompt, "completion_tokens":
                                  seq.generated, "total_tokens": seq.prompt + seq.generated}})
        await resp.write(_chunk(kind, model, rid, created, None, finish="length")
                         + b"data: " + usage + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _whole(self, kind: str, model: str, seq: _Seq) -> web.Response:
        while await seq.queue.get() is not None:
            pass
        usage = {"prompt_tokens": seq.prompt, "completion_tokens": seq.generated,
                 "total_tokens": seq.prompt + seq.generated}
        if kind == "embedding":
            doc: dict[str, object] = {"object": "list", "model": model, "data": [
                {"object": "embedding", "index": 0, "embedding": [0.0] * 8}],
                "usage": {"prompt_tokens": seq.prompt, "total_tokens": seq.prompt}}
        else:
            text = "".join(f" t{i + 1}" for i in range(seq.generated))
            choice: dict[str, object] = {"index": 0, "finish_reason": "length"}
            choice.update({"message": {"role": "assistant", "content": text}}
                          if kind == "chat" else {"text": text})
            doc = {"id": "cmpl-whole", "object": "chat.completion" if kind == "chat" else
                   "text_completion", "model": model, "choices": [choice], "usage": usage}
        return web.Response(body=orjson.dumps(doc), content_type="application/json")

    def metrics(self) -> bytes:
        e = self.engine
        labels = f'{{model_name="{self.model}",engine="0"}}'
        kv_name = "vllm:gpu_cache_usage_perc" if self.v0_metrics else "vllm:kv_cache_usage_perc"
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{labels} {float(len(e.running))}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{labels} {float(len(e.waiting))}",
            f"# HELP {kv_name} KV-cache usage. 1 means 100 percent usage.",
            f"# TYPE {kv_name} gauge",
            f"{kv_name}{labels} {e.kv_usage()}",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{labels} {float(e.stats['generated_tokens'])}",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{labels} {float(e.stats['prompt_tokens'])}",
        ]
        return ("\n".join(lines) + "\n").encode()


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    return web.Response(status=status, body=error_body(status, message, param),
                        content_type="application/json")


async def serve(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    spec = spec_from_args(args)
    fake = FakeLlm(args.model, spec, [a for a in args.lora.split(",") if a],
                   args.default_output, args.v0_metrics)
    fake.engine.task = asyncio.create_task(fake.engine.run())
    runner = web.ServerRunner(web.Server(fake.handle, access_log=None,
                                         handler_cancellation=True))
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port, backlog=1024).start()
    print(f"ready {runner.addresses[0][1]}", flush=True)
    await stop.wait()
    await runner.cleanup()
    fake.engine.task.cancel()


def spec_from_args(args: argparse.Namespace) -> EngineSpec:
    spec = EngineSpec.for_slice(args.slice, time_scale=args.time_scale)
    if args.max_num_seqs is not None:
        spec = replace(spec, max_seqs=args.max_num_seqs)
    for name, key in (("prefill_tps", "prefill_tps"), ("step_ms", "step_s"),
                      ("kv_tokens", "kv_tokens")):
        value = getattr(args, name)
        if value is not None:
            spec = replace(spec, **{key: value / 1e3 if name == "step_ms" else value})
    if not (spec.prefill_tps > 0 and spec.step_s >= 0 and math.isfinite(spec.step_s)):
        raise SystemExit("prefill tokens/s must be > 0 and the step time >= 0")
    return spec


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="fake OpenAI-style model server on a slice")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--model", default="llm")
    ap.add_argument("--lora", default="", help="LoRA adapter names it also serves (a,b)")
    ap.add_argument("--slice", default="7g", choices=sorted(SLICES))
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="every duration x this (a slower world: fewer events per second)")
    ap.add_argument("--max-num-seqs", type=int)
    ap.add_argument("--prefill-tps", type=float)
    ap.add_argument("--step-ms", type=float)
    ap.add_argument("--kv-tokens", type=int)
    ap.add_argument("--default-output", type=int, default=128)
    ap.add_argument("--v0-metrics", action="store_true",
                    help="export vllm:gpu_cache_usage_perc (vLLM before V1)")
    ap.add_argument("--uvloop", action="store_true")
    args = ap.parse_args(argv)
    run_serving(serve(args), args.uvloop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
