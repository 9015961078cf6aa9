"""What the claim allocator's readers of resource.k8s.io objects share (adapters.kube.dra and
.dra_slices): our driver's names, a memo of what was parsed per object version, and field
readers that check a field's type and name it in a :class:`ValidationError`."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from gpuslice.adapters.kube.objects import quantity
from gpuslice.core.errors import ValidationError

DRIVER = "gpu.gpuslice.io"
# the taint our drivers put on their devices while the allocator's lease is fresh (see
# docs/dra-placement.md): kube-scheduler then leaves those devices to us
ALLOCATOR_TAINT = "gpu.gpuslice.io/allocator"
# the scheduling gate that holds a pod until the allocator has allocated its claim (issue 58:
# adapters/kube/dra_gate.py); the same name as the taint
ALLOCATOR_GATE = "gpu.gpuslice.io/allocator"


T = TypeVar("T")
_MEMO: dict[tuple[Any, ...], Any] = {}
MEMO_MAX = 1 << 16  # entries kept; the oldest quarter goes when full


def _memo(kind: str, obj: Mapping[str, Any], make: Callable[[], T], *extra: Any) -> T:
    """``make()``, kept per object version (UID and resourceVersion: an object the API
    server returns with the same version has the same content), so that the allocator's
    passes parse again only what changed. Objects without both are parsed every time; what
    is kept is never changed by its users (frozen core types, tuples). A
    :class:`ValidationError` is kept too, and raised anew each time (an object of the wrong
    shape is not parsed again every pass either)."""
    meta = obj.get("metadata") or {}
    uid, rv = meta.get("uid"), meta.get("resourceVersion")
    if not uid or not rv:
        return make()
    key = (kind, uid, rv, *extra)
    try:
        value = _MEMO[key]
    except KeyError:
        try:
            value = make()
        except ValidationError as exc:
            value = _Failed(exc.field, exc.expected, exc.got)
        _MEMO[key] = value
        if len(_MEMO) > MEMO_MAX:
            for old in list(itertools.islice(_MEMO, MEMO_MAX // 4)):
                _MEMO.pop(old, None)
    if type(value) is _Failed:
        raise ValidationError(value.field, value.expected, value.got)
    return value  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class _Failed:
    """A parse that raised :class:`ValidationError` (kept by :func:`_memo`)."""

    field: str
    expected: str
    got: object


def _int(value: object, field: str) -> int:
    return round(quantity(value, field))


def _dict(value: object, field: str) -> Mapping[str, Any]:
    """``value`` as an object (``None``: empty), else a :class:`ValidationError`."""
    if type(value) is dict:  # nearly always: no ABC check
        return value
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValidationError(field, "an object", type(value).__name__)
    return value


def _list(value: object, field: str) -> list[Any]:
    """``value`` as a list (``None``: empty), else a :class:`ValidationError`."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValidationError(field, "a list", type(value).__name__)
    return value


def _str(value: object, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValidationError(field, "a non-empty string", value)
    return value


def _whole(value: object, field: str, minimum: int) -> int:
    """An integer field (``generation``, ``resourceSliceCount``, ``count``): an int of at
    least ``minimum``; a bool, a string or a float is not one (JSON's integers only)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValidationError(field, f"an integer >= {minimum}", value)
    return value


def _name(name: str, driver: str) -> str:
    """A capacity or attribute name without our driver's domain (unprefixed names are the
    driver's own)."""
    return name[len(driver) + 1:] if name.startswith(driver + "/") else name
