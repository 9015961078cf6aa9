from __future__ import annotations

import json
from dataclasses import replace

import pytest

from gpuslice.adapters.kube.annotation import AnnotationError, decode, encode
from gpuslice.core.assignment import (
    Assignment,
    ContainerAssignment,
    GpuShare,
    Mode,
    canonical,
    sign,
    verify,
)
from gpuslice.core.errors import ValidationError
from gpuslice.core.ledger import Conflict, GpuSlot, Ledger

KEY = b"0123456789abcdef-shared-secret"


def make(pod: str = "p", milli: int = 500, uuid: str = "GPU-a", node: str = "n1",
         t: str = "2026-11-22T18:00:00Z") -> Assignment:
    return Assignment("ns", pod, f"uid-{pod}", node,
                      (ContainerAssignment("c", Mode.MPS, (GpuShare(uuid, milli, 4096),)),), t)


def test_sign_verify_and_tamper() -> None:
    a = sign(make(), KEY)
    assert verify(a, KEY)
    assert not verify(a, b"another-key-of-16-bytes")
    forged = replace(a, containers=(ContainerAssignment(
        "c", Mode.MPS, (GpuShare("GPU-a", 900, 4096),)),))
    assert not verify(forged, KEY)
    assert not verify(make(), KEY)  # unsigned
    with pytest.raises(ValidationError, match="key"):
        sign(make(), b"short")


def test_canonical_is_order_independent() -> None:
    g1, g2 = GpuShare("GPU-a", 1000, 0), GpuShare("GPU-b", 1000, 0)
    a = Assignment("ns", "p", "u", "n", (ContainerAssignment("c", Mode.EXCLUSIVE, (g1, g2)),), "t")
    b = replace(a, containers=(ContainerAssignment("c", Mode.EXCLUSIVE, (g2, g1)),))
    assert canonical(a) == canonical(b)


def test_annotation_round_trip_keeps_the_mac_valid() -> None:
    mig = Assignment("ns", "p", "u", "n1", (ContainerAssignment(
        "c", Mode.MIG, (GpuShare("MIG-1", 429, 20096, "2g.20gb", 4),)),), "t")
    for a in (sign(make(), KEY), sign(mig, KEY)):
        back = decode(encode(a))
        assert back == a and back.mac == a.mac and verify(back, KEY)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.pop("node"), "assignment.node: missing"),
        (lambda d: d.update(containers="x"), "assignment.containers: expected list"),
        (lambda d: d["containers"][0].update(mode="magic"), "containers[0].mode"),
        (lambda d: d["containers"][0]["gpus"][0].update(milli="500"), "gpus[0].milli"),
        (lambda d: d["containers"][0]["gpus"][0].update(milli=5000), "milli"),
        (lambda d: d["containers"][0].update(gpus=[]), "at least one GPU"),
    ],
)
def test_malformed_annotations_name_the_field(mutate, field: str) -> None:  # type: ignore[no-untyped-def]
    doc = json.loads(encode(sign(make(), KEY)))
    mutate(doc)
    with pytest.raises(AnnotationError, match=field.replace("[", r"\[").replace("]", r"\]")):
        decode(json.dumps(doc))


@pytest.mark.parametrize("text", ["", "nope", "[]", "{" * 5000, "x" * 70000])
def test_garbage_is_rejected(text: str) -> None:
    with pytest.raises(AnnotationError):
        decode(text)


INV = [GpuSlot("GPU-a", "n1", 16384), GpuSlot("GPU-b", "n1", 16384), GpuSlot("GPU-c", "n2", 0)]


def test_ledger_reserves_until_full_and_never_overcommits() -> None:
    led = Ledger.empty(INV).reserve(make("p1", 600)).reserve(make("p2", 400))
    assert led.free("GPU-a") == (0, 16384 - 8192)
    with pytest.raises(Conflict, match="GPU GPU-a has 0 milli free, container c needs 100"):
        led.reserve(make("p3", 100))
    with pytest.raises(Conflict, match="already holds"):
        led.reserve(make("p1", 100, "GPU-b"))
    with pytest.raises(Conflict, match="not n1"):
        led.reserve(make("p4", 100, "GPU-c"))
    with pytest.raises(Conflict, match="not in the inventory"):
        led.reserve(make("p5", 100, "GPU-z"))
    freed = led.release("ns", "p1")
    assert freed.free("GPU-a")[0] == 600 and led.free("GPU-a")[0] == 0  # immutable
    assert freed.release("ns", "nobody") is freed


def test_ledger_rebuild_is_the_same_after_a_restart_and_reports_overcommits() -> None:
    live = [make("p1", 600, t="t1"), make("p2", 300, t="t2"), make("p3", 300, t="t3")]
    led, problems = Ledger.rebuild(INV, live)
    assert led.free("GPU-a")[0] == 100
    assert problems == ["ns/p3: GPU GPU-a has 100 milli free, container c needs 300"]
    again, _ = Ledger.rebuild(INV, reversed(live))  # order of the watch does not matter
    assert again.used_milli == led.used_milli and set(again.owners) == set(led.owners)


def test_ledger_restamp_swaps_the_owner_alone_and_anything_else_is_release_and_reserve() -> None:
    led = Ledger.empty(INV).reserve(make("p1", 600)).reserve(make("p2", 300))
    stamped = led.restamp(make("p1", 600, t="2026-11-27T16:00:00Z"))
    assert stamped.owners[("ns", "p1")].bind_time == "2026-11-27T16:00:00Z"
    assert stamped.used_milli is led.used_milli and stamped.used_memory is led.used_memory
    assert led.owners[("ns", "p1")].bind_time == "2026-11-22T18:00:00Z"  # immutable
    # other shares: the same as releasing and reserving, Conflict included
    moved = led.restamp(make("p1", 200, "GPU-b"))
    assert moved.free("GPU-a")[0] == 700 and moved.free("GPU-b")[0] == 800
    assert moved.used_milli == led.release("ns", "p1").reserve(make("p1", 200, "GPU-b")).used_milli
    with pytest.raises(Conflict, match="has 700 milli free, container c needs 800"):
        led.restamp(make("p1", 800))
    new = led.restamp(make("p9", 100))  # not held before: a reserve
    assert new.free("GPU-a")[0] == 0
