"""How the extender's own work per pod grows with the cluster, in-process (no HTTP, no API
server): for each node count, the same cluster shape as ``extender_speed.py`` (8 GPUs per node,
four models, half the milli already held by signed assignments), then pods arriving one by one
through what the extender does for each: filter (the policy's choice over the node names
kube-scheduler sends with ``nodeCacheCapable``: by default the window deploy/'s
``percentageOfNodesToScore`` gives (``sim.deployed.NODES_TO_SCORE``: 1, 100 names of any
cluster up to 10,000 nodes), from a start that moves on by the window each pod
(``core.dra_default.nodes_to_find``); its adaptive share with ``--nodes-to-score 0`` (100 of
100 nodes, 420 of 1000, 500 of 5000), every node with ``--nodes-to-score 100``; in another
order for each pod, as its parallel filter finds them, and as new strings, as the JSON
parser makes them; prepared outside the timing), the filter's unresolvable check, the
bind's hold on the event loop, the Binding write's preparation and its completion (the API
server fake's own write excluded from the timing). The heap is settled every second
as ``gpuslice extender`` settles it (``services/heap.py``: what it holds kept out of Python's
full collections), that work timed with the rest.

Prints CPU ms per pod per node count and each count's ratio to the smallest's, measured in the
same run; the gate (issue 28: "flat in the node count"): the largest count's cost <= 1.5x the
smallest's.

    python benchmarks/extender_growth.py [--nodes 100 1000 5000] [--pods 400]
        [--nodes-to-score 0-100]
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from extender_speed import KEY, build, clock, pod
from gpuslice.core.dra_default import nodes_to_find
from gpuslice.services.extender import ExtenderState
from gpuslice.services.extender.http import SETTLE_EVERY_S
from gpuslice.services.heap import LongLivedHeap
from gpuslice.sim.deployed import NODES_TO_SCORE

GATE = 1.5


def per_pod_ms(n_nodes: int, pods: int, console: Console, percentage: int = 0) -> float:
    rnd = random.Random(3)
    t0 = time.monotonic()
    api = build(n_nodes, 0.5, rnd)
    state = ExtenderState(api, KEY, clock=clock)
    names = [x["metadata"]["name"] for x in api.list_nodes()]
    share = nodes_to_find(len(names), percentage)
    console.print(f"  {n_nodes} nodes: {len(api.list_pods())} pods placed, state built in "
                  f"{time.monotonic() - t0:.0f} s; {share} node names per filter",
                  highlight=False)
    todo = [api.add_pod(pod(f"q-{i}", rnd.choice([100, 250, 300, 470, 500])))
            for i in range(pods + 50)]
    heap = LongLivedHeap()
    heap.settled()  # as the extender's settle task does once it serves
    settled_at = time.monotonic()
    try:
        spent = _timed(state, api, todo, names, share, rnd, heap, settled_at)
    finally:
        gc.unfreeze()  # this node count's cluster goes with it
    return 1e3 * spent / pods


def _timed(state: ExtenderState, api: Any, todo: list[dict[str, Any]], names: list[str],
           share: int, rnd: random.Random, heap: LongLivedHeap, settled_at: float) -> float:
    """CPU seconds of the extender's work for ``todo`` (the first 50 pods untimed), each
    filter asked about ``share`` of ``names`` from a start that moves on by as many."""
    spent = 0.0
    start = 0
    for k, p in enumerate(todo):
        m = p["metadata"]
        window = [names[(start + i) % len(names)] for i in range(share)]
        start = (start + share) % len(names)
        rnd.shuffle(window)
        asked = orjson.loads(orjson.dumps(window))  # fresh strings, unhashed yet
        t = time.process_time()
        keep, failed = state.filter(p, asked)
        state.remember(p)
        state.unresolvable(p, list(failed))
        held = state.hold("bench", m["name"], m["uid"], keep[0])
        assert held is not None, keep
        w = state.start_held("bench", m["name"], m["uid"], keep[0], held)
        assert w is not None
        mid = time.process_time()
        api.bind("bench", m["name"], m["uid"], keep[0], w.annotations(), w.resource_version)
        t2 = time.process_time()
        assert state.finish_held(w, None) == ""
        if time.monotonic() - settled_at >= SETTLE_EVERY_S:
            heap.settled()
            settled_at = time.monotonic()
        if k >= 50:  # the first pods warm the caches
            spent += (mid - t) + (time.process_time() - t2)
    return spent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[100, 1000, 5000])
    ap.add_argument("--pods", type=int, default=400, help="pods timed per node count")
    ap.add_argument("--nodes-to-score", type=int, default=NODES_TO_SCORE, metavar="P",
                    help="kube-scheduler's percentageOfNodesToScore (default deploy/'s, "
                    f"{NODES_TO_SCORE}); 0 its adaptive share; 100 every node name in every "
                    "filter")
    args = ap.parse_args()
    if not 0 <= args.nodes_to_score <= 100:
        ap.error("--nodes-to-score: expected 0 (adaptive) to 100")
    console = Console()
    costs = {n: per_pod_ms(n, args.pods, console, args.nodes_to_score)
             for n in sorted(args.nodes)}
    base = costs[min(costs)]
    table = Table(title="the extender's work per pod, in-process (CPU ms)")
    for col in ("nodes", "ms per pod", f"x {min(costs)} nodes"):
        table.add_column(col)
    for n, ms in costs.items():
        table.add_row(str(n), f"{ms:.2f}", f"{ms / base:.2f}")
    console.print(table)
    worst = costs[max(costs)] / base
    ok = worst <= GATE
    console.print(f"{'PASS' if ok else 'FAIL'} {max(costs)} nodes cost {worst:.2f}x "
                  f"{min(costs)} nodes (gate <= {GATE})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
