"""The webhook's wire format (admission.k8s.io/v1, k8s.io/api admission/v1 types.go) and its
answer as kube-apiserver checks it (``VerifyAdmissionResponse`` in k8s.io/apiserver
pkg/admission/plugin/webhook/request/admissionreview.go): the response's apiVersion and kind,
the uid copied, patch and patchType together, the patch an RFC 6902 document that applies to
the pod; every malformed review answered, never raised (a fuzz over the review's shape)."""

from __future__ import annotations

import base64
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuslice.adapters.kube.jsonpatch import apply_json_patch
from gpuslice.adapters.kube.objects import pod_request
from gpuslice.core.admission import Options
from gpuslice.devcluster.nodes import gpu_node
from gpuslice.services.webhook import fleet_from_nodes, review_of

FLEET = fleet_from_nodes([gpu_node("a", "L4", 2), gpu_node("b", "A100-80GB", 1)])


def review(pod: Any, *, uid: str = "705ab4f5-6393-11e8-b7cc-42010a800002",
           operation: str = "CREATE", kind: str = "Pod", namespace: str = "ml") -> bytes:
    """An AdmissionReview as kube-apiserver sends it (CreateV1AdmissionReview)."""
    return json.dumps({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": uid, "kind": {"group": "", "version": "v1", "kind": kind},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": kind},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": namespace, "operation": operation,
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller",
                         "groups": ["system:serviceaccounts"]},
            "object": pod, "oldObject": None, "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}}}).encode()


def stock_pod(limits: dict[str, str], annotations: dict[str, str] | None = None,
              name: str = "") -> dict[str, Any]:
    """A pod as the ReplicaSet controller creates it: generateName, no name yet, defaulted
    (requests copied from limits, the default scheduler)."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"generateName": "server-7d9f-", "name": name, "namespace": "ml",
                         "labels": {"app": "server", "gpuslice.io/webhook": "enabled"},
                         **({"annotations": annotations} if annotations else {})},
            "spec": {"schedulerName": "default-scheduler", "containers": [
                {"name": "server", "image": "vllm/vllm-openai:v0.6",
                 "resources": {"limits": {"cpu": "4", **limits},
                               "requests": {"cpu": "4", **limits}}}]}}


def test_a_mutation_is_answered_as_the_api_server_checks_it() -> None:
    pod = stock_pod({"gpuslice.io/gpu-milli": "250"})
    doc, result = review_of(review(pod), FLEET, Options())
    assert result == "mutated"
    assert (doc["apiVersion"], doc["kind"]) == ("admission.k8s.io/v1", "AdmissionReview")
    resp = doc["response"]
    assert resp["uid"] == "705ab4f5-6393-11e8-b7cc-42010a800002" and resp["allowed"] is True
    assert resp["patchType"] == "JSONPatch" and "status" not in resp
    ops = json.loads(base64.b64decode(resp["patch"]))
    assert all(op["op"] == "add" and op["path"].startswith("/") for op in ops)
    patched = apply_json_patch(pod, ops)
    assert patched["spec"]["schedulerName"] == "gpuslice-scheduler"
    res = patched["spec"]["containers"][0]["resources"]
    want = {"cpu": "4", "gpuslice.io/gpu": "1", "gpuslice.io/gpu-milli": "250",
            "gpuslice.io/gpu-memory": "6144"}
    assert res == {"limits": want, "requests": want}
    assert "gpuslice.io/webhook-changes" in patched["metadata"]["annotations"]
    req = pod_request(patched)  # the extender reads what the webhook made
    assert req is not None and (req.milli, req.gpu_memory_mib) == (250, 6144)
    # a second pass (reinvocation, or an already mutated pod) changes nothing
    again, result = review_of(review(patched), FLEET, Options())
    assert result == "unchanged" and "patch" not in again["response"]
    assert "patchType" not in again["response"]


def test_plain_requests_are_translated_and_their_nvidia_resource_removed() -> None:
    pod = stock_pod({"nvidia.com/gpu": "1"}, {"gpuslice.io/gpu-milli": "500"})
    doc, _ = review_of(review(pod), FLEET, Options())
    patched = apply_json_patch(pod, json.loads(base64.b64decode(doc["response"]["patch"])))
    limits = patched["spec"]["containers"][0]["resources"]["limits"]
    assert "nvidia.com/gpu" not in limits and limits["gpuslice.io/gpu-milli"] == "500"
    assert limits["gpuslice.io/gpu-memory"] == "12288"  # half of the smallest, an L4


def test_a_refusal_names_the_field_and_carries_no_patch() -> None:
    doc, result = review_of(review(stock_pod({"gpuslice.io/gpu-milli": "1500"})), FLEET,
                            Options())
    resp = doc["response"]
    assert result == "refused" and resp["allowed"] is False
    assert "patch" not in resp and "patchType" not in resp
    assert resp["status"]["code"] == 403
    msg = resp["status"]["message"]
    assert msg.startswith("pod ml/server-7d9f-<generated>: spec.containers[0].resources "
                          "gpuslice.io/gpu-milli"), msg


def test_an_init_container_is_named_by_its_own_field() -> None:
    pod = stock_pod({})
    pod["spec"]["initContainers"] = [{"name": "warm", "image": "x", "resources": {
        "limits": {"gpuslice.io/gpu-milli": "abc"}}}]
    doc, _ = review_of(review(pod), FLEET, Options())
    assert "initContainers[0]" in doc["response"]["status"]["message"]


def test_other_operations_and_kinds_pass_untouched() -> None:
    pod = stock_pod({"gpuslice.io/gpu-milli": "1500"})
    for raw in (review(pod, operation="UPDATE"), review(pod, kind="Binding"),
                review(None, operation="DELETE")):
        doc, result = review_of(raw, FLEET, Options())
        assert result == "unchanged" and doc["response"]["allowed"] is True


def test_warnings_reach_the_client_within_the_api_servers_length() -> None:
    pod = stock_pod({"gpuslice.io/gpu-milli": "250"}, {"gpuslice.io/gpu-model": "H100-SXM"})
    doc, result = review_of(review(pod), FLEET, Options())
    assert result == "mutated"
    assert doc["response"]["warnings"] and all(len(w) <= 256
                                               for w in doc["response"]["warnings"])


BAD = [b"", b"{", b"[]", b"null", b'"x"', b"\xff\xfe",
       b'{"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {}}',
       b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}',
       b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": []}',
       b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", '
       b'"request": {"uid": 5}}',
       b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", '
       b'"request": {"uid": "u", "operation": "CREATE", "object": 7}}']


def test_a_review_that_cannot_be_read_is_answered_with_why() -> None:
    for body in BAD:
        doc, result = review_of(body, FLEET, Options())
        resp = doc["response"]
        assert result == "bad-review" and resp["allowed"] is False, body
        assert resp["status"]["code"] == 400 and resp["status"]["message"], body
    doc, _ = review_of(BAD[-1], FLEET, Options())
    assert doc["response"]["uid"] == "u"  # copied when there was one


scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**20),
                    st.floats(), st.text(max_size=10))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=15)
quantities = st.one_of(json_values, st.sampled_from(
    ["1", "250", "1500", "-1", "0", "2Gi", "1e400", "9" * 40, "0.5", "x"]))
resource_maps = st.dictionaries(st.sampled_from(
    ["gpuslice.io/gpu", "gpuslice.io/gpu-milli", "gpuslice.io/gpu-memory", "nvidia.com/gpu",
     "nvidia.com/gpucores", "nvidia.com/gpumem", "nvidia.com/gpumem-percentage", "cpu"]),
    quantities, max_size=4)
containers = st.lists(st.one_of(json_values, st.fixed_dictionaries({
    "name": st.text(max_size=4),
    "restartPolicy": st.sampled_from([None, "Always", "Never"]),
    "resources": st.one_of(json_values, st.fixed_dictionaries({
        "limits": resource_maps, "requests": resource_maps}))})), max_size=3)
annotations = st.one_of(json_values, st.dictionaries(st.sampled_from(
    ["gpuslice.io/gpu-milli", "gpuslice.io/gpu-memory", "gpuslice.io/gpu-model",
     "gpuslice.io/gpu-model-exclude", "gpuslice.io/gpu-uuid", "nvidia.com/use-gputype",
     "gpuslice.io/mig-profile", "gpuslice.io/isolation", "gpuslice.io/processes"]),
    st.one_of(st.text(max_size=8), json_values), max_size=4))
pods = st.fixed_dictionaries({
    "metadata": st.one_of(json_values, st.fixed_dictionaries({
        "name": st.one_of(st.text(max_size=5), json_values), "annotations": annotations})),
    "spec": st.one_of(json_values, st.fixed_dictionaries({
        "schedulerName": st.one_of(st.sampled_from(["", "default-scheduler",
                                                    "gpuslice-scheduler", "other"]),
                                   json_values),
        "containers": containers, "initContainers": containers})),
})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pod=pods, namespace=st.one_of(st.text(max_size=5), json_values))
def test_whatever_the_pod_the_answer_is_a_review(pod: dict[str, Any], namespace: Any) -> None:
    body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                       "request": {"uid": "u", "kind": {"kind": "Pod"},
                                   "operation": "CREATE", "namespace": namespace,
                                   "object": pod}}).encode()
    doc, result = review_of(body, FLEET, Options())
    resp = doc["response"]
    assert resp["uid"] in ("u", "") and isinstance(resp["allowed"], bool)
    if result == "mutated":
        patched = apply_json_patch(pod, json.loads(base64.b64decode(resp["patch"])))
        patched["metadata"]["namespace"] = "ml"
        assert pod_request(patched) is not None
    elif not resp["allowed"]:
        assert resp["status"]["message"]
