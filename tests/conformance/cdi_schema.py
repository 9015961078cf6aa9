"""The CDI spec's JSON schema, as data for the conformance tests.

Source: github.com/cncf-tags/container-device-interface, ``schema/schema.json`` at commit
9c1a1bdee4ebb2e79015f54eb2b489c054cd0f48 and ``schema/defs.json`` at commit
1537b1dbd72ca3c971cdc498f558f986e0b9ffa1 (the schema of spec versions 1.0 and 1.1), kept
to the parts a spec's devices use. ``STRICT`` is the older top level of schema.json (commit
242d9b96a0b723ca3f97f3cb3553966afd607913), which also refuses unknown top-level fields.
"""

from __future__ import annotations

from typing import Any

_STRINGS: dict[str, Any] = {"type": "array", "items": {"type": "string"}}
_UINT32 = {"type": "integer", "minimum": 0, "maximum": 4294967295}
_INT64 = {"type": "integer", "minimum": -9223372036854775808, "maximum": 9223372036854775807}

DEFS: dict[str, Any] = {
    "definitions": {
        "uint32": _UINT32,
        "int64": _INT64,
        "ArrayOfStrings": _STRINGS,
        "FilePath": {"type": "string"},
        "mapStringString": {"type": "object",
                            "patternProperties": {".{1,}": {"type": "string"}}},
        "DeviceNode": {
            "type": "object",
            "properties": {
                "path": {"$ref": "#/definitions/FilePath"},
                "hostPath": {"$ref": "#/definitions/FilePath"},
                "permissions": {"type": "string"},
                "type": {"type": "string"},
                "major": {"$ref": "#/definitions/int64"},
                "minor": {"$ref": "#/definitions/int64"},
                "uid": {"$ref": "#/definitions/uint32"},
                "gid": {"$ref": "#/definitions/uint32"},
            },
            "required": ["path"],
        },
        "Mount": {
            "type": "object",
            "properties": {
                "hostPath": {"$ref": "#/definitions/FilePath"},
                "containerPath": {"$ref": "#/definitions/FilePath"},
                "options": {"$ref": "#/definitions/ArrayOfStrings"},
                "type": {"type": "string"},
            },
            "required": ["hostPath", "containerPath"],
        },
        "Hook": {
            "type": "object",
            "properties": {
                "hookName": {"type": "string"},
                "path": {"$ref": "#/definitions/FilePath"},
                "args": {"$ref": "#/definitions/ArrayOfStrings"},
                "env": {"$ref": "#/definitions/ArrayOfStrings"},
                "timeout": {"$ref": "#/definitions/uint32"},
            },
            "required": ["hookName", "path"],
        },
        "containerEdits": {
            "type": "object",
            "properties": {
                "env": {"type": "array", "items": {"type": "string"}},
                "deviceNodes": {"type": "array", "items": {"$ref": "#/definitions/DeviceNode"}},
                "mounts": {"type": "array", "items": {"$ref": "#/definitions/Mount"}},
                "hooks": {"type": "array", "items": {"$ref": "#/definitions/Hook"}},
            },
        },
        "annotations": {"$ref": "#/definitions/mapStringString"},
    }
}

SCHEMA: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "properties": {
        "cdiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "annotations": {"$ref": "defs.json#/definitions/annotations"},
        "devices": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "annotations": {"$ref": "defs.json#/definitions/annotations"},
                    "containerEdits": {"$ref": "defs.json#/definitions/containerEdits"},
                },
                "required": ["name", "containerEdits"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["cdiVersion", "kind", "devices"],
    "additionalProperties": False,
}
