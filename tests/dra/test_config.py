"""The opaque config ``gpuslice.io/v1alpha1`` is decoded strictly: an unknown field or a bad
value makes prepare fail for that claim only, with a message naming the field (as NVIDIA's
driver decodes its configs strictly; resource/v1 types.go: configs of other drivers are
skipped, FromClass ones come before the claim's)."""

from __future__ import annotations

from typing import Any

import pytest

from gpuslice.core import dra
from gpuslice.core.errors import ValidationError
from tests.dra.conftest import Node, claim, opaque

V = "gpuslice.io/v1alpha1"


@pytest.mark.parametrize(("params", "field"), [
    ({"apiVersion": V, "kind": "GpuConfig", "sharing": {"strategy": "MPS", "spread": 1}},
     "parameters.sharing.spread"),
    ({"apiVersion": V, "kind": "GpuConfig", "sharing": {"strategy": "Fair"}},
     "parameters.sharing.strategy"),
    ({"apiVersion": V, "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing",
                                                        "timeSlicing": {"interval": "Tiny"}}},
     "parameters.sharing.timeSlicing.interval"),
    ({"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "MPS", "mps": {"activeThreadPercentage": 101}}},
     "parameters.sharing.mps.activeThreadPercentage"),
    ({"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "MPS", "mps": {"pinnedMemoryLimit": "lots"}}},
     "parameters.sharing.mps.pinnedMemoryLimit"),
    ({"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "Exclusive", "mps": {"activeThreadPercentage": 10}}},
     "parameters.sharing.mps"),
    ({"apiVersion": "gpuslice.io/v1", "kind": "GpuConfig"}, "parameters.apiVersion"),
    ({"apiVersion": V, "kind": "GPUConfig"}, "parameters.kind"),
    ({"apiVersion": V, "kind": "GpuConfig", "extra": True}, "parameters.extra"),
    ({"apiVersion": V, "kind": "MpsConfig", "sharing": {}}, "parameters.sharing"),
    ({"apiVersion": V, "kind": "MigConfig", "sharing": {"timeSlicing": {}}},
     "parameters.sharing.timeSlicing"),
    ("not an object", "parameters"),
])
def test_bad_config_names_the_field(params: Any, field: str) -> None:
    with pytest.raises(ValidationError) as err:
        dra.decode_config(params)
    assert err.value.field == field


def test_good_configs_decode() -> None:
    assert dra.decode_config({"apiVersion": V, "kind": "GpuConfig", "sharing": {
        "strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}}) == \
        dra.GpuConfig("TimeSlicing", "Long")
    assert dra.decode_config({"apiVersion": V, "kind": "MpsConfig", "mps": {
        "pinnedMemoryLimit": "1536Mi"}}) == dra.MpsConfig(dra.MpsSettings(None, 1536))


def test_a_bad_config_fails_its_claim_with_the_field_and_other_claims_go_on(node: Node) -> None:
    client = node.serve()
    bad = node.add(claim("bad", [{"request": "gpu", "device": "gpu-2"}], config=[opaque(
        {"apiVersion": V, "kind": "GpuConfig", "sharing": {"strategy": "MPS",
                                                           "mps": {"threads": 5}}})]))
    good = node.add(claim("good", [{"request": "gpu", "device": "gpu-0", "shareID": "s-1",
                                    "consumedCapacity": {"compute": "10", "memory": "1Gi"}}]))
    got = client.prepare([bad, good])
    err = got[bad[1]].error
    assert "status.allocation.devices.config[0].opaque.parameters.sharing.mps.threads" in err
    assert got[good[1]].error == ""
    assert node.driver.checkpoint.get(bad[1]) is None  # nothing reserved for it


def test_configs_of_other_drivers_are_skipped_and_the_kind_must_fit_the_device(
        node: Node) -> None:
    client = node.serve()
    foreign = {"source": "FromClass", "requests": [], "opaque": {
        "driver": "gpu.nvidia.com", "parameters": {"apiVersion": "resource.nvidia.com/v1beta1",
                                                   "kind": "GpuConfig", "whatever": 1}}}
    ok = node.add(claim("ok", [{"request": "gpu", "device": "gpu-2"}], config=[foreign]))
    wrong = node.add(claim("wrong", [{"request": "gpu", "device": "gpu-2"}], config=[opaque(
        {"apiVersion": V, "kind": "MigConfig"})], uid="uid-wrong"))
    got = client.prepare([ok])
    assert got[ok[1]].error == ""
    assert client.unprepare([ok]) == {ok[1]: ""}
    err = client.prepare([wrong])[wrong[1]].error
    assert "MigConfig does not apply to a gpu device" in err and "GpuConfig" in err


def test_config_for_a_request_applies_to_its_subrequests_and_later_configs_win() -> None:
    a, b = dra.GpuConfig("TimeSlicing"), dra.GpuConfig("MPS")
    configs = [([], a), (["gpu"], b), (["other"], dra.GpuConfig())]
    assert dra.config_for(configs, "gpu/big") == [a, b]
    assert dra.config_for(configs, "nic") == [a]
