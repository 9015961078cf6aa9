"""The demo's scripted scenario: plan, deploy, serve, crash a replica, add a node, report."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from gpuslice.adapters.kube.annotation import decode
from gpuslice.adapters.nvml.port import NvmlPort
from gpuslice.adapters.proc import spawn
from gpuslice.core.assignment import ANNOTATION
from gpuslice.core.errors import GpusliceError
from gpuslice.core.planner import FleetType, Plan, PlanOptions, Service, slice_share
from gpuslice.core.replay import plan_and_check
from gpuslice.core.speedmodel import MODELS, profiles
from gpuslice.demo.cluster import (
    Cluster,
    NodeSpec,
    gpu_pod,
    router_config_from_pods,
)
from gpuslice.demo.generative import (
    GENERATIVE,
    GenerativeDemoPlan,
    generative_pods,
    left_over,
    plan_generative,
    plan_slices,
    router_services,
)
from gpuslice.demo.load import Sample, chat_load, chat_stats, load, stats
from gpuslice.demo.runtime import EventLog, workdir

SERVICES = (
    Service("resnet50", "resnet50", 200.0, 100.0),
    Service("bert", "bert-base", 60.0, 200.0),
    Service("mobilenet", "mobilenet-v3", 150.0, 50.0),
)
NODES = (
    NodeSpec("t4-0", ("T4",) * 4),
    NodeSpec("v100-0", ("V100M16",) * 4),
    NodeSpec("a100-0", ("A100-80GB",) * 2),
    NodeSpec("h100-0", ("H100-SXM",) * 2, mig=",".join(f"1g.10gb@{i}" for i in range(7))),
)
LATE_NODE = NodeSpec("h100-1", ("H100-SXM",) * 2)
COST_PER_HOUR = {"A100-80GB": 1.0, "H100-SXM": 2.0}


@dataclass(frozen=True)
class DemoOptions:
    out: Path = Path("demo-report")
    short: bool = False
    seed: int = 1
    live: bool | None = None  # None: a live display when the output is a terminal
    workdir: Path | None = None
    local_gpus: bool = True  # add this machine's NVIDIA GPUs (real NVML and MPS) as a node
    mps_binary: str = "nvidia-cuda-mps-control"

    def seconds(self, full: float) -> float:
        return max(3.0, full / 5) if self.short else full


@dataclass
class Phase:
    name: str
    start: float
    end: float = math.nan


@dataclass
class DemoState:
    opts: DemoOptions
    cluster: Cluster
    samples: list[Sample] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    plan: Plan | None = None
    plan_seconds: float = 0.0
    gen: GenerativeDemoPlan | None = None  # the generative services' plan
    router: subprocess.Popen[str] | None = None
    router_port: int = 0
    router_admin: int = 0
    router_config: str = ""
    killed: str = ""
    reconfig: dict[str, Any] = field(default_factory=dict)

    @property
    def log(self) -> EventLog:
        return self.cluster.log

    def phase(self, name: str) -> None:
        now = self.log.now()
        if self.phases:
            self.phases[-1].end = now
        self.phases.append(Phase(name, now))
        self.log.add("phase", name)


# ---- planning and deploying -------------------------------------------------------------------


def local_nvml(log: EventLog) -> NvmlPort | None:
    """This machine's GPUs through NVML, or None (said in the log) when it has none."""
    from gpuslice.adapters.nvml.port import NullNvml
    from gpuslice.adapters.nvml.real import load

    nv = load()
    if isinstance(nv, NullNvml) or not nv.devices():
        log.add("node", f"no local NVIDIA GPU ({nv.why_empty()}): every GPU is simulated")
        return None
    return nv


def demo_fleet() -> list[FleetType]:
    counts = Counter(m for n in NODES for m in n.gpus if m in COST_PER_HOUR)
    return [FleetType(g, c, COST_PER_HOUR[g]) for g, c in sorted(counts.items())]


def plan_services(state: DemoState) -> Plan:
    fleet = demo_fleet()
    counts = {f.gpu: f.count for f in fleet}
    ps = profiles(sorted(counts), sorted({s.model for s in SERVICES}))
    start = time.perf_counter()
    checked = plan_and_check(ps, list(SERVICES), fleet, PlanOptions(objective="cost"),
                             rng=np.random.default_rng(state.opts.seed))
    state.plan_seconds = time.perf_counter() - start
    p = checked.plan
    for g in p.gpus:
        parts = ", ".join(f"{c.service} {s.placement.profile.name} batch {c.batch} "
                          f"({c.throughput:.0f} req/s)" for s in g.slots for c in s.parts)
        state.log.add("plan", f"GPU {g.index} {g.gpu}: {parts}")
    state.log.add("plan", f"{p.n_gpus} GPU(s), cost {p.cost:.1f}/h, planned in "
                  f"{state.plan_seconds:.2f} s (replay-checked against the SLOs)")
    return p


def plan_pods(p: Plan) -> list[dict[str, Any]]:
    """The planner's slices as pods: MPS slices with the compute share of their MIG slice."""
    pods = []
    n: Counter[str] = Counter()
    svc = {s.name: s for s in SERVICES}
    for g in p.gpus:
        for s in g.slots:
            for c in s.parts:
                milli, mem = slice_share(s, c)
                name = f"{c.service}-{n[c.service]}"
                n[c.service] += 1
                pods.append(gpu_pod(
                    name, service=c.service, model=svc[c.service].model, milli=milli,
                    memory_mib=mem, gpu_models=g.gpu, batch=c.batch,
                    extra={"demo.gpuslice.io/planned-rps": f"{c.throughput:.1f}",
                           "gpuslice.io/slo-p99-ms": f"{svc[c.service].slo_ms:g}"}))
    return pods


def batch_pods(count: int, prefix: str = "embed") -> list[dict[str, Any]]:
    """Best-effort batch pods: half a T4 or V100 each, no SLO."""
    return [gpu_pod(f"{prefix}-{i}", service="embed-batch", model="embedder", milli=500,
                    memory_mib=4096, gpu_models="T4|V100M16", batch=4) for i in range(count)]


async def wait_running(state: DemoState, names: list[str], timeout_s: float) -> list[str]:
    """Wait until every pod in ``names`` has a running container; returns those that do not."""
    end = time.monotonic() + timeout_s
    missing = list(names)
    while time.monotonic() < end:
        missing = [k for k in names if state.cluster.container_of(k) is None
                   or not _has_endpoint(state, k)]
        if not missing:
            return []
        await asyncio.sleep(0.2)
    return missing


def _has_endpoint(state: DemoState, key: str) -> bool:
    ns, name = key.split("/", 1)
    try:
        p = state.cluster.api.get_pod(ns, name)
    except GpusliceError:
        return False
    return bool((p.get("status") or {}).get("endpoint"))


# ---- the router ---------------------------------------------------------------------------


def router_config(state: DemoState) -> dict[str, Any]:
    return router_config_from_pods(state.cluster, [
        {"name": s.name, "slo_ms": s.slo_ms, "models": [s.name, s.model]} for s in SERVICES]
        + ([] if state.gen is None else router_services(state.gen)))


def write_router_config(state: DemoState, path: Path) -> bool:
    """Write the config when it changed; True when it did."""
    doc = router_config(state)
    text = json.dumps(doc, sort_keys=True, indent=1)
    if text == state.router_config or any(not s["replicas"] for s in doc["services"]):
        return False
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    state.router_config = text
    return True


async def start_router(state: DemoState) -> None:
    path = state.cluster.root / "router.json"
    if not write_router_config(state, path):
        raise GpusliceError("no replica of some service is running; cannot start the router")
    p = spawn([sys.executable, "-m", "gpuslice.cli", "router", "--config", str(path),
               "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--access-log", "off",
               "--log-format", "json"],
              state.cluster.run_id, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    state.router = p
    assert p.stderr is not None
    loop = asyncio.get_running_loop()
    line = await asyncio.wait_for(loop.run_in_executor(None, p.stderr.readline), 30)
    try:
        info = json.loads(line)
    except ValueError:
        raise GpusliceError(f"the router did not start: {line.strip()}") from None
    state.router_port, state.router_admin = int(info["port"]), int(info["admin_port"])
    state.log.add("router", f"listening on 127.0.0.1:{state.router_port} "
                  f"(shortest expected delay, SLO admission)")


async def follow_replicas(state: DemoState) -> None:
    """Keep the router's replica set equal to the running pods (hot reload on SIGHUP)."""
    path = state.cluster.root / "router.json"
    while True:
        await asyncio.sleep(0.3)
        if state.router is not None and write_router_config(state, path):
            state.router.send_signal(signal.SIGHUP)
            state.log.add("router", "replica set changed: reloaded without dropping "
                          "connections")


# ---- the display ------------------------------------------------------------------------------


class Display:
    """A rich live view on a terminal; plain lines of events otherwise."""

    def __init__(self, state: DemoState, live: bool) -> None:
        from rich.console import Console

        self.state = state
        self.console = Console()
        self.live_on = live
        self._printed = 0
        self._live: Any = None

    def render(self) -> Any:
        from rich.console import Group
        from rich.table import Table

        st = self.state
        now = st.log.now()
        phase = st.phases[-1].name if st.phases else "starting"
        t = Table(title=f"gpuslice demo: {phase}  ({now:5.1f} s)", expand=True)
        for col in ("service", "rate", "SLO p99", "sent", "ok", "429", "failed",
                    "p99 last 5 s"):
            t.add_column(col, justify="right" if col != "service" else "left")
        for svc in SERVICES:
            mine = [s for s in st.samples if s.service == svc.name]
            recent = [s.latency_s * 1000 for s in mine if s.status == 200 and s.t > now - 5]
            t.add_row(svc.name, f"{svc.rate:g}/s", f"{svc.slo_ms:g} ms", *_counted(mine),
                      _p99(recent))
        for g in GENERATIVE:  # a generative service: time to first token, per output token
            mine = [s for s in st.samples if s.service == g.name]
            last = [s for s in mine if s.status == 200 and s.t > now - 5]
            ttft = _p99([s.ttft_s * 1000 for s in last if s.ttft_s is not None])
            tpot = _p99([s.tpot_s * 1000 for s in last if s.tpot_s is not None])
            t.add_row(g.name, f"{g.rate:g}/s", f"TTFT {g.slo_ttft_ms:g} ms, TPOT "
                      f"{g.slo_tpot_ms:g} ms", *_counted(mine), f"TTFT {ttft}, TPOT {tpot}")
        from rich.text import Text

        ev = Table.grid(padding=(0, 1))
        for e in st.log.tail(10):  # an event's text as written: "gpuslice[gpu]" is no markup
            ev.add_row(f"{e.t:6.1f}", Text(e.kind, style="bold"), Text(e.text))
        return Group(t, ev)

    def __enter__(self) -> Display:
        if self.live_on:
            from rich.live import Live

            self._live = Live(self.render(), console=self.console, refresh_per_second=4,
                              transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self.render())
            self._live.__exit__(None, None, None)
        else:
            self.tick()

    def tick(self) -> None:
        if self._live is not None:
            self._live.update(self.render())
            return
        # other threads append while this prints: count what was taken, not the list's length
        # afterwards (an event added in between would never be printed)
        new = self.state.log.since(self._printed)
        for e in new:
            self.console.print(f"{e.t:6.1f}s  {e.kind:9s} {e.text}", highlight=False,
                               soft_wrap=True, markup=False)
        self._printed += len(new)


def _counted(samples: list[Sample]) -> tuple[str, str, str, str]:
    """sent, answered, rejected (429) and failed, as the live table shows them."""
    return (str(len(samples)), str(sum(s.status == 200 for s in samples)),
            str(sum(s.status == 429 for s in samples)),
            str(sum(s.status not in (200, 429) for s in samples)))


def _p99(ms: list[float]) -> str:
    return f"{np.percentile(ms, 99):.1f} ms" if ms else "-"


async def refresh(display: Display) -> None:
    while True:
        display.tick()
        await asyncio.sleep(0.25)


# ---- the scenario -----------------------------------------------------------------------------


async def scenario(state: DemoState, display: Display) -> None:
    o = state.opts
    c = state.cluster
    state.phase("bring-up: node agents, device plugins, extender")
    c.log.add("run", f"run {c.run_id} in {c.root}")
    loop = asyncio.get_running_loop()
    for spec in NODES:
        await loop.run_in_executor(None, c.add_node, spec)
    if o.local_gpus:
        real = local_nvml(c.log)
        if real is not None:
            spec = NodeSpec("local", tuple(g.model for g in real.devices()))
            await loop.run_in_executor(None, c.add_node, spec, real, o.mps_binary)
    c.start_extender()
    state.phase("plan: services and SLOs -> slices")
    state.plan = plan_services(state)
    state.gen = plan_generative(left_over(demo_fleet(), state.plan), o.seed, c.log,
                                first_gpu=state.plan.n_gpus)
    state.phase("deploy: scheduler -> extender -> device plugin -> replicas")
    pods = plan_pods(state.plan) + generative_pods(state.gen) + batch_pods(4)
    for p in pods:
        c.api.add_pod(p)
    keys = [f"demo/{p['metadata']['name']}" for p in pods]
    missing = await wait_running(state, keys, 90)
    if missing:
        raise GpusliceError(f"pods not running after 90 s: {missing}; see the events above")
    await start_router(state)
    follow = asyncio.create_task(follow_replicas(state))
    stop = asyncio.Event()
    rng = np.random.default_rng(o.seed)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=30)) as session:
        loads = [asyncio.create_task(load(state, session, s, stop, rng)) for s in SERVICES]
        chat_rng = np.random.default_rng([o.seed, 1])
        loads += [asyncio.create_task(chat_load(state, session, s, stop, chat_rng))
                  for s in GENERATIVE]
        try:
            state.phase("serve: open-loop Poisson load at the planned rates")
            await asyncio.sleep(o.seconds(25))
            state.phase("crash: a replica is killed (SIGKILL) under load")
            victim = max((k for k in keys if k.startswith("demo/resnet50")),
                         key=lambda k: _container_rps(state, k))
            found = c.container_of(victim)
            if found is not None:
                pid = found[0].kubelet.kill(victim)
                state.killed = victim
                c.log.add("crash", f"killed {victim} (pid {pid}); the router's health check "
                          "takes it out, idempotent requests are retried elsewhere, the "
                          "kubelet restarts it")
            await asyncio.sleep(o.seconds(20))
            state.phase("reconfigure: an H100 goes from 7 x 1g to 1 x 7g under load")
            await reconfigure(state)
            await asyncio.sleep(o.seconds(5))
            state.phase("scale-out: a 2-GPU job arrives, then a node is added")
            trainer = gpu_pod("trainer", service="train", model="embedder", gpus=2,
                              milli=1000, gpu_models="H100-SXM", batch=8)
            c.api.add_pod(trainer)
            await asyncio.sleep(min(4.0, o.seconds(6)))
            await asyncio.get_running_loop().run_in_executor(None, c.add_node, LATE_NODE)
            if await wait_running(state, ["demo/trainer"], 30):
                c.log.add("error", "the 2-GPU job did not start on the new node")
            await asyncio.sleep(o.seconds(10))
        finally:
            stop.set()
            await asyncio.gather(*loads, return_exceptions=True)
            follow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follow
    state.phase("done")


async def reconfigure(state: DemoState) -> None:
    """Switch node h100-0's GPUs to one 7g instance each with a SliceSchedule, through the
    reconfiguration controller: the replicas on a GPU move to the other one first."""
    from gpuslice.adapters.http.router_admin import HttpRouter
    from gpuslice.services.reconfig import PLURAL, ReconfigController

    c = state.cluster
    c.api.replace_custom(PLURAL, {
        "apiVersion": "gpuslice.io/v1alpha1", "kind": "SliceSchedule",
        "metadata": {"name": "h100-batch", "namespace": "gpuslice-system"},
        "spec": {"selector": {"nodes": ["h100-0"]},
                 "layouts": {"inference": {"mig": {"mig-devices": {"1g.10gb": 7}}},
                             "batch": {"mig": {"mig-devices": {"7g.80gb": 1}}}},
                 "default": "inference", "override": "batch", "drainTimeoutSeconds": 10}})
    ctl = ReconfigController(c.api, router=HttpRouter(f"http://127.0.0.1:{state.router_admin}"))
    loop = asyncio.get_running_loop()
    seen = 0
    end = time.monotonic() + 90
    while time.monotonic() < end:
        await loop.run_in_executor(None, ctl.step)
        for line in ctl.log[seen:]:
            c.log.add("reconfig", line.split(": ", 1)[-1])
        seen = len(ctl.log)
        st = c.api.get_custom(PLURAL, "gpuslice-system", "h100-batch").get("status") or {}
        if (st.get("summary") or {}).get("inTarget") == 2:
            secs = [g.get("seconds") for g in (st.get("gpus") or {}).values()]
            took = ", ".join(f"{x:.1f} s" if isinstance(x, (int, float)) else "?"
                             for x in secs)
            c.log.add("reconfig", f"both GPUs of h100-0 now 1 x 7g ({st.get('moves', 0)} "
                      f"replica(s) moved; {took} per GPU)")
            state.reconfig = {"moves": st.get("moves", 0), "seconds_per_gpu": secs}
            return
        await asyncio.sleep(0.3)
    c.log.add("error", "the reconfiguration did not finish in 90 s")


def _container_rps(state: DemoState, key: str) -> float:
    found = state.cluster.container_of(key)
    return 0.0 if found is None else found[1].batch / found[1].service_ms


def summary(state: DemoState) -> dict[str, Any]:
    c = state.cluster
    placements: list[dict[str, Any]] = []
    gpus_used: set[str] = set()
    exclusive = 0
    for p in c.api.list_pods():
        meta = p["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        text = (meta.get("annotations") or {}).get(ANNOTATION)
        if not text:
            placements.append({"pod": key, "node": None,
                               "why_pending": c.scheduler.pending.get(key) if c.scheduler
                               else None})
            continue
        a = decode(text)
        shares = a.containers[0].gpus
        gpus_used.update(s.uuid for s in shares)
        exclusive += len(shares)
        found = c.container_of(key)
        placements.append({
            "pod": key, "node": a.node, "gpus": [s.uuid for s in shares],
            "gpu_model": found[1].gpu_model if found else None,
            "milli": shares[0].milli, "memory_mib": shares[0].memory_mib,
            "mode": a.containers[0].mode.value,
            # the MIG instance an MPS slice (or a MIG-isolated pod) lives in
            "mig_instance": f"{shares[0].mig_profile}@{shares[0].mig_start}"
            if shares[0].mig_profile else None,
            "score": c.scheduler.placed.get(key, (None, None))[1] if c.scheduler else None,
            "service_ms": round(found[1].service_ms, 2) if found else None,
            "batch": found[1].batch if found else None,
            "restarts": found[1].restarts if found else None,
        })
    by_phase = []
    for ph in state.phases:
        if ph.name == "done" or math.isnan(ph.end):
            continue
        mine = [s for s in state.samples if ph.start <= s.t < ph.end]
        if not mine:
            continue
        by_phase.append({"phase": ph.name, "services": _latency(mine)})
    return {
        "plan": _plan_summary(state),
        "placements": sorted(placements, key=lambda x: x["pod"]),
        "gpus_used": len(gpus_used),
        "gpus_exclusive": exclusive,
        "latency_by_phase": by_phase,
        "latency_total": _latency(state.samples),
        "killed": state.killed,
        "reconfig": state.reconfig,
        "events": [e.__dict__ for e in c.log.events],
        "phases": [{"name": ph.name, "start": round(ph.start, 2),
                    "end": None if math.isnan(ph.end) else round(ph.end, 2)}
                   for ph in state.phases],
    }


def _latency(samples: list[Sample]) -> dict[str, dict[str, Any]]:
    """Each service's figures over ``samples``: latency against its p99 SLO, a generative
    one's time to the first token and per output token against its TTFT and TPOT SLOs."""
    out = {svc.name: stats([s for s in samples if s.service == svc.name], svc.slo_ms)
           for svc in SERVICES}
    out.update({g.name: chat_stats([s for s in samples if s.service == g.name], g)
                for g in GENERATIVE})
    return out


def _plan_summary(state: DemoState) -> dict[str, Any] | None:
    """Both plans, the generative services' GPUs numbered after the others'."""
    pl, gen = state.plan, state.gen
    if pl is None:
        return None
    slices = [{"gpu": g.index, "model": g.gpu, "profile": s.placement.profile.name,
               "service": cc.service, "batch": cc.batch,
               "throughput_rps": round(cc.throughput, 1)}
              for g in pl.gpus for s in g.slots for cc in s.parts]
    if gen is None:
        return {"gpus": pl.n_gpus, "cost_per_hour": pl.cost,
                "seconds": round(state.plan_seconds, 3), "slices": slices}
    return {"gpus": pl.n_gpus + gen.plan.n_gpus, "cost_per_hour": pl.cost + gen.plan.cost,
            "seconds": round(state.plan_seconds + gen.seconds, 3),
            "slices": slices + plan_slices(gen)}


def run_demo(opts: DemoOptions) -> dict[str, Any]:
    """Run the scenario; returns the summary (also written, with the HTML report, to
    ``opts.out``). Everything started is stopped on return, error or Ctrl-C."""
    from gpuslice.demo.report import write_report

    with workdir(opts.workdir) as root:
        cluster = Cluster(root, uuid.uuid4().hex[:12], uuid.uuid4().bytes + b"demo-key", EventLog())
        state = DemoState(opts, cluster)
        live = sys.stdout.isatty() if opts.live is None else opts.live
        display = Display(state, live)
        try:
            with display:
                asyncio.run(_main(state, display))
        finally:
            if state.router is not None and state.router.poll() is None:
                state.router.terminate()
                try:
                    state.router.wait(5)
                except subprocess.TimeoutExpired:
                    state.router.kill()
            cluster.stop()
        result = summary(state)
    files = write_report(opts.out, result, state.samples, SERVICES, GENERATIVE)
    result["files"] = [str(f) for f in files]
    return result


async def _main(state: DemoState, display: Display) -> None:
    ticker = asyncio.create_task(refresh(display))
    try:
        await scenario(state, display)
    finally:
        ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticker


__all__ = ["MODELS", "DemoOptions", "Sample", "run_demo"]
