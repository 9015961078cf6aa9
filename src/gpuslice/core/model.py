"""The core data model: GPUs, nodes, cluster snapshots, slice requests and decisions.

Everything here is immutable. A :class:`ClusterSnapshot` also carries its state as numpy arrays
(:class:`ClusterArrays`), which is what the placement policies score, vectorised over nodes and
GPUs. The simulator keeps its own mutable copy of those arrays and applies decisions to it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from gpuslice.core.errors import ValidationError

MILLI = 1000
"""A whole GPU in milli-GPU."""

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.float64]


# A slice's priority among its GPU's MPS clients: best-effort work runs at below-normal MPS
# client priority (CUDA_MPS_CLIENT_PRIORITY=1), so a latency-critical neighbour's goes first.
PRIORITIES = {"best-effort": "1", "latency-critical": "0", "normal": "0"}


class Isolation(StrEnum):
    """How a slice is isolated from its neighbours on a GPU."""

    ANY = "any"
    MPS = "mps"
    MIG = "mig"
    TIMESLICE = "timeslice"
    EXCLUSIVE = "exclusive"


@dataclass(frozen=True, slots=True)
class Gpu:
    """One physical GPU of a node and what is still free on it."""

    index: int
    model: str
    memory_mib: int
    milli_free: int = MILLI
    memory_free_mib: int | None = None
    uuid: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.milli_free <= MILLI:
            raise ValidationError(f"gpu[{self.index}].milli_free", "0..1000", self.milli_free)
        if self.memory_mib < 0:
            raise ValidationError(f"gpu[{self.index}].memory_mib", ">= 0", self.memory_mib)
        if self.memory_free_mib is not None and not 0 <= self.memory_free_mib <= self.memory_mib:
            raise ValidationError(
                f"gpu[{self.index}].memory_free_mib", f"0..{self.memory_mib}", self.memory_free_mib
            )

    @property
    def free_memory(self) -> int:
        return self.memory_mib if self.memory_free_mib is None else self.memory_free_mib


@dataclass(frozen=True, slots=True)
class Node:
    """A node: its CPU and memory (capacity and free) and its GPUs, all of one model."""

    name: str
    cpu_milli: int
    memory_mib: int
    gpus: tuple[Gpu, ...] = ()
    cpu_free: int | None = None
    memory_free: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValidationError("node.name", "a non-empty name", self.name)
        if self.cpu_milli < 0:
            raise ValidationError(f"node {self.name}: cpu_milli", ">= 0", self.cpu_milli)
        if self.memory_mib < 0:
            raise ValidationError(f"node {self.name}: memory_mib", ">= 0", self.memory_mib)
        models = {g.model for g in self.gpus}
        if len(models) > 1:
            raise ValidationError(f"node {self.name}: gpus", "GPUs of one model", sorted(models))

    @property
    def model(self) -> str | None:
        return self.gpus[0].model if self.gpus else None

    @property
    def free_cpu(self) -> int:
        return self.cpu_milli if self.cpu_free is None else self.cpu_free

    @property
    def free_memory(self) -> int:
        return self.memory_mib if self.memory_free is None else self.memory_free


@dataclass(frozen=True, slots=True)
class SliceRequest:
    """What one pod (or container group) asks for.

    ``gpus`` physical GPUs, each giving ``milli`` (1..1000) of its compute and ``gpu_memory_mib``
    of its memory; ``cpu_milli`` and ``memory_mib`` of the node; the GPU models it accepts
    (empty: any) and the isolation it wants. With ``gpu_memory_mib`` 0, ``memory_share`` says
    the pod takes milli/1000 of each GPU's memory (the contract's default for a pod that names
    none); without it (trace replays), memory is not checked.
    """

    gpus: int = 0
    milli: int = 0
    cpu_milli: int = 0
    memory_mib: int = 0
    gpu_memory_mib: int = 0
    models: frozenset[str] = frozenset()
    isolation: Isolation = Isolation.ANY
    name: str = ""
    memory_share: bool = False

    def memory_on(self, gpu_memory_mib: int) -> int:
        """MiB this request takes of a GPU with ``gpu_memory_mib`` (0: not accounted)."""
        if self.gpu_memory_mib or not self.memory_share:
            return self.gpu_memory_mib
        return self.milli * gpu_memory_mib // MILLI

    def __post_init__(self) -> None:
        where = f"request {self.name}: " if self.name else "request: "
        if self.gpus < 0:
            raise ValidationError(where + "gpus", "a GPU count >= 0", self.gpus)
        if self.gpus == 0 and self.milli != 0:
            raise ValidationError(where + "milli", "0 when no GPU is requested", self.milli)
        if self.gpus > 0 and not 1 <= self.milli <= MILLI:
            raise ValidationError(where + "milli", "1..1000 milli-GPU per GPU", self.milli)
        if self.gpus > 1 and self.milli != MILLI:
            raise ValidationError(
                where + "milli", "1000 (whole GPUs) when more than one GPU is requested",
                self.milli,
            )
        for fname in ("cpu_milli", "memory_mib", "gpu_memory_mib"):
            value = getattr(self, fname)
            if value < 0:
                raise ValidationError(where + fname, "a value >= 0", value)

    @property
    def is_sharing(self) -> bool:
        """A fraction of one GPU."""
        return self.gpus == 1 and self.milli < MILLI

    @property
    def total_milli(self) -> int:
        return self.gpus * self.milli


@dataclass(frozen=True, slots=True)
class ClusterArrays:
    """A cluster's state as arrays: rows are nodes, columns of the 2-D arrays are GPU slots.

    Slots past a node's GPU count have ``gpu_present`` False and zero free milli and memory, so
    they never fit a GPU request and add nothing to sums. ``model_id`` indexes ``models``;
    ``-1`` marks a node without GPUs.
    """

    names: tuple[str, ...]
    models: tuple[str, ...]
    model_id: IntArray
    cpu_cap: IntArray
    cpu_free: IntArray
    mem_cap: IntArray
    mem_free: IntArray
    gpu_count: IntArray
    gpu_present: BoolArray
    gpu_free: IntArray
    gpu_mem_cap: IntArray
    gpu_mem_free: IntArray

    @property
    def n_nodes(self) -> int:
        return len(self.names)

    def copy(self) -> ClusterArrays:
        """A deep copy whose arrays may be changed without touching this one."""
        return ClusterArrays(
            self.names,
            self.models,
            self.model_id.copy(),
            self.cpu_cap.copy(),
            self.cpu_free.copy(),
            self.mem_cap.copy(),
            self.mem_free.copy(),
            self.gpu_count.copy(),
            self.gpu_present.copy(),
            self.gpu_free.copy(),
            self.gpu_mem_cap.copy(),
            self.gpu_mem_free.copy(),
        )

    def closed_except(self, open_slots: BoolArray) -> ClusterArrays:
        """A copy where the GPU slots outside ``open_slots`` (nodes x slots) offer nothing:
        the arrays a pod sees that may use those GPUs alone (a selection by UUID)."""
        out = self.copy()
        shut = ~open_slots[:, : out.gpu_free.shape[1]]
        out.gpu_free[shut] = 0
        out.gpu_mem_free[shut] = 0
        return out

    def model_mask(self, allowed: frozenset[str], rows: IntArray | None = None) -> BoolArray:
        """Nodes whose GPU model is in ``allowed`` (every GPU node when it is empty); with
        ``rows``, for those nodes alone."""
        mid = self.model_id if rows is None else self.model_id[rows]
        if not allowed:
            return np.asarray(mid >= 0)
        ids = [i for i, m in enumerate(self.models) if m in allowed]
        return np.isin(mid, ids)


def build_arrays(nodes: Sequence[Node]) -> ClusterArrays:
    """Pack ``nodes`` into :class:`ClusterArrays` (one row per node, in order)."""
    n = len(nodes)
    width = max((len(nd.gpus) for nd in nodes), default=0)
    width = max(width, 1)
    models: list[str] = []
    model_id = np.full(n, -1, dtype=np.int64)
    gpu_free = np.zeros((n, width), dtype=np.int64)
    gpu_present = np.zeros((n, width), dtype=np.bool_)
    gpu_mem_cap = np.zeros((n, width), dtype=np.int64)
    gpu_mem_free = np.zeros((n, width), dtype=np.int64)
    for i, nd in enumerate(nodes):
        if nd.model is not None:
            if nd.model not in models:
                models.append(nd.model)
            model_id[i] = models.index(nd.model)
        for j, g in enumerate(nd.gpus):
            gpu_present[i, j] = True
            gpu_free[i, j] = g.milli_free
            gpu_mem_cap[i, j] = g.memory_mib
            gpu_mem_free[i, j] = g.free_memory
    return ClusterArrays(
        names=tuple(nd.name for nd in nodes),
        models=tuple(models),
        model_id=model_id,
        cpu_cap=np.array([nd.cpu_milli for nd in nodes], dtype=np.int64),
        cpu_free=np.array([nd.free_cpu for nd in nodes], dtype=np.int64),
        mem_cap=np.array([nd.memory_mib for nd in nodes], dtype=np.int64),
        mem_free=np.array([nd.free_memory for nd in nodes], dtype=np.int64),
        gpu_count=np.array([len(nd.gpus) for nd in nodes], dtype=np.int64),
        gpu_present=gpu_present,
        gpu_free=gpu_free,
        gpu_mem_cap=gpu_mem_cap,
        gpu_mem_free=gpu_mem_free,
    )


@dataclass(frozen=True)
class ClusterSnapshot:
    """An immutable view of the cluster at one instant: nodes plus their array form."""

    nodes: tuple[Node, ...]
    arrays: ClusterArrays = field(repr=False)

    @classmethod
    def of(cls, nodes: Iterable[Node]) -> ClusterSnapshot:
        ns = tuple(nodes)
        names = [nd.name for nd in ns]
        if len(set(names)) != len(names):
            dup = sorted({x for x in names if names.count(x) > 1})
            raise ValidationError("nodes", "unique node names", dup)
        arrays = build_arrays(ns)
        for arr in (arrays.cpu_free, arrays.mem_free, arrays.gpu_free, arrays.gpu_mem_free):
            arr.setflags(write=False)
        return cls(ns, arrays)

    def node(self, name: str) -> Node:
        for nd in self.nodes:
            if nd.name == name:
                return nd
        raise ValidationError("node", f"one of {len(self.nodes)} node names", name)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request goes: a node and the GPU indices (one per requested GPU)."""

    node_index: int
    node: str
    gpu_indices: tuple[int, ...]
    milli: int
    score: float


@dataclass(frozen=True, slots=True)
class Decision:
    """A placement, or why there is none.

    ``reasons`` counts the rejected nodes by reason (``{"insufficient cpu": 12, ...}``), the way
    kube-scheduler reports "0/N nodes are available".
    """

    placement: Placement | None
    policy: str
    feasible_nodes: int
    reasons: Mapping[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.placement is not None

    def message(self) -> str:
        if self.placement is not None:
            gpus = ",".join(str(g) for g in self.placement.gpu_indices) or "-"
            return (
                f"{self.policy}: node {self.placement.node} GPU {gpus} "
                f"(score {self.placement.score:.3f}, {self.feasible_nodes} feasible)"
            )
        parts = ", ".join(f"{n} {r}" for r, n in sorted(self.reasons.items()))
        return f"{self.policy}: 0 feasible nodes ({parts})"
