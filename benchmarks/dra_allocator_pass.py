"""The DRA claim allocator's pass, in-process: the ledger kept between passes
(services.dra_book) against one built from scratch every pass, measured in the same run.

A cluster of ``--nodes`` nodes (8 shareable GPUs each, our driver's slices, tainted for the
allocator) with ``--claims`` claims allocated and their pods bound; then, pass after pass, one
more pod and claim arrive, the pass places it, and the claim comes back allocated (a new
version, as the API server would return it). Each pass is timed (CPU) twice on identical
lists: by an allocator that keeps its ledger, and by one whose ledger is rebuilt (a fresh
``DraBook`` each pass, which is what every pass cost before the ledger was kept). Both must
place every claim on the same node (the placements are compared).

    python benchmarks/dra_allocator_pass.py                   # 1000 nodes, 5000 claims
    python benchmarks/dra_allocator_pass.py --nodes 100 --claims 500

Gate: the kept ledger's median pass at most a fifth of the rebuilt one's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from gpuslice.adapters.kube import dra as kdra
from gpuslice.services.dra_allocator import DraAllocator
from gpuslice.services.dra_book import DraBook

GPUS = 8


def _stamp(obj: dict[str, Any], serial: list[int]) -> dict[str, Any]:
    serial[0] += 1
    meta = obj["metadata"]
    meta.setdefault("uid", f"uid-{serial[0]}")
    meta["resourceVersion"] = str(serial[0])
    return obj


def _device(i: int) -> dict[str, Any]:
    return {"name": f"gpu-{i}", "allowMultipleAllocations": True,
            "attributes": {"type": {"string": "share"},
                           "productName": {"string": "NVIDIA A100-SXM4-80GB"}},
            "capacity": {
                "compute": {"value": "100", "requestPolicy": {
                    "default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}}},
                "memory": {"value": "80Gi", "requestPolicy": {
                    "default": "0", "validRange": {"min": "0", "step": "1Mi"}}}},
            "taints": [{"key": kdra.ALLOCATOR_TAINT, "value": "gpuslice",
                        "effect": "NoSchedule"}]}


def _claim(name: str, compute: int) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "bench"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "share.gpuslice.io",
                "capacity": {"requests": {"compute": str(compute), "memory": "8Gi"}}}}]}},
            "status": {}}


def _allocated(node: str, device: str, compute: int) -> dict[str, Any]:
    return {"allocation": {
        "devices": {"results": [{"request": "gpu", "driver": kdra.DRIVER, "pool": node,
                                 "device": device, "shareID": f"s-{node}-{device}",
                                 "consumedCapacity": {"compute": str(compute),
                                                      "memory": "8Gi"}}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}


def _pod(name: str, claim: str, node: str = "") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "bench",
                         "creationTimestamp": "2026-11-27T00:00:00Z"},
            "spec": {"containers": [{"name": "main", "resources": {
                "requests": {"cpu": "2", "memory": "8Gi"}, "claims": [{"name": "gpu"}]}}],
                "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
                **({"nodeName": node} if node else {})},
            "status": {"phase": "Pending"}}


class Cluster:
    """The lists an allocator reads, and its writes landing in them (new versions)."""

    def __init__(self, nodes: int, claims: int) -> None:
        self.serial = [0]
        s = self.serial
        self.nodes = [_stamp({"metadata": {"name": f"n{i:05d}"}, "status": {"allocatable": {
            "cpu": "128", "memory": "1024Gi"}}}, s) for i in range(nodes)]
        self.slices = [_stamp({"metadata": {"name": f"n{i:05d}-slice"}, "spec": {
            "driver": kdra.DRIVER, "nodeName": f"n{i:05d}",
            "pool": {"name": f"n{i:05d}", "generation": 1, "resourceSliceCount": 1},
            "devices": [_device(j) for j in range(GPUS)]}}, s) for i in range(nodes)]
        self.classes = [{"metadata": {"name": "share.gpuslice.io"}, "spec": {}}]
        self.claims: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        for k in range(claims):  # a fill of 25% shares, round robin over the GPUs
            node, dev = f"n{k % nodes:05d}", f"gpu-{(k // nodes) % GPUS}"
            c = _claim(f"c{k}", 25)
            c["status"] = _allocated(node, dev, 25)
            self.claims[f"c{k}"] = _stamp(c, s)
            self.pods[f"p{k}"] = _stamp(_pod(f"p{k}", f"c{k}", node), s)

    def arrive(self, k: int) -> None:
        self.claims[f"x{k}"] = _stamp(_claim(f"x{k}", 25), self.serial)
        self.pods[f"xp{k}"] = _stamp(_pod(f"xp{k}", f"x{k}"), self.serial)

    def port(self, writes: dict[str, dict[str, Any]]) -> Any:
        cluster = self

        class Port:  # what the allocator reads (copies of the lists) and writes (recorded)
            def list_resource_slices(self) -> list[dict[str, Any]]:
                return list(cluster.slices)

            def list_device_classes(self) -> list[dict[str, Any]]:
                return cluster.classes

            def list_resource_claims(self) -> list[dict[str, Any]]:
                return list(cluster.claims.values())

            def list_pods(self) -> list[dict[str, Any]]:
                return list(cluster.pods.values())

            def list_nodes(self) -> list[dict[str, Any]]:
                return list(cluster.nodes)

            def update_resource_claim(self, c: dict[str, Any]) -> dict[str, Any]:
                return c

            def update_resource_claim_status(self, c: dict[str, Any]) -> dict[str, Any]:
                writes[c["metadata"]["name"]] = c
                return c

        return Port()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--claims", type=int, default=5000)
    ap.add_argument("--passes", type=int, default=30)
    args = ap.parse_args(argv)
    console = Console()
    cluster = Cluster(args.nodes, args.claims)
    kept_writes: dict[str, dict[str, Any]] = {}
    fresh_writes: dict[str, dict[str, Any]] = {}
    kept = DraAllocator(cluster.port(kept_writes), settle_s=0.0)
    fresh = DraAllocator(cluster.port(fresh_writes), settle_s=0.0)
    t0 = time.process_time()
    kept.run_once()  # the first pass builds the ledger: not timed
    first = time.process_time() - t0
    times: dict[str, list[float]] = {"kept": [], "rebuilt": []}
    same = 0
    with console.status("passes") as status:
        for k in range(args.passes):
            status.update(f"pass {k + 1}/{args.passes}")
            cluster.arrive(k)
            for name, alloc in (("kept", kept), ("rebuilt", fresh)):
                if name == "rebuilt":
                    alloc.book = DraBook(alloc.driver, alloc.classes)
                t = time.process_time()
                report = alloc.run_once()
                times[name].append(time.process_time() - t)
                if len(report.allocated) != 1:
                    console.print(f"[red]{name} pass {k}: placed {report.allocated}")
                    return 1
            a, b = kept_writes.pop(f"x{k}"), fresh_writes.pop(f"x{k}")
            same += kdra.allocated_node(a) == kdra.allocated_node(b)
            # the claim comes back allocated (ours), a new version
            cluster.claims[f"x{k}"] = _stamp(a, cluster.serial)
    med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
    worst = {n: max(v) * 1e3 for n, v in times.items()}
    table = Table(title=f"one allocator pass, {args.nodes} nodes x {GPUS} GPUs, "
                        f"{args.claims} claims allocated, one new claim per pass "
                        f"(CPU ms, {args.passes} passes)")
    for col in ("ledger", "median ms", "max ms"):
        table.add_column(col)
    table.add_row("rebuilt every pass", f"{med['rebuilt']:.1f}", f"{worst['rebuilt']:.1f}")
    table.add_row("kept between passes", f"{med['kept']:.1f}", f"{worst['kept']:.1f}")
    console.print(table)
    ratio = med["kept"] / med["rebuilt"]
    console.print(f"first pass (builds the kept ledger): {first * 1e3:.0f} ms; "
                  f"same node chosen in {same}/{args.passes} passes")
    ok = ratio <= 0.2 and same == args.passes
    console.print(f"kept / rebuilt: {ratio:.2f} (gate <= 0.20, same placements): "
                  + ("[green]pass" if ok else "[red]FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
