"""Fuzz what the DRA driver reads from the API server: the ResourceClaim objects
(metadata, ``status.allocation.devices.results``: pools, devices, share IDs, consumed
capacity, admin access) and the opaque ``gpuslice.io/v1alpha1`` configs in
``status.allocation.devices.config``, through the in-memory fake API server, each prepared over
the driver's real gRPC socket (so that what the parsing lets through must also make a valid
answer message).

Properties: every claim gets an answer within the timeout, devices or an error naming what is
wrong, never a failed call; a claim that prepared unprepares; after the run, valid claims of
each kind (whole GPU, MPS share, MIG partition) still prepare with the right caps."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuslice.core import dra
from tests.dra.conftest import NODE, Node, claim, opaque
from tests.dra.kubelet import DraClient
from tests.fuzz.dra_env import dra_node
from tests.fuzz.helpers import fuzz, json_values, tried


@pytest.fixture(scope="module")
def dra_env() -> Iterator[tuple[Node, DraClient]]:
    with dra_node() as env:
        yield env


SHARE = {"request": "gpu", "device": "gpu-0", "shareID": "s-1",
         "consumedCapacity": {"compute": "25", "memory": "10Gi"}}
WHOLE = {"request": "gpu", "device": "gpu-2"}
MIG = {"request": "gpu", "device": "gpu-1-mig-3g40gb-0"}
ADMIN = {"request": "mon", "device": "gpu-2", "adminAccess": True}
MPS_CONFIG = {"apiVersion": "gpuslice.io/v1alpha1", "kind": "MpsConfig",
              "mps": {"activeThreadPercentage": 20, "pinnedMemoryLimit": "5Gi"}}
GPU_CONFIG = {"apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuConfig",
              "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Short"}}}
MIG_CONFIG = {"apiVersion": "gpuslice.io/v1alpha1", "kind": "MigConfig",
              "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 50}}}
BASES = [claim("b", [SHARE], [opaque(MPS_CONFIG)]), claim("b", [WHOLE], [opaque(GPU_CONFIG)]),
         claim("b", [MIG], [opaque(MIG_CONFIG, ["gpu"])]), claim("b", [WHOLE, ADMIN]),
         claim("b", [SHARE, MIG])]

# the parts of a claim worth replacing, as paths into it
PATHS: list[list[Any]] = [
    ["metadata"], ["metadata", "uid"], ["status"], ["status", "allocation"],
    ["status", "allocation", "devices"], ["status", "allocation", "devices", "results"],
    ["status", "allocation", "devices", "config"],
    ["status", "allocation", "devices", "results", 0],
    *[["status", "allocation", "devices", "results", 0, k] for k in (
        "request", "driver", "pool", "device", "shareID", "consumedCapacity", "adminAccess")],
    ["status", "allocation", "devices", "results", 0, "consumedCapacity", "compute"],
    ["status", "allocation", "devices", "results", 0, "consumedCapacity", "memory"],
    ["status", "allocation", "devices", "results", 0, "consumedCapacity", "other"],
    ["status", "allocation", "devices", "config", 0],
    *[["status", "allocation", "devices", "config", 0, k] for k in ("requests", "opaque",
                                                                    "source")],
    ["status", "allocation", "devices", "config", 0, "opaque", "driver"],
    ["status", "allocation", "devices", "config", 0, "opaque", "parameters"],
    *[["status", "allocation", "devices", "config", 0, "opaque", "parameters", k]
      for k in ("apiVersion", "kind", "sharing", "mps", "extra")],
    *[["status", "allocation", "devices", "config", 0, "opaque", "parameters", "mps", k]
      for k in ("activeThreadPercentage", "pinnedMemoryLimit")],
    *[["status", "allocation", "devices", "config", 0, "opaque", "parameters", "sharing", k]
      for k in ("strategy", "timeSlicing", "mps")],
]

# values that a parser of Kubernetes quantities, device names and configs must survive
ODD = st.sampled_from([
    None, True, 0, -1, 2**64, 1.5, float("inf"), float("nan"), "", "0", "-25", "25", "100",
    "101", "1e999999999", "1e-999999999", "9" * 5000, "1e" + "9" * 5000, "25.5", "0.001",
    "10Gi", "1Ei", "999999Ei", "1Mi", "0Mi", "-1Gi", "1.5Ki", "+5", ".5", "5.", "Gi",
    "gpu-0", "gpu-1-mig-1g10gb-0", "gpu-2", "gpu-9", "../../gpu-0", NODE, "other-node",
    dra.DRIVER, "nic.example.com", "s-2", "a/b", "gpu/sub", [], {}, ["gpu"], [1, 2],
    {"compute": "10"}, {"memory": "1Gi", "compute": "1"}, "Exclusive", "MPS", "TimeSlicing",
    "Long", "MpsConfig", "GpuConfig", "MigConfig", "gpuslice.io/v1alpha1",
    {"strategy": "MPS", "mps": {}}, {"interval": "Medium"}, "FromClass"])
values = st.one_of(json_values, ODD)
RESULT_KEYS = [*sorted(SHARE), "driver", "pool"]


def replaced(base: dict[str, Any], path: list[Any], value: Any) -> dict[str, Any]:
    c = copy.deepcopy(base)
    cur: Any = c
    for key in path[:-1]:
        try:
            cur = cur[key]
        except (KeyError, IndexError, TypeError):
            return c
    if isinstance(cur, list) and isinstance(path[-1], int):
        if path[-1] < len(cur):
            cur[path[-1]] = value
    elif isinstance(cur, dict):
        cur[path[-1]] = value
    return c


claims = st.one_of(
    st.builds(replaced, st.sampled_from(BASES), st.sampled_from(PATHS), values),
    # two parts replaced at once
    st.builds(lambda b, p1, v1, p2, v2: replaced(replaced(b, p1, v1), p2, v2),
              st.sampled_from(BASES), st.sampled_from(PATHS), values, st.sampled_from(PATHS),
              values),
    # a claim of any shape
    st.fixed_dictionaries({"metadata": st.just({}), "status": st.one_of(
        json_values, st.fixed_dictionaries({"allocation": st.one_of(
            json_values, st.fixed_dictionaries({"devices": st.one_of(
                json_values, st.fixed_dictionaries({
                    "results": st.one_of(json_values, st.lists(st.one_of(
                        json_values, st.dictionaries(st.sampled_from(RESULT_KEYS), values,
                                                     max_size=6)), max_size=3)),
                    "config": st.one_of(json_values, st.lists(st.one_of(
                        json_values, st.fixed_dictionaries({"opaque": st.fixed_dictionaries({
                            "driver": st.just(dra.DRIVER), "parameters": values})})),
                        max_size=2)),
                }))}))}))}),
)


class Counter:
    n = 0


def prepare(node: Node, client: DraClient, doc: dict[str, Any]) -> tuple[str, Any]:
    """Put ``doc`` in the API server as a new claim and prepare it; (its UID, the answer)."""
    Counter.n += 1
    name, uid = f"fz-{Counter.n}", f"uid-fz-{Counter.n}"
    doc = copy.deepcopy(doc)
    meta = doc.get("metadata")
    if isinstance(meta, dict):
        if meta.get("uid") == "0000-b" or "uid" not in meta:
            meta["uid"] = uid  # the base's: the claim the kubelet means
        meta["name"], meta["namespace"] = name, "default"
        node.api.put_resource_claim(doc)
    else:  # the fake stores a claim by its metadata: bypass it for a claim without any
        node.api._claims[("default", name)] = doc
    try:
        got = client.prepare([("default", uid, name)])
    except grpc.RpcError as exc:
        raise AssertionError(f"the call failed: {exc.code()} {exc.details()}\nclaim: "
                             f"{json.dumps(doc, default=str)[:2000]}") from None
    return uid, got[uid]


@fuzz(1000)
@given(claims)
def test_any_claim_object_gets_devices_or_an_error_naming_the_problem(
        dra_env: tuple[Node, DraClient], doc: dict[str, Any]) -> None:
    node, client = dra_env
    tried("DRA claim objects (prepare)")
    uid, answer = prepare(node, client, doc)
    if answer.error:
        assert answer.error.startswith("claim default/fz-"), answer.error
        assert not node.driver.cdi.path(uid).exists()
    for dev in answer.devices:
        assert dev.pool_name == NODE and dev.device_name in node.driver.plan.devices
        assert list(dev.cdi_device_ids)
    # the kubelet unprepares every claim of a deleted pod
    assert client.unprepare([("default", uid, f"fz-{Counter.n}")]) == {uid: ""}
    assert node.driver.checkpoint.get(uid) is None


@fuzz(600)
@given(st.one_of(values, st.dictionaries(st.sampled_from(
    ["apiVersion", "kind", "sharing", "mps", "x"]), values, max_size=4)))
def test_opaque_configs_decode_or_are_refused_by_field(params: Any) -> None:
    tried("DRA opaque config (decode)")
    from gpuslice.core.errors import ValidationError

    try:
        dra.decode_config(params, "parameters")
    except ValidationError as exc:
        assert str(exc).startswith("parameters"), exc


def test_after_the_fuzzing_valid_claims_of_each_kind_still_prepare(
        dra_env: tuple[Node, DraClient]) -> None:
    node, client = dra_env
    assert node.driver.checkpoint.claims == {}  # every fuzzed claim was unprepared
    refs = [node.add(c) for c in (
        claim("w", [WHOLE], uid="uid-w"),
        claim("s", [SHARE], [opaque(MPS_CONFIG)], uid="uid-s"),
        claim("m", [MIG], uid="uid-m"))]
    got = client.prepare(refs)
    assert {uid: a.error for uid, a in got.items()} == {"uid-w": "", "uid-s": "", "uid-m": ""}
    env = json.loads(node.driver.cdi.path("uid-s").read_text())["devices"][0]
    caps = dict(e.split("=", 1) for e in env["containerEdits"]["env"])
    assert caps["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20"
    assert caps["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=5120M"
    assert got["uid-s"].devices[0].share_id == "s-1"
    assert set(client.unprepare(refs).values()) == {""}


@pytest.mark.parametrize(("text", "value"), [("1Ei", 2**60), ("7Ei", 7 * 2**60), ("1E", 10**18),
                                             ("2E3", 2000), ("16Gi", 16 * 2**30)])
def test_quantities_with_exa_suffixes_parse(text: str, value: int) -> None:
    """Found by the fuzzing: ``Ei`` and ``E`` were read as an exponent (ValueError)."""
    assert dra.parse_quantity(text, "q") == value


@pytest.mark.parametrize("text", ["1e999999999", "1e" + "9" * 5000, "8Ei", "9" * 30, 2**64])
def test_quantities_past_an_int64_are_refused_by_name(text: object) -> None:
    """Found by the fuzzing: decimal.Overflow, or DivisionImpossible in the arithmetic after."""
    from gpuslice.core.errors import ValidationError

    with pytest.raises(ValidationError, match=r"^memory: expected"):
        dra.parse_quantity(text, "memory")
