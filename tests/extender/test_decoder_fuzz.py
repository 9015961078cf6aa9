"""Property-based fuzz test of the extender's request decoding: whatever the JSON, the decoder
either understands it or raises a gpuslice error that names a field; it never crashes."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuslice.adapters.kube.annotation import AnnotationError, decode
from gpuslice.adapters.kube.objects import pod_request
from gpuslice.core.errors import GpusliceError
from gpuslice.services.extender.wire import node_names as _names
from gpuslice.services.extender.wire import victims_of as _victims

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=20)

quantities = st.one_of(st.text(max_size=6), st.integers(-5, 5000), st.integers(-10**30, 10**30),
                       st.floats(),  # NaN and infinities too
                       st.sampled_from(["1", "500", "1000", "1500", "0", "-1", "2Gi", "x", "",
                                        "1e3", ".5", "+1", "2Ei", "250n", "1e400",
                                        "99999999999999999999", "9223372036854775807",
                                        "1000000000", "9" * 400, "9e18"]))
resources = st.dictionaries(
    st.sampled_from(["gpuslice.io/gpu", "gpuslice.io/gpu-milli", "gpuslice.io/gpu-memory",
                     "cpu", "memory", "nvidia.com/gpu"]), st.one_of(quantities, json_values),
    max_size=4)
containers = st.lists(st.one_of(json_values, st.fixed_dictionaries({
    "name": st.text(max_size=5),
    "resources": st.fixed_dictionaries({"limits": resources, "requests": resources}),
})), max_size=3)
metadata = st.one_of(json_values, st.fixed_dictionaries({
    "name": st.text(max_size=8), "namespace": st.text(max_size=8),
    "annotations": st.dictionaries(
        st.sampled_from(["gpuslice.io/gpu-model", "gpuslice.io/isolation",
                         "gpuslice.io/priority", "x"]),
        st.one_of(st.text(max_size=10), json_values), max_size=3),
}))
pods = st.fixed_dictionaries({
    "metadata": metadata,
    "spec": st.one_of(json_values, st.fixed_dictionaries({"containers": containers})),
})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pods)
def test_pod_request_never_crashes(pod: dict[str, Any]) -> None:
    try:
        req = pod_request(pod)
    except GpusliceError as exc:
        assert str(exc)  # a message naming the field
        return
    if req is not None:
        assert 1 <= req.milli <= 1000 and req.gpus >= 1


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["NodeNames", "Nodes", "Pod", "x"]), json_values,
                       max_size=3))
def test_node_list_decoding_never_crashes(args: dict[str, Any]) -> None:
    try:
        names, objects = _names(args)
    except GpusliceError as exc:
        assert str(exc)
        return
    assert all(isinstance(n, str) for n in names)
    assert objects is None or set(objects) == set(names)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_annotation_decoder_never_crashes(doc: Any) -> None:
    try:
        decode(json.dumps(doc))
    except AnnotationError as exc:
        assert str(exc)


def test_a_pod_with_an_unknown_priority_is_refused_naming_the_annotation() -> None:
    import pytest

    from gpuslice.core.errors import ValidationError

    pod = {"metadata": {"name": "p", "namespace": "ml",
                        "annotations": {"gpuslice.io/priority": "urgent"}},
           "spec": {"containers": [{"name": "c", "resources": {"limits": {
               "gpuslice.io/gpu": "1", "gpuslice.io/gpu-milli": "300"}}}]}}
    with pytest.raises(ValidationError, match=r"gpuslice\.io/priority.*best-effort"):
        pod_request(pod)
    pod["metadata"]["annotations"]["gpuslice.io/priority"] = "best-effort"  # type: ignore[index]
    assert pod_request(pod) is not None


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(
    st.sampled_from(["NodeNameToMetaVictims", "NodeNameToVictims", "x"]),
    st.one_of(json_values, st.dictionaries(
        st.text(max_size=4),
        st.one_of(json_values, st.fixed_dictionaries({"Pods": json_values})), max_size=2)),
    max_size=2))
def test_victims_decoding_never_crashes(args: dict[str, Any]) -> None:
    try:
        victims, pdb = _victims(args)
    except GpusliceError as exc:
        assert str(exc)
        return
    assert all(isinstance(u, str) and u for uids in victims.values() for u in uids)
    assert set(pdb) == set(victims)
