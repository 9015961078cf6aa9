"""Fuzz the ``gpuslice.io/assignment`` annotation decoder (adapters/kube/annotation.py): any text
on a pod, as the node agent and the extender read it from the API server. The annotation is
user-writable, so it is hostile input. tests/extender/test_decoder_fuzz.py sends it any JSON
value; here: any text (invalid UTF-16 included), near-valid documents with one field replaced,
and the verification that follows every decode.

Properties: ``decode`` returns an Assignment or raises AnnotationError naming the field, never
anything else; ``verify`` of whatever was decoded answers True or False, never raises; a
decoded assignment encodes back to itself; a real signed one still verifies."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuslice.adapters.kube.annotation import MAX_BYTES, AnnotationError, decode, encode
from gpuslice.core.assignment import (
    Assignment,
    ContainerAssignment,
    GpuShare,
    Mode,
    sign,
    verify,
)
from tests.fuzz.helpers import fuzz, json_values, tried

KEY = b"fuzz-key-0123456789abcdef"

VALID = sign(Assignment("ml", "p", "uid-1", "node-1", (
    ContainerAssignment("main", Mode.MPS, (GpuShare("GPU-a", 300, 8192),)),
    ContainerAssignment("mig", Mode.MIG, (GpuShare("MIG-b", 1000, 10240, "1g.10gb", 4),)),
), "2026-11-22T18:00:00Z"), KEY)
VALID_DOC: dict[str, Any] = json.loads(encode(VALID))

# the fields of a valid document, as paths (container 0, GPU 0)
PATHS = ([[k] for k in VALID_DOC]
         + [["containers", 0, k] for k in ("name", "mode", "gpus", "kind")]
         + [["containers", 1, "gpus", 0, k] for k in ("uuid", "milli", "memoryMiB",
                                                      "migProfile", "migStart")]
         + [["containers", 0, "gpus", 0, k] for k in ("uuid", "milli", "memoryMiB")]
         + [["containers", 0], ["containers", 1, "gpus", 0]])

# text a JSON encoder never makes: lone surrogates as escapes and as characters, control
# characters, numbers past every limit, deep nesting, sizes around the limit
MALFORMED: tuple[str, ...] = (
    "", " ", "null", "[]", "{}", '""', "{", '{"containers": [', "\x00", "\ud800",
    '"\\ud800"', '{"mac": "v1:\\udfff"}', '{"namespace": "\\ud83d"}', "\udcff{}",
    '{"containers": NaN}', '{"containers": Infinity}', "1e999999", "9" * 5000,
    "[" * 100_000, '{"a":' * 20_000 + "1" + "}" * 20_000,
    json.dumps({**VALID_DOC, "pod": "x" * (MAX_BYTES - 400)}),
    json.dumps({**VALID_DOC, "pod": "x" * MAX_BYTES}),
    json.dumps({**VALID_DOC, "mac": "v1:" + "é" * 64}),
    json.dumps({**VALID_DOC, "mac": "v1:\ud800"}),
    json.dumps({**VALID_DOC, "namespace": "\ud800"}),
    json.dumps({**VALID_DOC, "containers": [{**VALID_DOC["containers"][1],
                                             "gpus": [{**VALID_DOC["containers"][1]["gpus"][0],
                                                       "migProfile": "\udc80"}]}]}),
    encode(VALID).replace("300", "3" * 5000),
    encode(VALID).replace("300", "1e3"),
    encode(VALID).replace("300", "300.0"),
    encode(VALID).replace("300", "-300"),
    encode(VALID).replace("8192", "true"),
    encode(VALID).replace('"mps"', '"MPS"'),
    encode(VALID) + encode(VALID),
    encode(VALID)[:-1],
    encode(VALID).replace('"podUID"', '"podUID": "a", "podUID"'),
)


def check(text: str) -> None:
    try:
        a = decode(text)
    except AnnotationError as exc:
        assert str(exc).startswith("assignment"), exc  # names the field
        return
    assert isinstance(verify(a, KEY), bool)
    assert decode(encode(a)) == a
    assert verify(sign(a, KEY), KEY)


def replaced(path: list[Any], value: Any) -> str:
    doc = json.loads(json.dumps(VALID_DOC))
    cur = doc
    for key in path[:-1]:
        cur = cur[key]
    cur[path[-1]] = value
    return json.dumps(doc)


@pytest.mark.parametrize("text", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_annotations_are_refused_by_name(text: str) -> None:
    tried("assignment annotation (corpus)")
    check(text)


@fuzz(1000)
@given(st.text(max_size=200, alphabet=st.characters(codec=None)))
def test_any_text_decodes_or_is_refused(text: str) -> None:
    """Any Unicode text, lone surrogates included (JSON from a client carries them)."""
    tried("assignment annotation (text)")
    check(text)


@fuzz(1500)
@given(st.sampled_from(PATHS), st.one_of(json_values, st.text(
    alphabet=st.characters(codec=None), max_size=8), st.integers(-(2**70), 2**70),
    st.sampled_from(["\ud800", "a\udfffb", "v1:\u00e9", "v1:" + "0" * 64, "\x00", "1g.10gb",
                     "mig", "exclusive", "timeslice", "init", "sidecar"])))
def test_one_field_replaced_decodes_or_is_refused(path: list[Any], value: Any) -> None:
    tried("assignment annotation (one field)")
    check(replaced(path, value))


@fuzz(200)
@given(st.sampled_from(PATHS))
def test_one_field_removed_is_refused_or_defaulted(path: list[Any]) -> None:
    tried("assignment annotation (one field)")
    doc = json.loads(json.dumps(VALID_DOC))
    cur = doc
    for key in path[:-1]:
        cur = cur[key]
    if isinstance(cur, dict) and path[-1] not in cur:
        return  # an optional field the valid document leaves out
    del cur[path[-1]]
    check(json.dumps(doc))


def test_a_signed_assignment_still_decodes_and_verifies() -> None:
    a = decode(encode(VALID))
    assert a == VALID and verify(a, KEY)
    assert not verify(a, b"another-key-0123456789")
