"""KubeClient, on the official Kubernetes client, against kube-apiserver's REST API over HTTP
(tests/kube/rest_fake.py): paths, verbs, media types, error codes, watches and RBAC."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kubernetes", reason="the Kubernetes client (gpuslice[kube]) is needed")

from gpuslice.adapters.kube.client import KubeClient
from gpuslice.adapters.kube.fake import ApiConflict, ApiNotFound
from gpuslice.core.errors import GpusliceError
from tests.kube.helpers import EXTENDER, NODE_AGENT, RECONFIG, self_signed
from tests.kube.helpers import kube_client as client
from tests.kube.rest_fake import RestApiServer


def pod(name: str, ns: str = "ml", node: str = "", **annotations: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "annotations": dict(annotations)},
            "spec": {"containers": [{"name": "main", "image": "registry.local/model:1"}],
                     **({"nodeName": node} if node else {})}}


def node(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}}


def test_pods_and_nodes_read_and_patched_with_optimistic_concurrency(
        rest: RestApiServer, tmp_path: Path) -> None:
    rest.add_node(node("n1"))
    rest.add_pod(pod("a", node="n1", keep="yes"))
    rest.add_pod(pod("b"))
    api = client(rest, tmp_path)
    assert sorted(p["metadata"]["name"] for p in api.list_pods()) == ["a", "b"]
    assert [p["metadata"]["name"] for p in api.list_pods(node="n1")] == ["a"]
    a = api.get_pod("ml", "a")
    assert a["spec"]["containers"][0]["image"] == "registry.local/model:1"
    out = api.patch_pod_annotations("ml", "a", {"gpuslice.io/x": "1"},
                                    a["metadata"]["resourceVersion"])
    assert out["metadata"]["annotations"] == {"keep": "yes", "gpuslice.io/x": "1"}
    with pytest.raises(ApiConflict):  # written from a stale read
        api.patch_pod_annotations("ml", "a", {"gpuslice.io/x": "2"},
                                  a["metadata"]["resourceVersion"])
    with pytest.raises(ApiNotFound):
        api.get_pod("ml", "nope")
    api.patch_node("n1", {"nvidia.com/gpu.count": "2"}, {"gpuslice.io/inventory": "[]"})
    meta = api.list_nodes()[0]["metadata"]
    assert meta["labels"] == {"kubernetes.io/hostname": "n1", "nvidia.com/gpu.count": "2"}
    assert meta["annotations"] == {"gpuslice.io/inventory": "[]"}
    patches = {ct for _, verb, _, ct in rest.requests if verb == "PATCH"}
    assert patches == {"application/strategic-merge-patch+json"}, patches


def test_pod_labels_set_and_removed_with_a_json_merge_patch_on_the_own_namespace_only(
        rest: RestApiServer, tmp_path: Path) -> None:
    """The extender leader's label on its own pod: a JSON merge patch (``null`` removes, an
    absent label removed is no error), in gpuslice-system. Elsewhere the extender's account
    patches pods only for the requeue annotation on a pending pod its filter refused
    (services/extender/requeue.py; a cluster-wide ``pods: patch``), and never deletes one."""
    rest.add_pod(pod("ext-a", ns="gpuslice-system"))
    rest.add_pod(pod("victim", ns="ml"))
    api = client(rest, tmp_path, EXTENDER)
    role = "gpuslice.io/extender-role"
    out = api.patch_pod_labels("gpuslice-system", "ext-a", {role: "leader"})
    assert out["metadata"]["labels"] == {role: "leader"}
    assert out["metadata"]["annotations"] == {}  # the rest of the pod stays
    api.patch_pod_labels("gpuslice-system", "ext-a", {role: None})
    api.patch_pod_labels("gpuslice-system", "ext-a", {role: None})  # gone already: no error
    assert not rest.get_pod("gpuslice-system", "ext-a")["metadata"].get("labels")
    with pytest.raises(ApiNotFound):
        api.patch_pod_labels("gpuslice-system", "nope", {role: None})
    assert rest.denied == []
    from gpuslice.services.extender.requeue import REQUEUE_ANNOTATION

    victim = rest.get_pod("ml", "victim")
    out = api.patch_pod_annotations("ml", "victim", {REQUEUE_ANNOTATION: "t"},
                                    victim["metadata"]["resourceVersion"])
    assert out["metadata"]["annotations"] == {REQUEUE_ANNOTATION: "t"}
    assert rest.denied == []
    with pytest.raises(GpusliceError, match="403"):  # another namespace's pods: no deletion
        api.delete_pod("ml", "victim")
    assert not rest.get_pod("ml", "victim")["metadata"].get("labels")
    patches = {ct for _, verb, _, ct in rest.requests if verb == "PATCH"}
    assert patches == {"application/strategic-merge-patch+json"}, patches


def test_leases_create_renew_and_refuse_a_stale_writer(rest: RestApiServer,
                                                       tmp_path: Path) -> None:
    api = client(rest, tmp_path)
    assert api.get_lease("gpuslice-system", "gpuslice-extender") is None
    spec = {"holderIdentity": "a", "leaseDurationSeconds": 15,
            "renewTime": "2026-11-23T01:00:00.000000Z", "leaseTransitions": 0}
    first = api.put_lease("gpuslice-system", "gpuslice-extender", spec, None)
    with pytest.raises(ApiConflict):  # created meanwhile by someone else
        api.put_lease("gpuslice-system", "gpuslice-extender", spec, None)
    got = api.get_lease("gpuslice-system", "gpuslice-extender")
    assert got is not None and got["spec"]["holderIdentity"] == "a"
    # the extender parses the MicroTime that comes back
    from datetime import datetime

    assert datetime.fromisoformat(got["spec"]["renewTime"].replace("Z", "+00:00")).year == 2026
    api.put_lease("gpuslice-system", "gpuslice-extender", dict(spec, holderIdentity="b"),
                  first["metadata"]["resourceVersion"])
    with pytest.raises(ApiConflict):
        api.put_lease("gpuslice-system", "gpuslice-extender", spec,
                      first["metadata"]["resourceVersion"])


def test_watch_hands_over_pod_and_node_events_as_they_come_and_a_410_raises(
        rest: RestApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuslice.adapters.kube import client as kube_client

    monkeypatch.setattr(kube_client._Follower, "WINDOW_S", 1)  # short stream windows
    api = client(rest, tmp_path)
    events, since = api.watch("", 0.5)
    assert events == [] and since
    threading.Timer(0.3, lambda: rest.add_pod(pod("late"))).start()
    threading.Timer(0.4, lambda: rest.add_node(node("n9"))).start()
    seen: list[tuple[str, str, str]] = []
    t0 = time.monotonic()
    while len(seen) < 2 and time.monotonic() - t0 < 10:
        events, since = api.watch(since, 5.0)
        seen += [(e.type, e.kind, e.obj["metadata"]["name"]) for e in events]
    assert time.monotonic() - t0 < 3  # handed over as they come, not at the timeout
    assert sorted(seen) == [("ADDED", "Node", "n9"), ("ADDED", "Pod", "late")]
    rest.delete_pod("ml", "late")
    events, since = api.watch(since, 5.0)
    assert [(e.type, e.kind) for e in events] == [("DELETED", "Pod")]
    time.sleep(1.5)  # a new stream window starts from the last event's resourceVersion
    rest.add_pod(pod("after-window"))
    events, since = api.watch(since, 5.0)
    assert [e.obj["metadata"]["name"] for e in events] == ["after-window"]
    rest.patch_node("n9", {"x": "y"}, {})  # the pod watch is now behind the latest version
    rest.compacted = int(rest.current_rv())  # and etcd compacted past where it is
    with pytest.raises(GpusliceError, match="410"):
        for _ in range(10):
            api.watch(since, 1.0)
    events, since = api.watch("", 0.2)  # the caller re-reads, then starts again
    rest.compacted = 0
    rest.add_pod(pod("fresh"))
    events, _ = api.watch(since, 5.0)
    assert [e.obj["metadata"]["name"] for e in events] == ["fresh"]
    api.close()


def test_watch_batches_what_comes_within_the_linger_up_to_the_batch_size(
        rest: RestApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Events that come while a batch lingers after its first go out with it (one hand-over
    to the caller's thread instead of one each), at most ``BATCH`` of them."""
    from gpuslice.adapters.kube.client import KubeClient

    monkeypatch.setattr(KubeClient, "LINGER_S", 2.0)  # generous: a loaded machine is slow
    monkeypatch.setattr(KubeClient, "BATCH", 3)
    api = client(rest, tmp_path)
    _, since = api.watch("", 0.5)

    def add() -> None:
        for k in range(4):
            rest.add_pod(pod(f"b{k}"))
            time.sleep(0.02)

    threading.Thread(target=add).start()
    first, since = api.watch(since, 5.0)
    assert [e.obj["metadata"]["name"] for e in first] == ["b0", "b1", "b2"]
    rest_, _ = api.watch(since, 5.0)
    assert [e.obj["metadata"]["name"] for e in rest_] == ["b3"]
    api.close()


def test_a_mirror_lists_once_follows_the_watch_serves_our_writes_and_relists_on_410(
        rest: RestApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuslice.adapters.kube import client as kube_client
    from gpuslice.adapters.kube import mirror as kube_mirror
    from gpuslice.adapters.kube.mirror import Mirror

    monkeypatch.setattr(kube_client._Follower, "WINDOW_S", 1)  # short stream windows
    api = client(rest, tmp_path)
    rest.add_pod(pod("a"))
    rest.add_pod(pod("b"))
    m = Mirror(api, api._api.list_pod_for_all_namespaces, "Pod")

    def names() -> set[str]:
        return {p["metadata"]["name"] for p in m.items()}

    def soon(cond: Any) -> None:
        t0 = time.monotonic()
        while not cond():
            assert time.monotonic() - t0 < 10, "the mirror did not follow"
            time.sleep(0.05)

    assert names() == {"a", "b"} and m.lists == 1
    rest.add_pod(pod("c"))
    rest.delete_pod("ml", "a")
    soon(lambda: names() == {"b", "c"})
    assert m.lists == 1  # followed, not listed again
    # our write is served at once, and stays until the watch brings that version
    b = next(p for p in m.items() if p["metadata"]["name"] == "b")
    mine = {**b, "metadata": {**b["metadata"], "resourceVersion": "999999",
                              "annotations": {"ours": "yes"}}}
    m.wrote(mine)
    assert next(p for p in m.items() if p["metadata"]["name"] == "b") is mine
    monkeypatch.setattr(kube_mirror, "WRITTEN_S", 0.0)  # never brought: the watch's wins
    time.sleep(0.01)
    got = next(p for p in m.items() if p["metadata"]["name"] == "b")
    assert (got["metadata"].get("annotations") or {}).get("ours") is None
    monkeypatch.setattr(kube_mirror, "WRITTEN_S", 30.0)
    new = rest.patch_pod_annotations("ml", "b", {"x": "1"},
                                     b["metadata"]["resourceVersion"])
    m.wrote(new)  # a real write: dropped once its own event arrives
    soon(lambda: (m.items(), not m._written)[1])
    assert next(p for p in m.items() if p["metadata"]["name"] == "b")["metadata"][
        "annotations"]["x"] == "1"
    # a broken watch (compacted past it): the next read lists again
    rest.compacted = int(rest.current_rv()) + 1
    soon(lambda: (m.items(), m.lists)[1] >= 2)
    rest.compacted = 0
    rest.add_pod(pod("d"))
    soon(lambda: names() == {"b", "c", "d"})
    m.close()
    api.close()


def test_create_bind_evict_and_their_refusals(rest: RestApiServer, tmp_path: Path) -> None:
    rest.add_node(node("n1"))
    api = client(rest, tmp_path)
    bad = pod("x")
    del bad["spec"]["containers"][0]["image"]
    with pytest.raises(GpusliceError, match="422"):
        api.create_pod(bad)
    made = api.create_pod(pod("x"))
    assert made["status"]["phase"] == "Pending" and made["metadata"]["uid"]
    with pytest.raises(ApiConflict):
        api.create_pod(pod("x"))
    with pytest.raises(ApiConflict):  # the pod was replaced: another UID
        api.bind("ml", "x", "some-other-uid", "n1")
    rv = made["metadata"]["resourceVersion"]
    rest.patch_pod_annotations("ml", "x", {"other": "writer"}, rv)  # changed since read
    with pytest.raises(ApiConflict):  # the resourceVersion precondition
        api.bind("ml", "x", made["metadata"]["uid"], "n1", {"gpuslice.io/assignment": "a"}, rv)
    fresh = rest.get_pod("ml", "x")
    api.bind("ml", "x", made["metadata"]["uid"], "n1", {"gpuslice.io/assignment": "a"},
             fresh["metadata"]["resourceVersion"])
    bound = rest.get_pod("ml", "x")  # node and annotation in one write
    assert bound["spec"]["nodeName"] == "n1"
    assert bound["metadata"]["annotations"] == {"other": "writer", "gpuslice.io/assignment": "a"}
    with pytest.raises(ApiConflict):
        api.bind("ml", "x", made["metadata"]["uid"], "n1")
    rest.disruption_blocked.add(("ml", "x"))
    with pytest.raises(GpusliceError, match="429"):
        api.delete_pod("ml", "x")
    rest.disruption_blocked.clear()
    api.delete_pod("ml", "x")
    api.delete_pod("ml", "x")  # gone already: nothing to do
    assert rest.list_pods() == []


def test_calls_reuse_one_kept_alive_connection(rest: RestApiServer, tmp_path: Path) -> None:
    """Binds and reads one after another go over one connection: a response
    left unread (the bind's) kept its connection out of the pool, so every bind opened (and,
    over TLS, handshook) a new one; measured in the extender as a quarter of its CPU."""
    rest.add_node(node("n1"))
    api = client(rest, tmp_path)
    for i in range(5):
        made = api.create_pod(pod(f"p{i}"))
        api.get_pod("ml", f"p{i}")
        api.bind("ml", f"p{i}", made["metadata"]["uid"], "n1")
    http = api._api_client.rest_client.pool_manager
    made_connections = http.connection_from_url(api._api_client.configuration.host).num_connections
    assert made_connections == 1, made_connections


def test_custom_object_status_and_deployments(rest: RestApiServer, tmp_path: Path) -> None:
    rest.replace_custom("sliceschedules", {
        "apiVersion": "gpuslice.io/v1alpha1", "kind": "SliceSchedule",
        "metadata": {"name": "day-night", "namespace": "gpuslice"},
        "spec": {"layouts": {"batch": {"mig": {"mig-devices": {"7g.80gb": 1}}}}}})
    api = client(rest, tmp_path)
    [obj] = api.list_custom("sliceschedules")
    assert api.get_custom("sliceschedules", "gpuslice", "day-night") == obj
    changed = dict(obj, spec={"layouts": {}}, status={"target": "batch"})
    out = api.replace_custom("sliceschedules", changed)
    assert out["status"] == {"target": "batch"} and out["spec"] == obj["spec"]  # status only
    with pytest.raises(ApiConflict):
        api.replace_custom("sliceschedules", dict(obj, status={"target": "x"}))
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment",
                  "metadata": {"name": "svc", "namespace": "ml"},
                  "spec": {"selector": {"matchLabels": {"app": "svc"}}, "template": {
                      "metadata": {"labels": {"app": "svc"}},
                      "spec": {"containers": [{"name": "m", "image": "i"}]}}}}
    api.create_deployment(deployment)
    assert [d["metadata"]["name"] for d in api.list_deployments("ml")] == ["svc"]
    api.delete_deployment("ml", "svc")
    api.delete_deployment("ml", "svc")
    assert api.list_deployments("ml") == []


def test_clients_with_different_credentials_keep_them(rest: RestApiServer,
                                                      tmp_path: Path) -> None:
    """Two clients in one process (the tests, or a tool holding two contexts) must not share
    one global configuration: each call goes out with its own client's token."""
    agent = client(rest, tmp_path, NODE_AGENT)
    client(rest, tmp_path, EXTENDER)
    rest.add_node(node("n1"))
    agent.patch_node("n1", {"a": "b"}, {})
    assert rest.requests[-1][0] == NODE_AGENT
    with pytest.raises(GpusliceError, match="403"):  # the node agent has no lease rights
        agent.get_lease("gpuslice-system", "gpuslice-extender")
    assert rest.requests[-1][0] == NODE_AGENT


def test_bad_credentials_and_configuration_are_clear_errors(rest: RestApiServer,
                                                            tmp_path: Path) -> None:
    with pytest.raises(GpusliceError, match="401"):
        client(rest, tmp_path, "sa:gpuslice-system:nobody").list_nodes()
    missing = tmp_path / "no-such-kubeconfig"
    with pytest.raises(GpusliceError, match="Kubernetes configuration"):
        KubeClient(str(missing))


@pytest.mark.parametrize("token,calls", [
    (EXTENDER, ["list_nodes", "list_pods", "get_pod", "bind_annotated", "watch", "lease",
                "list_pdbs"]),
    (NODE_AGENT, ["list_pods_node", "get_node", "patch_node"]),
    (RECONFIG, ["list_custom", "replace_custom", "list_pods", "get_pod", "patch_pod",
                "create_pod", "delete_pod", "patch_node", "list_nodes"]),
])
def test_each_service_account_may_make_the_calls_its_component_makes(
        rest: RestApiServer, tmp_path: Path, token: str, calls: list[str]) -> None:
    """The deploy/base RBAC against each component's calls, verb by verb."""
    rest.add_node(node("n1"))
    target = rest.add_pod(pod("p", node=""))
    rest.replace_custom("sliceschedules", {
        "apiVersion": "gpuslice.io/v1alpha1", "kind": "SliceSchedule",
        "metadata": {"name": "s", "namespace": "gpuslice"}, "spec": {"layouts": {"x": {}}}})
    api = client(rest, tmp_path, token)
    for call in calls:
        if call == "list_nodes":
            api.list_nodes()
        elif call == "list_pods":
            api.list_pods()
        elif call == "list_pods_node":
            api.list_pods(node="n1")
        elif call == "get_node":
            api.get_node("n1")
        elif call == "get_pod":
            api.get_pod("ml", "p")
        elif call == "patch_pod":
            cur = rest.get_pod("ml", "p")
            api.patch_pod_annotations("ml", "p", {"k": "v"}, cur["metadata"]["resourceVersion"])
        elif call == "bind_annotated":  # the extender's one write (pods/binding only)
            cur = rest.get_pod("ml", "p")
            api.bind("ml", "p", target["metadata"]["uid"], "n1", {"gpuslice.io/assignment": "a"},
                     cur["metadata"]["resourceVersion"])
        elif call == "watch":
            api.watch("", 0.5)
        elif call == "list_pdbs":
            assert api.list_pod_disruption_budgets("ml") == []
        elif call == "lease":
            api.put_lease("gpuslice-system", "gpuslice-extender", {"holderIdentity": "x"}, None)
            api.get_lease("gpuslice-system", "gpuslice-extender")
        elif call == "patch_node":
            api.patch_node("n1", {"l": "v"}, {"a": "v"})
        elif call == "list_custom":
            api.list_custom("sliceschedules")
        elif call == "replace_custom":
            [obj] = api.list_custom("sliceschedules")
            api.replace_custom("sliceschedules", dict(obj, status={"target": "x"}))
        elif call == "create_pod":
            api.create_pod(pod("q"))
        elif call == "delete_pod":
            api.delete_pod("ml", "q")
    assert rest.denied == []


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
def test_in_cluster_configuration_over_https_verifies_the_server(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """How the extender and node agent run in a cluster: no kubeconfig, the service account's
    token and CA from the pod's mounted files and the API server from the environment."""
    from kubernetes.config import incluster_config

    for name in ("ca", "other"):
        self_signed(tmp_path, name)
    rest = RestApiServer(tls=(tmp_path / "ca.crt", tmp_path / "ca.key")).start()
    try:
        rest.add_node(node("n1"))
        (tmp_path / "token").write_text(NODE_AGENT)
        monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
        monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(tmp_path / "ca.crt"))
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(rest.port))
        api = KubeClient()
        assert api.get_node("n1")["metadata"]["name"] == "n1"
        assert rest.requests[-1][0] == NODE_AGENT  # the mounted token went with the call
        # a server the mounted CA did not sign is refused, with the reason
        monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME",
                            str(tmp_path / "other.crt"))
        with pytest.raises(GpusliceError, match=r"unreachable.*(CERTIFICATE|certificate)"):
            KubeClient().get_node("n1")
        # outside a pod: $KUBECONFIG (here a file that is not there), as kubectl
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
        monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-file"))
        with pytest.raises(GpusliceError, match="Kubernetes configuration"):
            KubeClient()
    finally:
        rest.stop()


def test_outside_a_pod_the_default_kubeconfig_is_kubectls(
        rest: RestApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`kubectl gpuslice status` and `gpuslice replan --apply` run from a laptop: no
    --kubeconfig means $KUBECONFIG (or ~/.kube/config), not the in-cluster configuration."""
    from gpuslice.adapters.kube.annotation import encode
    from gpuslice.core.assignment import Assignment, ContainerAssignment, GpuShare, Mode, sign
    from gpuslice.kubectl_plugin import main

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(rest.kubeconfig(tmp_path / "user-config")))
    inv = '[{"uuid": "GPU-1", "index": 0, "model": "T4", "memoryMiB": 15360}]'
    rest.add_node({"apiVersion": "v1", "kind": "Node",
                   "metadata": {"name": "t4-a", "annotations": {"gpuslice.io/inventory": inv}}})
    a = sign(Assignment("ml", "resnet-0", "u0", "t4-a", (ContainerAssignment(
        "main", Mode.MPS, (GpuShare("GPU-1", 250, 4096),)),), "t"), b"key-0123456789abcdef")
    rest.add_pod(pod("resnet-0", node="t4-a", **{"gpuslice.io/assignment": encode(a)}))
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "ml/resnet-0 (250 mps)" in out
    assert rest.requests[-1][0] == "admin"


def test_a_late_answer_to_an_earlier_write_never_hides_a_later_version(
        rest: RestApiServer, tmp_path: Path) -> None:
    """Mirror.wrote orders versions as CompareResourceVersion (apimachinery
    pkg/util/resourceversion) does: the answer to an earlier write that a thread hands over
    after the answer to a later one (the claim allocator's early finalizer, then its
    allocation), or after the watch brought a later version, is not served in their place;
    the watch bringing a version past ours drops ours."""
    from gpuslice.adapters.kube.mirror import Mirror, rv_order

    assert rv_order("9", "10") == -1 and rv_order("10", "10") == 0 and rv_order("11", "9") == 1
    assert rv_order("010", "9") is None and rv_order("", "1") is None
    assert rv_order(None, "1") is None
    api = client(rest, tmp_path)
    rest.add_pod(pod("a"))
    m = Mirror(api, api._api.list_pod_for_all_namespaces, "Pod")

    def served() -> dict[str, Any]:
        return next(p for p in m.items() if p["metadata"]["name"] == "a")

    a = served()
    rv = int(a["metadata"]["resourceVersion"])

    def version(n: int, mark: str) -> dict[str, Any]:
        return {**a, "metadata": {**a["metadata"], "resourceVersion": str(n),
                                  "annotations": {"mark": mark}}}

    later, earlier = version(rv + 1000, "later"), version(rv + 500, "earlier")
    m.wrote(later)
    m.wrote(earlier)  # handed over late: the later answer stays
    assert served() is later
    m.wrote(version(rv, "old"))  # no newer than what the watch already brought: not kept
    assert served() is later
    # the watch passing our version (someone else's change after ours) drops ours
    cur = a["metadata"]["resourceVersion"]
    for _ in range(3):
        cur = rest.patch_pod_annotations("ml", "a", {"x": "1"}, cur)["metadata"][
            "resourceVersion"]
    m._written.clear()
    m.wrote(version(rv + 1, "ours"))
    t0 = time.monotonic()
    while m._written:
        assert time.monotonic() - t0 < 10, "the watch's later version did not win"
        m.items()
        time.sleep(0.05)
    assert served()["metadata"]["annotations"]["x"] == "1"
    m.close()
    api.close()
