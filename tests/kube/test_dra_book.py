"""The claim allocator's ledger kept between passes (services.dra_book) against one built from
scratch on the same objects, after every step of a random history: claims created, allocated
(by us or the scheduler), released and deleted, pods created, bound, finished and deleted,
a node's allocatable changed, a slice republished."""

from __future__ import annotations

import copy
import itertools
import random
from typing import Any

import numpy as np
import pytest

from gpuslice.adapters.kube import dra as kdra
from gpuslice.services.dra_book import DraBook
from tests.kube.test_dra_allocator import claim, node, pod, rslice, share

_rv = itertools.count(1)


def stamp(obj: dict[str, Any], uid: str | None = None) -> dict[str, Any]:
    """A new version of ``obj`` as the API server would return it (a new dict)."""
    obj = copy.deepcopy(obj)
    meta = obj["metadata"]
    meta["uid"] = uid or meta.get("uid") or f"uid-{next(_rv)}"
    meta["resourceVersion"] = str(next(_rv))
    return obj


class World:
    def __init__(self, rng: random.Random, n_nodes: int = 6) -> None:
        self.rng = rng
        self.nodes = {f"n{i}": stamp(node(f"n{i}")) for i in range(n_nodes)}
        self.slices = {f"n{i}": stamp(rslice(f"n{i}", 4)) for i in range(n_nodes)}
        self.claims: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.serial = itertools.count()

    def devices(self) -> tuple[dict[str, list[Any]], object]:
        slices = list(self.slices.values())
        version = tuple((s["metadata"]["uid"], s["metadata"]["resourceVersion"])
                        for s in slices)
        return kdra.slice_devices(slices), version

    def lists(self) -> tuple[list[Any], list[Any], list[Any]]:
        return list(self.nodes.values()), list(self.pods.values()), list(self.claims.values())

    def step(self) -> str:
        rng = self.rng
        what = rng.choice(["create", "create", "create", "allocate", "allocate", "bind",
                           "release", "finish", "delete pod", "delete claim", "node", "slice",
                           "template"])
        names = sorted(self.claims)
        if what in ("create", "template") or not names:
            k = next(self.serial)
            c = stamp(claim(f"c{k}", rng.choice([10, 25, 50, 100])))
            self.claims[f"c{k}"] = c
            p = pod(f"p{k}", f"c{k}")
            if what == "template":  # the claim's name from the pod's status
                p["spec"]["resourceClaims"] = [{"name": "gpu",
                                                "resourceClaimTemplateName": "t"}]
                p["status"]["resourceClaimStatuses"] = [{"name": "gpu",
                                                         "resourceClaimName": f"c{k}"}]
            self.pods[f"p{k}"] = stamp(p)
            return what
        if what == "bind":  # one whose claim is allocated, if any
            names = [n for n in names if self.claims[n]["status"].get("allocation")
                     and "p" + n[1:] in self.pods] or names
        name = rng.choice(names)
        c, pname = self.claims[name], "p" + name[1:]
        p = self.pods.get(pname)
        if what == "allocate" and not c["status"].get("allocation"):
            n = rng.choice(sorted(self.nodes))
            c = copy.deepcopy(c)
            c["status"] = share(n, f"gpu-{rng.randrange(4)}",
                                int(c["spec"]["devices"]["requests"][0]["exactly"]
                                    ["capacity"]["requests"]["compute"]))
            self.claims[name] = stamp(c)
        elif what == "bind" and p is not None and c["status"].get("allocation"):
            p = copy.deepcopy(p)
            p["spec"]["nodeName"] = kdra.allocated_node(c)
            self.pods[pname] = stamp(p)
        elif what == "release" and c["status"].get("allocation"):
            c = copy.deepcopy(c)
            c["status"] = {}
            self.claims[name] = stamp(c)
        elif what == "finish" and p is not None:
            p = copy.deepcopy(p)
            p["status"]["phase"] = rng.choice(["Succeeded", "Failed"])
            self.pods[pname] = stamp(p)
        elif what == "delete pod" and p is not None:
            del self.pods[pname]
        elif what == "delete claim":
            del self.claims[name]
        elif what == "node":
            n = rng.choice(sorted(self.nodes))
            doc = copy.deepcopy(self.nodes[n])
            doc["status"]["allocatable"]["cpu"] = str(rng.choice([8, 16, 64]))
            self.nodes[n] = stamp(doc)
        elif what == "slice":
            n = rng.choice(sorted(self.slices))
            self.slices[n] = stamp(self.slices[n])
        else:
            return "nothing"
        return what


def same(kept: DraBook, fresh: DraBook) -> None:
    a, b = kept.ledger, fresh.ledger
    assert a is not None and b is not None
    assert [n.name for n in a.nodes] == [n.name for n in b.nodes]
    assert a.usage == b.usage
    for field in ("gpu_free", "gpu_mem_free", "cpu_free", "mem_free"):
        np.testing.assert_array_equal(getattr(a.arrays, field), getattr(b.arrays, field),
                                      err_msg=field)
    assert kept._estimator._counts == fresh._estimator._counts
    b.set_workload(a.state.workload)  # the kept one may hold an older estimate (hysteresis)
    np.testing.assert_allclose(a.state.frag, b.state.frag)
    assert [pc.claim["metadata"]["name"] for pc in kept.pending()] == \
        [pc.claim["metadata"]["name"] for pc in fresh.pending()]


@pytest.mark.parametrize("seed", range(8))
def test_the_kept_ledger_equals_one_built_from_scratch(seed: int) -> None:
    world = World(random.Random(seed))
    kept = DraBook()
    done: set[str] = set()
    for _ in range(150):
        done.add(world.step())
        devices, version = world.devices()
        kept.sync(devices, version, *world.lists())
        fresh = DraBook()
        fresh.sync(devices, version, *world.lists())
        same(kept, fresh)
    assert kept.rebuilds < 40  # slices and node changes only, not every step
    assert {"create", "allocate", "bind", "release", "finish", "delete pod", "delete claim",
            "node", "slice"} <= done


def test_decisions_applied_in_a_pass_are_set_back_from_the_objects() -> None:
    """What a pass applied (a claim placed, its pod's CPU) is replaced by what the objects
    say at the next sync: counted once when the claim comes back allocated, not at all if
    the write did not land."""
    from gpuslice.core.policies import make_policy

    world = World(random.Random(1), n_nodes=2)
    for k in range(3):
        world.claims[f"c{k}"] = stamp(claim(f"c{k}", 25))
        world.pods[f"p{k}"] = stamp(pod(f"p{k}", f"c{k}"))
    kept = DraBook()
    devices, version = world.devices()
    ledger = kept.sync(devices, version, *world.lists())
    pc = kept.pending()[0]
    dec = ledger.decide(pc.request, make_policy("frag-strand"), np.random.default_rng(0),
                        cpu_milli=pc.cpu_milli, memory_mib=pc.memory_mib)
    assert dec.placement is not None
    ledger.apply(dec.placement, ledger.slice_request(pc.request, pc.cpu_milli,
                                                     pc.memory_mib))
    # the write did not land: the next pass sees the claim as it was
    kept.sync(devices, version, *world.lists())
    fresh = DraBook()
    fresh.sync(devices, version, *world.lists())
    same(kept, fresh)
    # it did: the claim comes back allocated where we placed it
    name = pc.claim["metadata"]["name"]
    c = copy.deepcopy(world.claims[name])
    r = dec.placement.results[0]
    c["status"] = share(dec.placement.node, r.device, int(r.consumed["compute"]))
    world.claims[name] = stamp(c)
    ledger = kept.sync(devices, version, *world.lists())
    ledger.apply(dec.placement)  # applied twice in error would count twice ...
    kept.sync(devices, version, *world.lists())  # ... until the next sync sets it back
    fresh = DraBook()
    fresh.sync(devices, version, *world.lists())
    same(kept, fresh)
