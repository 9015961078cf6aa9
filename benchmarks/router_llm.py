"""Generative requests on heterogeneous slices: time to first token and time per output token
by routing policy (issue 52 acceptance).

Three fake OpenAI-style replicas (``gpuslice.adapters.http.fake_llm``: a continuous-batching
engine, KV cache included, with vLLM's metric names) run as processes on 127.0.0.1, one per
A100-80GB MIG slice: a whole GPU (7g.80gb), a 3g.40gb and a 1g.10gb, the same 3B-parameter model
on each: prefill in proportion to the slice's compute, decode to its memory bandwidth, the KV
cache to what its memory holds after the weights (the 1g's holds about 13 average requests).
Requests are chat completions, streamed, with prompt and output lengths drawn from the Azure
LLM inference trace 2023 (conversation; ``benchmarks/llm_lengths.py`` cites it), ``max_tokens``
the drawn output (as vLLM's own serving benchmark sends the dataset's output length). For each
policy a router process is started and driven open-loop (Poisson) at 85% of the three
replicas' capacity (their saturation throughput for this mix, from the engine model); the
client measures, per request, the time to the first token from its scheduled send time and
the time per output token after it.

``sed`` gets what gpuslice knows of each replica (its slice's prefill and decode speeds and KV
cache, from the plan's generative profile) and reads the replicas' vLLM gauges; ``p2c`` (Envoy's
least request) and ``round-robin`` get equal weights, as a mesh would. Then the router's own
added time to first token: a replica that answers at once, asked directly and through the
router in alternating rounds.

Acceptance: ``sed`` p99 TTFT at least 1.5x lower than ``p2c``'s, its p99 TPOT no worse (within
5%), and the router's added TTFT at most 1 ms at the median.

    python benchmarks/router_llm.py --duration 30   # about 9 minutes on 2 cores (docs/router.md)
    python benchmarks/router_llm.py                 # 70 s per policy; round-robin's backlog
                                                    # then drains for several minutes more
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp
import numpy as np
from rich.console import Console
from rich.table import Table

from gpuslice.adapters.http.fake_llm import EngineSpec
from gpuslice.adapters.http.sse import SseMeter
from gpuslice.adapters.proc import wait_line
from gpuslice.bench.stream import chat_body, stream_chat
from llm_lengths import DISTRIBUTIONS, LengthHistogram, fixed
from router_common import PY, Proc, processes, run_loop, start_router

POLICIES = ("round-robin", "p2c", "sed")
REPLICAS = (("whole", "7g"), ("3g", "3g"), ("1g", "1g"))
MODEL = "llama-3b"


def start_llm(name: str, slice_: str, time_scale: float, max_seqs: int,
              extra: Sequence[str] = ()) -> Proc:
    p = subprocess.Popen(
        [PY, "-m", "gpuslice.adapters.http.fake_llm", "--port", "0", "--model", MODEL,
         "--slice", slice_, "--time-scale", str(time_scale), "--max-num-seqs", str(max_seqs),
         "--uvloop", *extra], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return Proc(p, int(wait_line(p, "ready").split()[1]))


@dataclass
class LlmResult:
    offered_rps: float
    ttft: np.ndarray  # seconds from the scheduled send (NaN: no token came)
    tpot: np.ndarray  # NaN: one token or none
    status: np.ndarray
    elapsed_s: float
    warmup: int

    def window(self, a: np.ndarray) -> np.ndarray:
        ok = self.status[self.warmup:] == 200
        x = a[self.warmup:][ok]
        return x[np.isfinite(x)]

    def pct(self, what: str, q: float) -> float:
        x = self.window(self.ttft if what == "ttft" else self.tpot)
        return float(np.percentile(x, q)) if len(x) else float("nan")

    def errors(self) -> int:
        return int(np.sum(self.status[self.warmup:] != 200))


async def drive_llm(url: str, rate: float, duration_s: float, seed: int,
                    lengths: LengthHistogram, timeout_s: float = 300.0) -> LlmResult:
    rng = np.random.default_rng(seed)
    n = max(1, int(rate * duration_s))
    offsets = np.cumsum(rng.exponential(1.0 / rate, n))
    prompts, outputs = lengths.sample(n, rng)
    ttft, tpot = np.full(n, np.nan), np.full(n, np.nan)
    status = np.zeros(n, dtype=np.int64)
    clock = time.perf_counter
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                    timeout=aiohttp.ClientTimeout(total=timeout_s))
    t0 = clock() + 0.05

    async def one(i: int, sched: float) -> None:
        body = chat_body(MODEL, max(1, int(prompts[i])), int(outputs[i]))
        r = await stream_chat(session, url, body, sched, clock)
        status[i] = r.status
        ttft[i] = np.nan if r.ttft_s is None else r.ttft_s
        tpot[i] = np.nan if r.tpot_s is None else r.tpot_s

    tasks = []
    for i in range(n):
        target = t0 + float(offsets[i])
        delay = target - clock()
        if delay > 0.0005:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i, target)))
    await asyncio.gather(*tasks)
    elapsed = clock() - t0
    await session.close()
    return LlmResult(rate, ttft, tpot, status, elapsed, int(n * 0.1))


def wait_idle(ports: Sequence[int], limit_s: float = 180.0) -> None:
    """Until every replica has nothing running or waiting (the previous policy's tail)."""
    import json

    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        busy = 0
        for port in ports:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/fake/stats", timeout=5) as r:
                st = json.loads(r.read())
            busy += st["running"] + st["waiting"]
        if busy == 0:
            return
        time.sleep(0.5)


def router_config(ports: Sequence[int], specs: Sequence[EngineSpec], policy: str
                  ) -> dict[str, object]:
    reps = []
    for (name, _), port, spec in zip(REPLICAS, ports, specs, strict=True):
        rep: dict[str, object] = {"name": name, "url": f"http://127.0.0.1:{port}",
                                  "max_num_seqs": spec.max_seqs}
        if policy == "sed":  # what gpuslice's plan knows of each slice
            rep.update(prefill_tokens_per_s=spec.prefill_tps,
                       decode_tokens_per_s=1.0 / spec.step_s, kv_cache_tokens=spec.kv_tokens)
        reps.append(rep)
    return {"policy": policy, "services": [{"name": "llm", "api": "openai", "models": [MODEL],
                                            "replicas": reps}],
            "health": {"path": "/health", "interval_s": 5.0}}


async def _ttft_once(session: aiohttp.ClientSession, url: str) -> float:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "stream": True}
    start = time.perf_counter()
    meter = SseMeter(start)
    async with session.post(url, json=body) as r:
        async for chunk in r.content.iter_any():
            meter.feed(chunk, time.perf_counter())
    ttft, _, _ = meter.outcome()
    return float("nan") if ttft is None else ttft


async def added_ttft(direct: str, routed: str, rate: float, rounds: int, round_s: float
                     ) -> tuple[float, float]:
    """p50 TTFT direct and through the router, alternating rounds of Poisson requests."""
    out: dict[str, list[float]] = {"direct": [], "router": []}
    rng = np.random.default_rng(7)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for _ in range(3):  # warm both paths
            await _ttft_once(session, direct)
            await _ttft_once(session, routed)
        for r in range(rounds * 2):
            which, url = ("direct", direct) if r % 2 == 0 else ("router", routed)
            tasks = []
            end = time.perf_counter() + round_s
            while time.perf_counter() < end:
                tasks.append(asyncio.ensure_future(_ttft_once(session, url)))
                await asyncio.sleep(float(rng.exponential(1.0 / rate)))
            out[which].extend(await asyncio.gather(*tasks))
    d, t = (float(np.nanpercentile(out[k], 50)) for k in ("direct", "router"))
    return d, t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=70.0, help="seconds of load per policy")
    ap.add_argument("--load", type=float, default=0.85, help="fraction of capacity offered")
    ap.add_argument("--time-scale", type=float, default=3.0,
                    help="every engine duration x this (fewer tokens/s through this machine)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--lengths", default="azure-conv-2023",
                    help=f"{', '.join(DISTRIBUTIONS)} or fixed:PROMPT,OUTPUT")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--added-ttft-only", action="store_true",
                    help="measure only the router's added TTFT (about 30 s), with its own "
                    "acceptance line")
    args = ap.parse_args()
    console = Console(width=150)
    if args.lengths.startswith("fixed:"):
        p_, o_ = (int(x) for x in args.lengths[6:].split(","))
        lengths = fixed(p_, o_)
    else:
        lengths = DISTRIBUTIONS[args.lengths]
    mean_p, mean_o = lengths.means()
    specs = [replace_seqs(EngineSpec.for_slice(s, time_scale=args.time_scale), args.max_num_seqs)
             for _, s in REPLICAS]
    caps = [s.capacity_rps(mean_p, mean_o) for s in specs]
    rate = args.load * sum(caps)
    policies = args.policies.split(",")
    console.print(f"lengths: {lengths.source}; mean prompt {mean_p:.0f}, output {mean_o:.0f} "
                  "tokens")
    for (name, s), spec, cap in zip(REPLICAS, specs, caps, strict=True):
        console.print(f"  {name} ({s}): prefill {spec.prefill_tps:.0f} tok/s, step "
                      f"{spec.step_s * 1e3:.1f} ms, KV {spec.kv_tokens} tokens, "
                      f"{spec.max_seqs} seqs: {cap:.2f} req/s")
    console.print(f"offered {rate:.2f} req/s ({args.load:.0%} of {sum(caps):.2f}), "
                  f"{args.duration:g} s per policy, first 10% not counted; time x "
                  f"{args.time_scale:g}")
    results: dict[str, LlmResult] = {}
    if args.added_ttft_only:
        with processes() as procs:
            direct, routed = overhead(procs, console)
        added_ms = (routed - direct) * 1e3
        print(f"acceptance: {'PASS' if added_ms <= 1.0 else 'FAIL'} (added TTFT p50 "
              f"{added_ms:.3f} ms <= 1 ms; direct {direct * 1e3:.3f} ms, through the router "
              f"{routed * 1e3:.3f} ms)")
        return 0 if added_ms <= 1.0 else 1
    with processes() as procs:
        reps = [start_llm(n, s, args.time_scale, args.max_num_seqs) for n, s in REPLICAS]
        procs.extend(reps)
        ports = [r.port for r in reps]
        for policy in policies:
            wait_idle(ports)
            router = start_router(router_config(ports, specs, policy), extra=["--no-admission"])
            try:
                console.print(f"[dim]{policy} ...[/]")
                results[policy] = run_loop(drive_llm(
                    f"http://127.0.0.1:{router.port}/v1/chat/completions", rate, args.duration,
                    args.seed, lengths))
            finally:
                router.stop()
        print_table(console, results)
        direct, routed = overhead(procs, console)
    return acceptance(console, results, direct, routed)


def replace_seqs(spec: EngineSpec, seqs: int) -> EngineSpec:
    from dataclasses import replace

    return replace(spec, max_seqs=seqs)


def overhead(procs: list[Proc], console: Console) -> tuple[float, float]:
    fast = start_llm("instant", "7g", 1.0, 256, ["--prefill-tps", "1e9", "--step-ms", "0.2"])
    procs.append(fast)
    cfg = {"policy": "sed", "services": [{"name": "llm", "api": "openai", "models": [MODEL],
                                          "replicas": [{"name": "instant", "url":
                                                        f"http://127.0.0.1:{fast.port}"}]}],
           "health": {"path": "/health", "interval_s": 5.0}}
    router = start_router(cfg, extra=["--no-admission"])
    try:
        console.print("[dim]added TTFT ...[/]")
        return run_loop(added_ttft(f"http://127.0.0.1:{fast.port}/v1/chat/completions",
                                   f"http://127.0.0.1:{router.port}/v1/chat/completions",
                                   100.0, 3, 3.0))
    finally:
        router.stop()


def print_table(console: Console, results: dict[str, LlmResult]) -> None:
    table = Table(title="streamed chat completions: TTFT from the scheduled send, TPOT after")
    for col in ("policy", "offered/s", "p50 TTFT", "p99 TTFT", "p50 TPOT", "p99 TPOT",
                "errors", "p99 TTFT / sed"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    sed = results.get("sed")
    for policy, r in results.items():
        ratio = r.pct("ttft", 99) / sed.pct("ttft", 99) if sed is not None else float("nan")
        table.add_row(policy, f"{r.offered_rps:.2f}", f"{r.pct('ttft', 50) * 1e3:,.0f} ms",
                      f"{r.pct('ttft', 99) * 1e3:,.0f} ms",
                      f"{r.pct('tpot', 50) * 1e3:.1f} ms", f"{r.pct('tpot', 99) * 1e3:.1f} ms",
                      str(r.errors()), f"{ratio:.2f}x")
    console.print(table)


def acceptance(console: Console, results: dict[str, LlmResult], direct: float,
               routed: float) -> int:
    added_ms = (routed - direct) * 1e3
    console.print(f"added TTFT p50: {added_ms:.3f} ms (direct {direct * 1e3:.3f} ms, through "
                  f"the router {routed * 1e3:.3f} ms)")
    sed, base = results.get("sed"), results.get("p2c")
    if sed is None or base is None:
        print(f"acceptance: FAIL (needs sed and p2c; added TTFT p50 {added_ms:.3f} ms)")
        return 1
    ttft_ratio = base.pct("ttft", 99) / sed.pct("ttft", 99)
    tpot_ratio = sed.pct("tpot", 99) / base.pct("tpot", 99)
    ok = ttft_ratio >= 1.5 and tpot_ratio <= 1.05 and added_ms <= 1.0
    with contextlib.suppress(Exception):
        console.print(f"p99 TTFT p2c / sed = {base.pct('ttft', 99) * 1e3:,.0f} / "
                      f"{sed.pct('ttft', 99) * 1e3:,.0f} ms = {ttft_ratio:.2f}x (need >= 1.5x); "
                      f"p99 TPOT sed / p2c = {sed.pct('tpot', 99) * 1e3:.1f} / "
                      f"{base.pct('tpot', 99) * 1e3:.1f} ms = {tpot_ratio:.2f}x (need <= 1.05x)")
    print(f"acceptance: {'PASS' if ok else 'FAIL'} (p99 TTFT p2c/sed {ttft_ratio:.2f}x >= 1.5x; "
          f"p99 TPOT sed/p2c {tpot_ratio:.2f}x <= 1.05x; added TTFT p50 {added_ms:.3f} ms "
          "<= 1 ms)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
