"""The extender's preempt verb: the scheduler's victims kept, its own added with their
disruption budgets, nominations and victims the watch has not seen go."""

from __future__ import annotations

import asyncio

import aiohttp

from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.services.extender import ExtenderState
from tests.extender.helpers import (
    bound,
    node,
    pod,
    post,
    reasons,
    serving,
)


def test_preempt_keeps_the_schedulers_victims_and_drops_nodes_that_cannot_fit() -> None:
    api = FakeApiServer()
    api.add_node(node("a", "A100-80GB", 2))
    api.add_node(node("b", "A100-80GB", 1))
    for name, milli in (("low1", 500), ("low2", 300), ("low3", 400), ("low4", 600),
                        ("low5", 1000)):
        api.add_pod(pod(name, milli))
    api.add_pod(pod("urgent", 600))

    async def body(url: str, state: ExtenderState) -> None:
        uid = {}
        async with aiohttp.ClientSession() as s:
            for name, where in (("low1", "a"), ("low2", "a"), ("low3", "a"), ("low4", "a"),
                                ("low5", "b")):
                a = await bound(s, url, api, api.get_pod("default", name), where)
                uid[name] = a.pod_uid
            urgent = api.get_pod("default", "urgent")
            meta = {"a": {"Pods": [{"UID": uid[n]} for n in ("low1", "low2", "low3", "low4")]
                          + [{"UID": "cpu-only-pod"}], "NumPDBViolations": 1},
                    "b": {"Pods": [], "NumPDBViolations": 0},
                    "zz": {"Pods": [{"UID": "x"}], "NumPDBViolations": 0}}
            st, res = await post(s, url + "/preempt", {"Pod": urgent,
                                                       "NodeNameToMetaVictims": meta})
            assert st == 200, res
            # on a the pod fits once the scheduler's victims go: every one of them stays
            # (it chose them for what it counts, and needs them all); b frees nothing without
            # victims and has none of lower priority to add; zz is unknown
            assert res == {"NodeNameToMetaVictims": {"a": {
                "Pods": [{"UID": uid[n]} for n in ("low1", "low2", "low3", "low4")]
                + [{"UID": "cpu-only-pod"}], "NumPDBViolations": 1}}}
            full = {"b": {"Pods": [api.get_pod("default", "low5")], "NumPDBViolations": 0}}
            st, res = await post(s, url + "/preempt", {"Pod": urgent, "NodeNameToVictims": full})
            assert res["NodeNameToMetaVictims"] == {
                "b": {"Pods": [{"UID": uid["low5"]}], "NumPDBViolations": 0}}
            st, res = await post(s, url + "/preempt", {"Pod": urgent,
                                                       "NodeNameToMetaVictims": ["a"]})
            assert st == 400 and "NodeNameToMetaVictims" in str(res)
            st, res = await post(s, url + "/preempt", {"Pod": urgent, "NodeNameToMetaVictims": {
                "a": {"Pods": [{"name": "no uid"}]}}})
            assert st == 400 and "pods with their UID" in str(res)
        assert sum(state.ledger.used_milli.values()) == 2800  # preempt changed nothing

    asyncio.run(serving(api, body))


def test_victims_the_extender_adds_count_their_disruption_budgets_and_spare_them_first(
        ) -> None:
    """kube-scheduler picks victims for what it counts (here one CPU-only pod per node; it
    counts GPU share and memory per node, not per GPU) and the extender adds those the GPUs
    need:
    pods whose PodDisruptionBudget allows no disruption are taken last and counted as
    violations (filterPodsWithPDBViolation, defaultpreemption/default_preemption.go), so that
    pickOneNodeForPreemption (preemption.go) prefers the node that violates none; the list
    stays highest priority first, as it reads Pods[0] as the highest."""
    api = FakeApiServer()
    for n in ("a", "b", "c"):
        api.add_node(node(n, "A100-80GB", 1))
    placed = {"a": [("guard-0", 1, "guarded"), ("guard-1", 1, "guarded")],
              "b": [("free-0", 1, "free"), ("free-1", 1, "free")],
              "c": [("guard-2", 1, "guarded"), ("loose", 5, "free")]}
    for where in placed.values():
        for name, prio, tier in where:
            p = pod(name, 500)
            p["metadata"]["labels"] = {"tier": tier}
            p["spec"]["priority"] = prio
            api.add_pod(p)
    api.add_pdb({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                 "metadata": {"name": "guard", "namespace": "default"},
                 "spec": {"minAvailable": 3,
                          "selector": {"matchExpressions": [
                              {"key": "tier", "operator": "In", "values": ["guarded"]}]}},
                 "status": {"disruptionsAllowed": 0, "currentHealthy": 3}})
    whole = pod("urgent", 1000)
    whole["spec"]["priority"] = 100
    half = pod("half", 500)
    half["spec"]["priority"] = 100
    api.add_pod(whole)
    api.add_pod(half)

    async def body(url: str, state: ExtenderState) -> None:
        uid = {}
        async with aiohttp.ClientSession() as s:
            for where, pods in placed.items():
                for name, _, _ in pods:
                    a = await bound(s, url, api, api.get_pod("default", name), where)
                    uid[name] = a.pod_uid
            none = {n: {"Pods": [{"UID": f"cpu-{n}"}], "NumPDBViolations": 0}
                    for n in ("a", "b", "c")}
            _, res = await post(s, url + "/preempt", {"Pod": api.get_pod("default", "urgent"),
                                                      "NodeNameToMetaVictims": none})
            got = {n: ([p["UID"] for p in v["Pods"]], v["NumPDBViolations"])
                   for n, v in res["NodeNameToMetaVictims"].items()}
            assert got["a"][1] == 2 and sorted(got["a"][0]) == sorted(
                ["cpu-a", uid["guard-0"], uid["guard-1"]])
            assert got["b"][1] == 0 and sorted(got["b"][0]) == sorted(
                ["cpu-b", uid["free-0"], uid["free-1"]])
            assert got["c"] == (["cpu-c", uid["loose"], uid["guard-2"]], 1)  # priority 5 first
            # half a GPU: on c the unguarded pod goes, though its priority is higher
            _, res = await post(s, url + "/preempt", {"Pod": api.get_pod("default", "half"),
                                                      "NodeNameToMetaVictims": none})
            assert res["NodeNameToMetaVictims"]["c"] == {
                "Pods": [{"UID": "cpu-c"}, {"UID": uid["loose"]}], "NumPDBViolations": 0}
            assert res["NodeNameToMetaVictims"]["a"]["NumPDBViolations"] == 1
            # the scheduler's own victims keep its count; the extender's come after them
            # in priority order
            sched = {"c": {"Pods": [{"UID": "cpu-only"}, {"UID": uid["guard-2"]}],
                           "NumPDBViolations": 1}}
            _, res = await post(s, url + "/preempt", {"Pod": api.get_pod("default", "urgent"),
                                                      "NodeNameToMetaVictims": sched})
            assert res["NodeNameToMetaVictims"]["c"] == {
                "Pods": [{"UID": "cpu-only"}, {"UID": uid["loose"]}, {"UID": uid["guard-2"]}],
                "NumPDBViolations": 1}

    asyncio.run(serving(api, body))


def test_a_nominated_pod_is_not_refused_for_victims_the_watch_has_not_seen_go() -> None:
    """kube-scheduler retries a preemptor as soon as its cache drops the victims; when the
    ledger has not yet followed their deletion, the nominated node is read back from the API
    server instead of refused (a refusal makes the scheduler preempt again elsewhere:
    PodEligibleToPreemptOthers, pkg/scheduler/framework/plugins/defaultpreemption/
    default_preemption.go). Shares of pods that still exist stay; other nodes are not read."""
    api = FakeApiServer()
    api.add_node(node("a", "A100-80GB", 1))
    api.add_node(node("b", "A100-80GB", 1))
    for name in ("victim", "keeper"):
        api.add_pod(pod(name, 1000))
    api.add_pod(pod("urgent", 1000))

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            await bound(s, url, api, api.get_pod("default", "victim"), "b")
            await bound(s, url, api, api.get_pod("default", "keeper"), "a")
            api.delete_pod("default", "victim")  # the watch event is not applied
            urgent = api.get_pod("default", "urgent")
            _, res = await post(s, url + "/filter", {"Pod": urgent, "NodeNames": ["a", "b"]})
            assert res["NodeNames"] == [] and set(reasons(res)) == {"a", "b"}
            assert ("default", "victim") in state.ledger.owners  # not nominated: nothing read
            urgent["status"] = {"nominatedNodeName": "b"}
            _, res = await post(s, url + "/filter", {"Pod": urgent, "NodeNames": ["a", "b"]})
            assert res["NodeNames"] == ["b"] and set(reasons(res)) == {"a"}
            assert ("default", "victim") not in state.ledger.owners
            urgent["status"] = {"nominatedNodeName": "a"}  # its holder is still there
            _, res = await post(s, url + "/filter", {"Pod": urgent, "NodeNames": ["a"]})
            assert res["NodeNames"] == [] and ("default", "keeper") in state.ledger.owners
            async with s.get(url + "/metrics") as r:
                assert "gpuslice_extender_stale_shares_freed_total 1.0" in await r.text()

    asyncio.run(serving(api, body))


def test_victims_offered_by_preempt_are_read_back_before_the_nomination_is_seen() -> None:
    """The pod kube-scheduler retries after preempting need not carry its nomination yet
    (``handleSchedulingFailure``, pkg/scheduler/schedule_one.go, requeues the informer's copy
    before patching ``nominatedNodeName``): the victims this extender's preempt offered are
    read back as a nominated node's are, else the refusal makes the scheduler preempt again
    on the one node it still sees victims on, the one a PodDisruptionBudget protects
    (issue 29). The offered victims still alive stay."""
    api = FakeApiServer()
    api.add_node(node("a", "A100-80GB", 1))
    api.add_node(node("b", "A100-80GB", 1))
    for name in ("free", "protected"):
        api.add_pod(pod(name, 1000))
    api.add_pod(pod("urgent", 1000))

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            await bound(s, url, api, api.get_pod("default", "free"), "b")
            await bound(s, url, api, api.get_pod("default", "protected"), "a")
            uid = {n: api.get_pod("default", n)["metadata"]["uid"]
                   for n in ("free", "protected")}
            urgent = api.get_pod("default", "urgent")
            offered = {"a": {"Pods": [{"UID": uid["protected"]}], "NumPDBViolations": 1},
                       "b": {"Pods": [{"UID": uid["free"]}], "NumPDBViolations": 0}}
            _, res = await post(s, url + "/preempt", {"Pod": urgent,
                                                      "NodeNameToMetaVictims": offered})
            assert set(res["NodeNameToMetaVictims"]) == {"a", "b"}
            api.delete_pod("default", "free")  # the scheduler chose b; no watch event applied
            assert not (urgent.get("status") or {}).get("nominatedNodeName")
            _, res = await post(s, url + "/filter", {"Pod": urgent, "NodeNames": ["a", "b"]})
            assert res["NodeNames"] == ["b"] and set(reasons(res)) == {"a"}
            assert ("default", "free") not in state.ledger.owners
            assert ("default", "protected") in state.ledger.owners
            other = api.get_pod("default", "urgent")
            other["metadata"]["uid"] = "another-pod"  # offers are the preemptor's own
            _, res = await post(s, url + "/filter", {"Pod": other, "NodeNames": ["a"]})
            assert res["NodeNames"] == []

    asyncio.run(serving(api, body))


def test_no_preemption_while_the_pod_fits_a_node_outside_the_schedulers_window() -> None:
    """kube-scheduler sends a window of at least 100 feasible nodes (percentageOfNodesToScore,
    numFeasibleNodesToFind in schedule_one.go); where none of them has room on a GPU but a node
    outside does, the refusals are unresolvable (no eviction), three times in a row at most."""
    from gpuslice.services.extender.placement import OUTSIDE, WINDOW_MISSES

    api = FakeApiServer()
    names = [f"n{i:03d}" for i in range(101)]
    for n in names:
        api.add_node(node(n, "A100-80GB", 1))
    for n in names[:100]:
        api.add_pod(pod(f"full-{n}", 1000))
    api.add_pod(pod("want", 600))

    async def body(url: str, state: ExtenderState) -> None:
        async with aiohttp.ClientSession() as s:
            for n in names[:100]:
                await bound(s, url, api, api.get_pod("default", f"full-{n}"), n)
            want = api.get_pod("default", "want")

            async def ask(window: list[str]) -> dict[str, object]:
                st, res = await post(s, url + "/filter", {"Pod": want, "NodeNames": window})
                assert st == 200, res
                return res

            for _ in range(WINDOW_MISSES):
                res = await ask(names[:100])
                assert res["NodeNames"] == [] and res["FailedNodes"] == {}
                hopeless = res["FailedAndUnresolvableNodes"]
                assert set(hopeless) == set(names[:100])
                assert all(OUTSIDE in why for why in hopeless.values())
            # the next lets kube-scheduler try preemption (n100 may be refused by its own
            # filters), and the count starts again
            res = await ask(names[:100])
            assert set(res["FailedNodes"]) == set(names[:100])
            assert not any(OUTSIDE in why for why in reasons(res).values())
            assert set((await ask(names[:100]))["FailedAndUnresolvableNodes"]) == \
                set(names[:100])
            # fewer than 100 names: every feasible node was sent, preemption as before
            res = await ask(names[:99])
            assert set(res["FailedNodes"]) == set(names[:99])
            # the window with room: chosen, and the misses forgotten
            assert (await ask(names[1:]))["NodeNames"] == ["n100"]
            assert want["metadata"]["uid"] not in state._window_misses
            # once n100 is full too, nothing outside has room: preemption as before
            api.add_pod(pod("last", 1000))
            await bound(s, url, api, api.get_pod("default", "last"), "n100")
            res = await ask(names[:100])
            assert set(res["FailedNodes"]) == set(names[:100])

    asyncio.run(serving(api, body))
