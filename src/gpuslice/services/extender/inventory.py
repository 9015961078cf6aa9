"""The GPU inventory the extender reads from the nodes: per node its GPUs (UUIDs by slot,
models, memory), the MIG instances of its MIG-enabled GPUs, its allocatable CPU and memory and
its cordoned GPUs, read from the node agents' annotations; and what of a node the watch
follows (a change there re-reads everything). :mod:`.view` keeps the result."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpuslice.adapters.kube.objects import (
    CORDONED_ANNOTATION as CORDONED,
)
from gpuslice.adapters.kube.objects import (
    INVENTORY_ANNOTATION,
    InventoryMig,
    node_allocatable,
    node_inventory,
)
from gpuslice.core.errors import ValidationError
from gpuslice.core.ledger import GpuSlot
from gpuslice.core.model import ClusterArrays, Gpu, Node, build_arrays

NodeMark = tuple[str, str, str, str]


def node_mark(node: dict[str, Any]) -> NodeMark:
    """What of a node the extender follows: its GPU inventory, its cordoned GPUs and its
    allocatable CPU and memory."""
    ann = (node.get("metadata") or {}).get("annotations") or {}
    alloc = (node.get("status") or {}).get("allocatable") or {}
    return (str(ann.get(INVENTORY_ANNOTATION, "")), str(ann.get(CORDONED, "")),
            str(alloc.get("cpu", "")), str(alloc.get("memory", "")))


def _allocatable(node: dict[str, Any], problems: list[str]) -> tuple[int, int]:
    """A node's allocatable CPU (milli) and memory (MiB); 0 for what it does not report."""
    try:
        return node_allocatable(node)
    except ValidationError as exc:
        problems.append(str(exc))
        return 0, 0


@dataclass(frozen=True)
class Inventory:
    names: list[str]
    index: dict[str, int]
    uuids: list[list[str]]  # per node, GPU UUID by slot
    arrays: ClusterArrays
    # per node: the MIG instances of its MIG-enabled GPUs, (GPU UUID, GPU model, instance)
    mig: list[list[tuple[str, str, InventoryMig]]]
    # MIG-enabled GPUs: no whole-GPU slice; MPS slices go inside their instances
    mig_gpus: frozenset[str] = frozenset()
    mig_rows: frozenset[int] = frozenset()  # nodes with a MIG-enabled GPU
    unpublished: frozenset[int] = frozenset()  # nodes whose agent has published no inventory


@dataclass(frozen=True)
class NodesRead:
    """What :func:`read_nodes` makes of a list of nodes."""

    inv: Inventory
    slots: list[GpuSlot]  # every GPU, for the ledger
    cordoned: set[str]  # GPU UUIDs cordoned for reconfiguration
    marks: dict[str, NodeMark]  # per node, what the watch follows (:func:`node_mark`)


def read_nodes(nodes: Iterable[dict[str, Any]], problems: list[str]) -> NodesRead:
    """The inventory of ``nodes`` (Node objects), in their order; what cannot be read is
    appended to ``problems`` and counts as nothing (no GPU, no CPU or memory)."""
    names: list[str] = []
    uuids: list[list[str]] = []
    model: list[Node] = []
    slots: list[GpuSlot] = []
    cordoned: set[str] = set()
    migs: list[list[tuple[str, str, InventoryMig]]] = []
    mig_gpus: set[str] = set()
    mig_rows: set[int] = set()
    marks: dict[str, NodeMark] = {}
    unpublished: set[int] = set()
    for n in nodes:
        name = n["metadata"]["name"]
        marks[name] = node_mark(n)
        if not marks[name][0]:  # no inventory annotation yet: not a node without GPUs
            unpublished.add(len(names))
        raw = ((n["metadata"].get("annotations") or {}).get(CORDONED) or "")
        cordoned.update(u.strip() for u in raw.split(",") if u.strip())
        try:
            inv = sorted(node_inventory(n), key=lambda g: g.index)
        except ValidationError as exc:
            problems.append(str(exc))
            inv = []
        names.append(name)
        uuids.append([g.uuid for g in inv])
        migs.append([(g.uuid, g.model, m) for g in inv for m in g.mig])
        mig_gpus.update(g.uuid for g in inv if g.mig_enabled)
        if any(g.mig_enabled for g in inv):
            mig_rows.add(len(names) - 1)
        cpu, mem = _allocatable(n, problems)
        model.append(Node(name, cpu, mem, tuple(Gpu(j, g.model, g.memory_mib)
                                                for j, g in enumerate(inv))))
        slots.extend(GpuSlot(g.uuid, name, g.memory_mib) for g in inv)
    inventory = Inventory(names, {n: i for i, n in enumerate(names)}, uuids,
                          build_arrays(model), migs, frozenset(mig_gpus), frozenset(mig_rows),
                          frozenset(unpublished))
    return NodesRead(inventory, slots, cordoned, marks)
