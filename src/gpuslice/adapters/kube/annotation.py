"""JSON codec of the ``gpuslice.io/assignment`` annotation.

Decoding is strict: every field is checked for presence and type, and a problem is reported as
one :class:`AnnotationError` naming the field, so a hand-written or truncated annotation is
rejected with a reason instead of crashing the node agent or the extender.
"""

from __future__ import annotations

import json
from typing import Any

from gpuslice.core.assignment import Assignment, ContainerAssignment, GpuShare, Mode
from gpuslice.core.errors import GpusliceError, ValidationError
from gpuslice.core.podrequest import ContainerKind

MAX_BYTES = 64 * 1024


class AnnotationError(GpusliceError):
    """A malformed assignment annotation; the message names the field."""


def encode(a: Assignment) -> str:
    doc = {
        "namespace": a.namespace, "pod": a.pod, "podUID": a.pod_uid, "node": a.node,
        "bindTime": a.bind_time, "mac": a.mac,
        "containers": [{
            "name": c.name, "mode": c.mode.value,
            **({"kind": c.kind.value} if c.kind is not ContainerKind.APP else {}),
            "gpus": [{"uuid": g.uuid, "milli": g.milli, "memoryMiB": g.memory_mib,
                      **({"migProfile": g.mig_profile, "migStart": g.mig_start}
                         if g.mig_profile else {})} for g in c.gpus],
        } for c in a.containers],
    }
    return json.dumps(doc, separators=(",", ":"), sort_keys=True)


def _get(obj: dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in obj:
        raise AnnotationError(f"{where}.{key}: missing")
    value = obj[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise AnnotationError(f"{where}.{key}: expected an integer, got {value!r}")
    if kind is not int and not isinstance(value, kind):
        raise AnnotationError(f"{where}.{key}: expected {kind.__name__}, got {value!r}")
    return value


def decode(text: str) -> Assignment:
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise AnnotationError(f"assignment: larger than {MAX_BYTES} bytes")
    try:
        doc = json.loads(text)
        # a lone UTF-16 surrogate (raw, or escaped as \ud800) is no text: the MAC's canonical
        # bytes could not be made of it
        json.dumps(doc, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise AnnotationError("assignment: not valid Unicode text (a lone UTF-16 surrogate, "
                              "\\ud800-\\udfff)") from None
    except (ValueError, RecursionError) as exc:
        raise AnnotationError(f"assignment: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise AnnotationError("assignment: expected a JSON object")
    try:
        containers = []
        for i, c in enumerate(_get(doc, "containers", list, "assignment")):
            where = f"assignment.containers[{i}]"
            if not isinstance(c, dict):
                raise AnnotationError(f"{where}: expected an object")
            mode_text = _get(c, "mode", str, where)
            try:
                mode = Mode(mode_text)
            except ValueError:
                raise AnnotationError(f"{where}.mode: expected one of "
                                      f"{', '.join(m.value for m in Mode)}, got {mode_text!r}") \
                    from None
            gpus = []
            for j, g in enumerate(_get(c, "gpus", list, where)):
                gw = f"{where}.gpus[{j}]"
                if not isinstance(g, dict):
                    raise AnnotationError(f"{gw}: expected an object")
                gpus.append(GpuShare(
                    _get(g, "uuid", str, gw), _get(g, "milli", int, gw),
                    _get(g, "memoryMiB", int, gw),
                    g.get("migProfile", "") if isinstance(g.get("migProfile", ""), str) else "",
                    g["migStart"] if isinstance(g.get("migStart"), int) else -1,
                ))
            kind_text = c.get("kind", ContainerKind.APP.value)
            try:
                kind = ContainerKind(kind_text)
            except ValueError:
                raise AnnotationError(f"{where}.kind: expected one of "
                                      f"{', '.join(k.value for k in ContainerKind)}, got "
                                      f"{kind_text!r}") from None
            containers.append(ContainerAssignment(_get(c, "name", str, where), mode,
                                                  tuple(gpus), kind))
        return Assignment(
            _get(doc, "namespace", str, "assignment"), _get(doc, "pod", str, "assignment"),
            _get(doc, "podUID", str, "assignment"), _get(doc, "node", str, "assignment"),
            tuple(containers), _get(doc, "bindTime", str, "assignment"),
            _get(doc, "mac", str, "assignment"),
        )
    except ValidationError as exc:
        raise AnnotationError(str(exc)) from None
