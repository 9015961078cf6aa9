"""Fluent builders for tests, in the style of kube-scheduler's ``MakePod().Req(...)``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from gpuslice.core.catalog import lookup
from gpuslice.core.model import Gpu, Isolation, Node, SliceRequest


@dataclass
class MakeNode:
    name: str
    _cpu: int = 32_000
    _mem: int = 128 * 1024
    _model: str | None = None
    _free: list[int] = field(default_factory=list)
    _cpu_free: int | None = None
    _mem_free: int | None = None
    _gpu_mem_used: list[int] = field(default_factory=list)

    def gpus(self, model: str, count: int) -> MakeNode:
        self._model = model
        self._free = [1000] * count
        return self

    def used(self, *milli_used: int) -> MakeNode:
        """Milli already used on GPU 0, 1, ... (the rest stay free)."""
        for i, u in enumerate(milli_used):
            self._free[i] = 1000 - u
        return self

    def gpu_mem_used(self, *mib_used: int) -> MakeNode:
        """MiB of GPU memory already used on GPU 0, 1, ..."""
        self._gpu_mem_used = list(mib_used)
        return self

    def cpu(self, milli: int, free: int | None = None) -> MakeNode:
        self._cpu, self._cpu_free = milli, free
        return self

    def mem(self, mib: int, free: int | None = None) -> MakeNode:
        self._mem, self._mem_free = mib, free
        return self

    def obj(self) -> Node:
        gpus: tuple[Gpu, ...] = ()
        if self._model is not None:
            known = lookup(self._model)
            mib = known.memory_mib if known else 0
            used = self._gpu_mem_used + [0] * (len(self._free) - len(self._gpu_mem_used))
            gpus = tuple(Gpu(i, self._model, mib, milli_free=f, memory_free_mib=mib - u)
                         for i, (f, u) in enumerate(zip(self._free, used, strict=True)))
        return Node(self.name, self._cpu, self._mem, gpus, self._cpu_free, self._mem_free)


@dataclass(frozen=True)
class MakeReq:
    req: SliceRequest = field(default_factory=SliceRequest)

    def gpu(self, count: int, milli: int = 1000) -> MakeReq:
        return MakeReq(replace(self.req, gpus=count, milli=milli))

    def share(self, milli: int) -> MakeReq:
        return self.gpu(1, milli)

    def cpu(self, milli: int) -> MakeReq:
        return MakeReq(replace(self.req, cpu_milli=milli))

    def mem(self, mib: int) -> MakeReq:
        return MakeReq(replace(self.req, memory_mib=mib))

    def gpu_mem(self, mib: int) -> MakeReq:
        return MakeReq(replace(self.req, gpu_memory_mib=mib))

    def memory_share(self) -> MakeReq:
        """No GPU memory named: milli/1000 of each GPU's memory (the pod contract's default)."""
        return MakeReq(replace(self.req, memory_share=True))

    def models(self, *names: str) -> MakeReq:
        return MakeReq(replace(self.req, models=frozenset(names)))

    def isolation(self, iso: Isolation) -> MakeReq:
        return MakeReq(replace(self.req, isolation=iso))

    def obj(self) -> SliceRequest:
        return self.req
