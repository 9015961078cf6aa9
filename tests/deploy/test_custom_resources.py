"""The SliceSchedule example validates strictly against the CRD's own schema, the way the API
server with ``kubectl apply --validate=strict`` treats it: OpenAPI's ``nullable`` allows null,
a field the schema does not declare is an error unless the schema preserves unknown fields.
(kubernetes-validate knows only the built-in kinds; tests/deploy/test_manifests.py validates
those.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The CRD's structural schema as JSON Schema."""
    out = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes-")
           and k != "nullable"}
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in schema:
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = strict(schema["additionalProperties"])
    if "items" in schema:
        out["items"] = strict(schema["items"])
    return out


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "deploy" / "base" / "crd-slice-schedule.yaml").read_text())
    [version] = crd["spec"]["versions"]
    schema = strict(version["schema"]["openAPIV3Schema"])
    # the API server fills these for every object
    schema["properties"].update({"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                 "metadata": {"type": "object"}})
    return schema


def test_the_example_slice_schedule_validates_against_the_crd() -> None:
    example = yaml.safe_load((ROOT / "deploy" / "examples" / "day-night.yaml").read_text())
    jsonschema.validate(example, crd_schema())


def test_the_strict_schema_refuses_a_misspelt_field() -> None:
    example = yaml.safe_load((ROOT / "deploy" / "examples" / "day-night.yaml").read_text())
    example["spec"]["drainTimeoutSecond"] = 60
    with pytest.raises(jsonschema.ValidationError, match="drainTimeoutSecond"):
        jsonschema.validate(example, crd_schema())
