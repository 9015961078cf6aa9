"""What the demo cluster's containers run on: the event log the demo shows, the two runtimes of
a simulated replica (a child process, or an asyncio server in this process), the engine of a
generative (LLM) replica sized from its slice, and the demo's work directory."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from gpuslice.adapters.http.fake_llm import SLICES, EngineSpec
from gpuslice.adapters.proc import alive, read_ready, spawn, terminate
from gpuslice.core.errors import ValidationError


@dataclass
class Event:
    t: float  # seconds since the demo started
    kind: str
    text: str


class EventLog:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self.events: list[Event] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def add(self, kind: str, text: str) -> None:
        with self._lock:
            self.events.append(Event(round(self.now(), 2), kind, text))

    def tail(self, n: int) -> list[Event]:
        with self._lock:
            return self.events[-n:]

    def since(self, i: int) -> list[Event]:
        """The events from the ``i``-th on (a copy taken under the lock)."""
        with self._lock:
            return self.events[i:]


@dataclass(frozen=True)
class LlmEngine:
    """What a generative replica runs: ``fake_llm``'s engine on the A100-80GB MIG slice whose
    compute its share of the GPU is (``fake_llm`` models that GPU's slices; the demo's
    generative profile is of it too), with ``max_seqs`` sequences at most."""

    model: str
    slice: str  # fake_llm's --slice: 1g, 2g, 3g, 4g or 7g
    spec: EngineSpec

    @property
    def step_ms(self) -> float:
        """A decode step with every sequence slot taken (the TPOT without prefill)."""
        return 1000 * (self.spec.step_s + self.spec.step_per_seq_s * self.spec.max_seqs)

    def argv(self) -> list[str]:
        return ["--model", self.model, "--slice", self.slice,
                "--max-num-seqs", str(self.spec.max_seqs)]

    def router_fields(self) -> dict[str, float | int]:
        """The replica's token speeds as the router takes them (the plan export's fields:
        prefill tokens/s, decode tokens/s of one sequence at a full batch, its sequences) and
        its KV cache."""
        return {"prefill_tokens_per_s": round(self.spec.prefill_tps, 1),
                "decode_tokens_per_s": round(1000 / self.step_ms, 3),
                "max_num_seqs": self.spec.max_seqs, "kv_cache_tokens": self.spec.kv_tokens}


def llm_engine(model: str, share: float, max_seqs: int) -> LlmEngine:
    """The engine of a generative replica holding ``share`` of a GPU's compute: the largest
    slice of ``fake_llm`` with at most that many sevenths (at least the 1g)."""
    if not model:
        raise ValidationError("model", "a model name", model)
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
        raise ValidationError("share", "a part of the GPU in (0, 1]", share)
    if isinstance(max_seqs, bool) or not isinstance(max_seqs, int) or max_seqs < 1:
        raise ValidationError("max_seqs", "a whole number of sequences >= 1", max_seqs)
    sevenths = max(1, round(share * 7))
    name = max((k for k, (compute, _, _) in SLICES.items() if compute <= sevenths),
               key=lambda k: SLICES[k][0])
    return LlmEngine(model, name, replace(EngineSpec.for_slice(name), max_seqs=max_seqs))


@dataclass
class Container:
    pod: str  # namespace/name
    service: str
    model: str
    gpu_model: str
    milli: int
    batch: int  # a generative replica's: its sequences at most (vLLM's --max-num-seqs)
    service_ms: float  # per batch; a generative replica's: a decode step of a full batch
    envs: dict[str, str]
    proc: subprocess.Popen[str] | None = None  # with the process runtime
    handle: Any = None  # with the in-process runtime
    port: int = 0
    restarts: int = 0
    started_at: float = 0.0
    gpus: tuple[str, ...] = ()
    llm: LlmEngine | None = None  # a generative replica (fake_llm), else a fake_replica


class Runtime(Protocol):
    """How the simulated kubelet runs a container (a simulated replica)."""

    def start(self, c: Container, run_id: str) -> int: ...  # the port it serves on
    def alive(self, c: Container) -> bool: ...
    def stop(self, c: Container) -> None: ...
    def kill(self, c: Container) -> int | None: ...


class ProcessRuntime:
    """One ``fake_replica`` process per container, ``fake_llm`` for a generative one (dies
    with the demo)."""

    def start(self, c: Container, run_id: str) -> int:
        name = c.pod.split("/", 1)[1]
        argv = ["gpuslice.adapters.http.fake_llm", "--port", "0", *c.llm.argv()] \
            if c.llm is not None else \
            ["gpuslice.adapters.http.fake_replica", "--port", "0", "--name", name,
             "--service-ms", f"{c.service_ms:.3f}", "--dist", "det", "--concurrency",
             str(c.batch), "--seed", str(zlib.crc32(c.pod.encode()) % 1000 + c.restarts)]
        c.proc = spawn([sys.executable, "-m", *argv], run_id, env=c.envs,
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        return read_ready(c.proc)

    def alive(self, c: Container) -> bool:
        return c.proc is not None and c.proc.poll() is None

    def stop(self, c: Container) -> None:
        terminate(c.proc)

    def kill(self, c: Container) -> int | None:
        if c.proc is None:
            return None
        c.proc.kill()
        return c.proc.pid


class InProcessRuntime:
    """Every container's replica as an HTTP server in one asyncio loop on a background thread:
    hundreds of replicas at the cost of one process (tests of reconfiguration)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="replicas")
        self._thread.start()

    def start(self, c: Container, run_id: str) -> int:
        from aiohttp import web

        from gpuslice.adapters.http.fake_llm import FakeLlm
        from gpuslice.adapters.http.fake_replica import FakeReplica

        llm = None if c.llm is None else FakeLlm(c.llm.model, c.llm.spec)
        handler = llm.handle if llm is not None else FakeReplica(
            c.pod.split("/", 1)[1], c.service_ms, "det", c.batch,
            zlib.crc32(c.pod.encode()) % 1000).handle

        async def up() -> tuple[Any, int]:
            if llm is not None:
                llm.engine.task = asyncio.create_task(llm.engine.run())
            runner = web.ServerRunner(web.Server(handler, access_log=None))
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            return runner, int(runner.addresses[0][1])

        runner, port = asyncio.run_coroutine_threadsafe(up(), self.loop).result(10)
        c.handle = (runner, llm)
        return port

    def alive(self, c: Container) -> bool:
        return c.handle is not None

    def stop(self, c: Container) -> None:
        if c.handle is not None:
            (runner, llm), c.handle = c.handle, None

            async def down() -> None:
                await runner.cleanup()
                if llm is not None and llm.engine.task is not None:
                    llm.engine.task.cancel()

            asyncio.run_coroutine_threadsafe(down(), self.loop).result(10)

    def kill(self, c: Container) -> int | None:
        self.stop(c)
        return None

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


# ---- the demo's work directory -------------------------------------------------------------


@contextlib.contextmanager
def workdir(chosen: Path | None) -> Iterator[Path]:
    """``chosen`` (made if missing, kept afterwards), else a new directory under the temp root
    that goes when the demo ends, or, if the demo is killed, at the next demo's start."""
    if chosen is not None:
        chosen.mkdir(parents=True, exist_ok=True)
        yield chosen
        return
    # unix socket paths must stay short: a directory right under the temp root
    sweep_stale_workdirs()
    d = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX))
    (d / OWNER_FILE).write_text(str(os.getpid()))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


WORKDIR_PREFIX = "gsd-"
OWNER_FILE = "owner.pid"


def sweep_stale_workdirs(root: Path | None = None) -> list[Path]:
    """Remove the work directories of demos that were killed (SIGKILL, a crash: no ``finally``
    ran): each names its process in ``owner.pid``; a directory whose process is gone goes.
    Returns those removed."""
    removed = []
    for d in (root or Path(tempfile.gettempdir())).glob(f"{WORKDIR_PREFIX}*"):
        try:
            pid = int((d / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # not one of ours, or still being set up
        if pid == os.getpid() or alive(pid):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed
