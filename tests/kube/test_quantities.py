"""Resource quantities as the extender and the node agent read them from pods and nodes: every
form apimachinery's resource.Quantity parses, bounded as the API server holds them (an int64),
so that no pod, however written, makes a number the placement arrays cannot hold.

Source: k8s.io/apimachinery pkg/api/resource/quantity.go (ParseQuantity: the suffixes n, u, m,
k, M, G, T, P, E, Ki..Ei and decimal exponents; MilliValue rounds up) and
pkg/apis/core/validation/validation.go (ValidateResourceQuantityValue: not negative)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gpuslice.adapters.kube.objects import (
    INT64_MAX,
    node_allocatable,
    pod_cpu_memory,
    pod_request,
    quantity,
)
from gpuslice.core.errors import ValidationError
from gpuslice.core.podrequest import MAX_GPUS


@pytest.mark.parametrize(("text", "value"), [
    ("500m", 0.5), ("2", 2.0), ("4Gi", 4 * 2**30), ("1e3", 1000.0), ("+1", 1.0), (".5", 0.5),
    ("1.5G", 1.5e9), ("2Pi", 2.0 * 2**50), ("1Ei", float(2**60)), ("250n", 250e-9),
    ("3u", 3e-6), ("1E", 1e18), (7, 7.0), (0.25, 0.25),
])
def test_every_form_the_api_server_parses_is_read(text: object, value: float) -> None:
    assert math.isclose(quantity(text, "f"), value, rel_tol=1e-12)


@pytest.mark.parametrize("text", [
    "-1", "-500m", "99999999999999999999", "9" * 400, "1e400", "1e19", float("inf"),
    float("nan"), 1e300, 2**64, "x", "", "1.2.3", "5 Gi", True, None, [1],
])
def test_negative_unbounded_or_malformed_quantities_name_the_field(text: object) -> None:
    # a value not given at all (None) is said in words: "f is missing: expected ..."
    with pytest.raises(ValidationError, match=r"^f is missing: expected " if text is None
                       else r"^f: expected "):
        quantity(text, "f")


def test_the_largest_int64_is_a_quantity() -> None:
    assert quantity(str(INT64_MAX), "f") == float(INT64_MAX)


def _pod(limits: dict[str, str], requests: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "ns"},
            "spec": {"containers": [{"name": "main", "resources": {
                "limits": limits, "requests": requests or {}}}]}}


def test_a_cpu_request_past_int64_milli_cpu_is_refused_naming_it() -> None:
    # 9e15 cores is a quantity, but 9e18 milli-CPU does not fit the arrays' int64... nearly:
    # 9.3e15 cores do not
    with pytest.raises(ValidationError, match=r"pod ns/p: cpu \(milli-CPU\)"):
        pod_cpu_memory(_pod({}, {"cpu": "9300000000000000"}))
    with pytest.raises(ValidationError, match=r"pod ns/p: cpu \(milli-CPU\)"):
        pod_request(_pod({"gpuslice.io/gpu": "1"}, {"cpu": "9300000000000000"}))
    assert pod_cpu_memory(_pod({}, {"cpu": "1e3", "memory": "1Gi"})) == (1_000_000, 1024)


def test_a_gpu_count_past_the_bound_is_refused_before_anything_is_built() -> None:
    """A count in the billions would have been turned into that many GPU slots (memory in
    proportion, the extender killed); the bound is checked first."""
    with pytest.raises(ValidationError, match=f"at most {MAX_GPUS} GPUs per container"):
        pod_request(_pod({"gpuslice.io/gpu": "1000000000000000000"}))
    assert pod_request(_pod({"gpuslice.io/gpu": str(MAX_GPUS)})) is not None


def test_node_allocatable_rounds_cpu_up_and_names_a_bad_quantity() -> None:
    node = {"metadata": {"name": "n"},
            "status": {"allocatable": {"cpu": "1500u", "memory": "1048577"}}}
    assert node_allocatable(node) == (2, 1)  # MilliValue rounds up; whole MiB
    assert node_allocatable({"metadata": {"name": "n"}}) == (0, 0)
    node["status"]["allocatable"]["cpu"] = "99999999999999999999"
    with pytest.raises(ValidationError, match="node n: allocatable cpu"):
        node_allocatable(node)
    node["status"]["allocatable"]["cpu"] = "9300000000000000"  # fits int64, its milli do not
    with pytest.raises(ValidationError, match="at most 2\\^63-1 milli-CPU"):
        node_allocatable(node)
