"""Rotating the assignment key: running pods keep what the old key signed. With the old key
given as the previous one (``--previous-key-file``, the Secret's ``previous`` entry), the
extender still counts their shares (it would hand them out again otherwise) and the node
agent still executes an assignment signed with it; new assignments are signed with the new
key; a forged one verifies under neither."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice.adapters.kube.annotation import encode
from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.cli.common import read_previous_keys
from gpuslice.core.assignment import ANNOTATION, Assignment, ContainerAssignment, GpuShare, Mode
from gpuslice.core.assignment import sign as sign_with
from gpuslice.core.errors import ValidationError
from gpuslice.services.extender import ExtenderState
from tests.extender.helpers import clock, node, pod
from tests.nodeagent.test_device_plugin import env

__all__ = ["env"]  # the fixture, imported for these tests

OLD, NEW = b"old-key-0123456789abcdef", b"new-key-0123456789abcdef"


def _running(api: FakeApiServer, name: str, key: bytes, milli: int = 700) -> None:
    p = api.add_pod(pod(name, milli))
    a = Assignment("default", name, p["metadata"]["uid"], "n1", (ContainerAssignment(
        "main", Mode.MPS, (GpuShare("GPU-n1-0", milli, 8192),)),), "t0")
    api.bind("default", name, p["metadata"]["uid"], "n1", {ANNOTATION: encode(sign_with(a, key))})


def test_the_extender_counts_shares_signed_with_the_previous_key() -> None:
    api = FakeApiServer()
    api.add_node(node("n1", "A100-80GB", gpus=1))
    _running(api, "old-signed", OLD)
    _running(api, "forged", b"someone-else-0123456789", milli=200)
    without = ExtenderState(api, NEW, clock=clock)
    without.rebuild()
    assert without.ledger.free("GPU-n1-0")[0] == 1000  # its 700 would be handed out again
    rotating = ExtenderState(api, NEW, clock=clock, previous_keys=(OLD,))
    rotating.rebuild()
    assert rotating.ledger.free("GPU-n1-0")[0] == 300  # the forged 200 is still not counted
    api.add_pod(pod("next", 300))
    p = api.get_pod("default", "next")
    assert rotating.bind("default", "next", p["metadata"]["uid"], "n1") == ""
    from gpuslice.adapters.kube.annotation import decode
    from gpuslice.core.assignment import verify

    signed = decode(api.get_pod("default", "next")["metadata"]["annotations"][ANNOTATION])
    assert verify(signed, NEW) and not verify(signed, OLD)  # new ones: the new key


def test_the_node_agent_executes_what_the_previous_key_signed(env) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    from tests.nodeagent.test_device_plugin import (
        KEY,
        allocate_after_restart,
        assign,
    )

    _, plugin, server, api, sock_dir = env
    assign(api, "old-signed", ["GPU-aaa"], milli=300, key=b"retired-" + KEY)
    fresh = type(plugin)(replace(plugin.cfg, previous_keys=(b"retired-" + KEY,)), plugin.nvml,
                         api)
    r = allocate_after_restart(server, fresh, sock_dir, "GPU-aaa::0")
    assert r.envs["GPUSLICE_ASSIGNMENT"] == "ml/old-signed"


def test_the_previous_key_file_is_optional_and_checked_when_given(tmp_path: Path) -> None:
    assert read_previous_keys(None) == () and read_previous_keys(tmp_path / "absent") == ()
    (tmp_path / "previous").write_text("fedcba9876543210fedcba9876543210\n")
    assert read_previous_keys(tmp_path / "previous") == (b"fedcba9876543210fedcba9876543210",)
    (tmp_path / "short").write_text("abc")
    with pytest.raises(ValidationError, match="--previous-key-file"):
        read_previous_keys(tmp_path / "short")
