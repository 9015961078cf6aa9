"""The extender's replicas: only the lease holder binds; readiness, the leader label, hand-over."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp

from gpuslice.services.extender import ExtenderState
from tests.extender.helpers import (
    KEY,
    clock,
    pod,
    small_cluster,
)


def test_only_the_lease_holder_binds_and_a_standby_takes_over() -> None:
    from gpuslice.services.leader import LeaderElector

    api = small_cluster()
    api.add_pod(pod("second", 300))
    now = [1000.0]
    a = ExtenderState(api, KEY, clock=clock)
    b = ExtenderState(api, KEY, clock=clock)
    a.elector = LeaderElector(api, "gpuslice-system", "ext", "a", lambda: now[0], 15)
    b.elector = LeaderElector(api, "gpuslice-system", "ext", "b", lambda: now[0], 15)
    assert a.elector.step() is True
    assert b.elector.step() is False
    p = api.get_pod("default", "big")
    assert "not the leader" in b.bind("default", "big", p["metadata"]["uid"], "a")
    assert a.bind("default", "big", p["metadata"]["uid"], "a") == ""
    now[0] += 10
    assert a.elector.step() is True and b.elector.step() is False  # renewed in time
    now[0] += 20  # a stops renewing (it died)
    assert b.elector.step() is True
    lease = api.get_lease("gpuslice-system", "ext")
    assert lease is not None and lease["spec"]["holderIdentity"] == "b"
    assert lease["spec"]["leaseTransitions"] == 1
    b.rebuild()
    p2 = api.get_pod("default", "second")
    assert b.bind("default", "second", p2["metadata"]["uid"], "a") == ""
    assert b.ledger.free("GPU-a-0")[0] + b.ledger.free("GPU-a-1")[0] == 1000  # 700 + 300 taken


def test_every_replica_is_ready_the_leader_labels_its_pod_and_hands_over_at_once() -> None:
    """With two replicas behind one Service, kube-scheduler must reach the leader: both are
    Ready (``/readyz``: readiness is health, not leadership) and live, and the leader labels
    its own pod, which the Service selects. A leader told to stop gives its Lease up and takes
    its label off, and the follower leads and labels itself at its next step instead of after
    the Lease lapses."""
    import time

    from gpuslice.services.extender import LEADER_LABEL, serve
    from gpuslice.services.leader import LeaderElector, LeaderLabel

    ns = "gpuslice-system"
    api = small_cluster()
    states = {n: ExtenderState(api, KEY, clock=clock) for n in ("a", "b")}
    labels = {}
    for n, st in states.items():  # renewed every second, lapsing after 3 s
        st.elector = LeaderElector(api, ns, "ext", n, time.time, 3.0)
        # a restarted container: its pod still carries the label of its previous life
        api.add_pod({"metadata": {"name": f"ext-{n}", "namespace": ns,
                                  "labels": {"app.kubernetes.io/name": "gpuslice-extender",
                                             LEADER_LABEL: "leader"}},
                     "spec": {"containers": [{"name": "extender"}]}})
        labels[n] = LeaderLabel(api, ns, f"ext-{n}", LEADER_LABEL)

    def labelled() -> list[str]:
        return sorted(n for n in states if (api.get_pod(ns, f"ext-{n}")["metadata"]
                                            .get("labels") or {}).get(LEADER_LABEL) == "leader")

    async def main() -> None:
        ports: dict[str, int] = {}
        stops = {n: asyncio.Event() for n in states}
        tasks = {n: asyncio.create_task(serve(
            st, "127.0.0.1", 0, ready=lambda port, n=n: ports.__setitem__(n, port),  # type: ignore[misc]
            stop=stops[n], leader_label=labels[n])) for n, st in states.items()}

        async def until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
            end = time.monotonic() + timeout_s
            while not check():
                assert time.monotonic() < end, what
                await asyncio.sleep(0.05)

        def lead() -> list[str]:
            return [n for n, st in states.items() if st.elector and st.elector.leader]

        await until(lambda: len(ports) == 2 and len(lead()) == 1, "one leader")
        (leader,) = lead()
        follower = "b" if leader == "a" else "a"
        # the follower took the stale label off, the leader carries it
        await until(lambda: labelled() == [leader], "only the leader's pod labelled")
        async with aiohttp.ClientSession() as session:
            async def get(n: str, path: str) -> tuple[int, str]:
                async with session.get(f"http://127.0.0.1:{ports[n]}{path}") as r:
                    return r.status, await r.text()

            assert await get(leader, "/readyz") == (200, "ok: leader")
            status, text = await get(follower, "/readyz")
            assert status == 200 and text.startswith("ok: follower"), text
            assert [(await get(n, "/healthz"))[0] for n in states] == [200, 200]
            stops[leader].set()
            await asyncio.wait_for(tasks[leader], 5)
            el = states[leader].elector
            assert el is not None and el.released
            assert labels[leader].marked is False
            lease = api.get_lease(ns, "ext")
            assert lease is not None and lease["spec"]["holderIdentity"] in ("", follower)
            # the follower takes over at its next step (1 s), not after the lease's 3 s
            t0 = time.monotonic()
            await until(lambda: lead() == [follower], "the follower leads", 2.5)
            assert time.monotonic() - t0 < 2.5
            await until(lambda: labelled() == [follower], "the new leader's pod labelled", 2.0)
            assert await get(follower, "/readyz") == (200, "ok: leader")
        stops[follower].set()
        await asyncio.wait_for(tasks[follower], 5)
        assert labelled() == []

    asyncio.run(main())


def test_a_label_write_that_fails_is_tried_again_and_never_put_back_after_release() -> None:
    """The leader's label is best effort: a failed write is logged and tried again at the
    next call (the next election step); after :meth:`release`, no call puts it back."""
    from gpuslice.core.errors import GpusliceError
    from gpuslice.services.leader import LeaderLabel

    api = small_cluster()
    api.add_pod({"metadata": {"name": "ext-a", "namespace": "gpuslice-system"},
                 "spec": {"containers": [{"name": "extender"}]}})
    fail = [True]
    patch = api.patch_pod_labels

    def flaky(*args: Any, **kw: Any) -> dict[str, Any]:
        if fail[0]:
            raise GpusliceError("API server: 503 ServiceUnavailable")
        return patch(*args, **kw)

    api.patch_pod_labels = flaky  # type: ignore[method-assign]
    now = [0.0]
    label = LeaderLabel(api, "gpuslice-system", "ext-a", "gpuslice.io/extender-role",
                        refresh_s=60, clock=lambda: now[0])

    def carries() -> bool:
        return (api.get_pod("gpuslice-system", "ext-a")["metadata"].get("labels") or {}
                ).get("gpuslice.io/extender-role") == "leader"

    assert label.sync(True) is False and label.failures == 1 and not carries()
    assert label.sync(True) is False and label.failures == 2
    fail[0] = False
    assert label.sync(True) is True and label.failures == 0 and carries()
    # someone took it off: seen at the next read (every refresh_s), and put back
    api.patch_pod_labels("gpuslice-system", "ext-a", {"gpuslice.io/extender-role": None})
    assert label.sync(True) is True and not carries()  # the last write is trusted meanwhile
    now[0] += 61
    assert label.sync(True) is True and carries()
    assert label.release() is True and not carries()
    assert label.sync(True) is True and not carries()  # released: never labelled again


def test_a_leader_whose_renewal_hangs_stops_binding_before_another_may_lead() -> None:
    """A Lease read that hangs (a half-open connection: the client retries for minutes) must
    not leave the old leader binding while another replica leads. Leadership ends on the
    leader's monotonic clock a renew deadline (10 s of a 15 s lease) after the start of its
    last successful renewal, before the other replica may take the Lease (15 s after that
    renewal): between the two, nobody binds."""
    import threading

    from gpuslice.services.leader import LeaderElector

    api = small_cluster()
    wall, mono = [1000.0], [50.0]
    gate, armed = threading.Event(), threading.Event()

    class Hanging:
        """a's view of the API server: its Lease reads hang once armed."""

        def __getattr__(self, name: str) -> Any:
            return getattr(api, name)

        def get_lease(self, namespace: str, name: str) -> Any:
            if armed.is_set():
                gate.wait(30)
            return api.get_lease(namespace, name)

    a = ExtenderState(api, KEY, clock=clock)
    b = ExtenderState(api, KEY, clock=clock)
    a.elector = LeaderElector(Hanging(), "gpuslice-system", "ext", "a",  # type: ignore[arg-type]
                              lambda: wall[0], 15, mono=lambda: mono[0])
    b.elector = LeaderElector(api, "gpuslice-system", "ext", "b", lambda: wall[0], 15,
                              mono=lambda: mono[0])
    assert a.elector.step() is True
    armed.set()
    stuck = threading.Thread(target=a.elector.step, daemon=True)
    stuck.start()  # the renewal hangs from here
    p = api.get_pod("default", "big")

    def advance(s: float) -> None:
        wall[0] += s
        mono[0] += s

    advance(9)
    assert a.elector.leader  # within its renew deadline: still binds
    advance(2)
    assert not a.elector.leader  # 11 s: no longer, though no step has answered
    assert "not the leader" in a.bind("default", "big", p["metadata"]["uid"], "a")
    assert b.elector.step() is False  # the Lease is a's for 15 s: nobody leads meanwhile
    advance(5)
    assert b.elector.step() is True and not a.elector.leader  # 16 s: b takes over, alone
    assert b.bind("default", "big", p["metadata"]["uid"], "a") == ""
    gate.set()
    stuck.join(10)
    assert not a.elector.leader  # its hung read answers: b holds the Lease
