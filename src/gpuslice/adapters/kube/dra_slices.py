"""ResourceSlices of our driver as the claim allocator sees them: per node, the devices it may
give, in the order the scheduler's allocator tries them (see adapters.kube.dra); a pool that is
invalid or has a slice of the wrong shape is left out, and why noted."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from gpuslice.adapters.kube.dra_common import (
    ALLOCATOR_TAINT,
    DRIVER,
    _dict,
    _int,
    _list,
    _memo,
    _name,
    _str,
    _whole,
)
from gpuslice.core.dra_placement import Capacity, DraDevice, RequestPolicy
from gpuslice.core.errors import ValidationError, note_once


def _policy(doc: object, field: str) -> RequestPolicy | None:
    doc = _dict(doc, field)
    if not doc:
        return None
    rng = _dict(doc.get("validRange"), ".validRange")
    default = doc.get("default")
    return RequestPolicy(
        default=None if default is None else _int(default, ".default"),
        valid_values=tuple(_int(v, ".validValues")
                           for v in _list(doc.get("validValues"), ".validValues")),
        min=None if rng.get("min") is None else _int(rng["min"], ".validRange.min"),
        max=None if rng.get("max") is None else _int(rng["max"], ".validRange.max"),
        step=None if rng.get("step") is None else _int(rng["step"], ".validRange.step"))


def _capacity(key: str, doc: object) -> Capacity:
    """A device's capacity ``key`` (an error names the field below ``capacity <key>``; the
    names are built only then: this runs for every capacity of every device)."""
    try:
        doc = _dict(doc, "")
        return Capacity(_int(doc.get("value"), ""), _policy(doc.get("requestPolicy"), ""))
    except ValidationError as exc:
        sep = "" if not exc.field or exc.field.startswith(".") else " "
        raise ValidationError(f" capacity {key}{sep}{exc.field}", exc.expected,
                              exc.got) from None


def _attr(attrs: Mapping[str, Any], name: str, driver: str) -> str:
    for key, val in attrs.items():
        if _name(str(key), driver) == name and isinstance(val, dict):
            return str(val.get("string") or val.get("version") or val.get("int") or "")
    return ""


def _usable(device: Mapping[str, Any], require_taint: bool) -> bool:
    if device.get("consumesCounters"):
        return False
    ours = False
    for i, item in enumerate(_list(device.get("taints"), " taints")):
        taint = _dict(item, f" taints[{i}]")
        if taint.get("key") == ALLOCATOR_TAINT:
            ours = True
        elif taint.get("effect") in ("NoSchedule", "NoExecute"):
            return False
    return ours or not require_taint


def _slice_name(s: Mapping[str, Any]) -> str:
    meta = s.get("metadata")
    return str(meta.get("name") if isinstance(meta, Mapping) else None)


def slice_devices(slices: Sequence[Mapping[str, Any]], driver: str = DRIVER, *,
                  require_taint: bool = True,
                  problems: list[str] | None = None) -> dict[str, list[DraDevice]]:
    """Per node, our devices in the allocator's order (see the module doc). With
    ``require_taint`` only devices carrying :data:`ALLOCATOR_TAINT` are kept: the ones
    kube-scheduler will not allocate behind our back. A pool that is invalid (a device name
    twice among its newest slices) or has a slice of the wrong shape is left out, and why
    added to ``problems``: the other pools are placed from as ever."""
    pools: dict[str, list[tuple[Mapping[str, Any], int, int]]] = {}
    bad: dict[str, str] = {}  # pool -> why it is left out
    for s in slices:
        spec = s.get("spec")
        if not isinstance(spec, Mapping) or spec.get("driver") != driver \
                or not spec.get("nodeName"):
            continue
        where = f"resourceslice {_slice_name(s)}"
        pool = ""
        try:
            _str(spec["nodeName"], f"{where} spec.nodeName")
            ref = _dict(spec.get("pool"), f"{where} spec.pool")
            name = ref.get("name") or ""
            if not isinstance(name, str):
                raise ValidationError(f"{where} spec.pool.name", "a string", name)
            pool = name
            gen = _whole(ref.get("generation") or 0, f"{where} spec.pool.generation", 0)
            want = _whole(ref.get("resourceSliceCount") or 1,
                          f"{where} spec.pool.resourceSliceCount", 1)
        except ValidationError as exc:
            if pool:
                bad.setdefault(pool, str(exc))
            else:
                note_once(problems, f"{exc}: slice left out")
            continue
        pools.setdefault(pool, []).append((s, gen, want))
    out: dict[str, list[DraDevice]] = {}
    for pool in sorted(pools.keys() | bad.keys()):
        if pool in bad:
            note_once(problems, f"{bad[pool]}: pool {pool} left out")
            continue
        group = pools[pool]
        gen = max(g for _, g, _ in group)
        newest = [(s, want) for s, g, want in group if g == gen]
        if len(newest) < newest[0][1]:
            continue  # incomplete pool: the allocator does not use it either
        parsed: list[tuple[str, _Slice]] = []
        for s, _ in sorted(newest, key=lambda sw: _slice_name(sw[0])):
            got = _memo("slice", s, partial(_devices_of, s, pool, driver, require_taint),
                        pool, driver, require_taint)
            if got.problem is not None:
                note_once(problems, f"{got.problem}: pool {pool} left out")
                break
            parsed.append((str(s["spec"]["nodeName"]), got))
        else:
            twice = parsed[0][1].twice if len(parsed) == 1 else _twice(
                [got.names for _, got in parsed])
            if twice is not None:  # upstream: "pool is invalid": nothing allocated from it
                note_once(problems, f"pool {pool}: invalid: duplicate device name {twice!r}: "
                                "pool left out")
                continue
            for node, got in parsed:
                out.setdefault(node, []).extend(got.devices)
    return out


def _twice(names: Sequence[frozenset[str]]) -> str | None:
    """A device name found in two slices of one pool (``None``: all distinct)."""
    seen: set[str] = set()
    for group in names:
        common = seen & group
        if common:
            return min(common)
        seen |= group
    return None


@dataclass(frozen=True, slots=True)
class _Slice:
    """One slice read (kept per its version): its usable devices, the names of all of them,
    the first name it gives twice, and what is wrong with it (``None``: nothing)."""

    devices: tuple[DraDevice, ...] = ()
    names: frozenset[str] = frozenset()
    twice: str | None = None
    problem: str | None = None


def _devices_of(s: Mapping[str, Any], pool: str, driver: str,
                require_taint: bool) -> _Slice:
    """One slice's usable devices (:func:`slice_devices`)."""
    out: list[DraDevice] = []
    names: set[str] = set()
    twice: str | None = None
    where = f"resourceslice {_slice_name(s)}"
    try:
        devices = _list(s["spec"].get("devices"), f"{where} spec.devices")
    except ValidationError as exc:
        return _Slice(problem=str(exc))
    for i, d in enumerate(devices):
        try:  # field names relative to the device, its own built only for an error
            if not isinstance(d, Mapping):
                raise ValidationError("", "an object", type(d).__name__)
            name = _str(d.get("name"), " name")
            if name in names and twice is None:
                twice = name
            names.add(name)
            if not _usable(d, require_taint):
                continue
            caps = {_name(str(k), driver): _capacity(str(k), v)
                    for k, v in _dict(d.get("capacity"), " capacity").items()}
            shared = d.get("allowMultipleAllocations")
            if shared is not None and not isinstance(shared, bool):
                raise ValidationError(" allowMultipleAllocations", "true or false", shared)
            attrs = _dict(d.get("attributes"), " attributes")
        except ValidationError as exc:
            return _Slice(problem=str(ValidationError(f"{where} device[{i}]{exc.field}",
                                                      exc.expected, exc.got)))
        out.append(DraDevice(pool, name, _attr(attrs, "type", driver) or "gpu",
                             _attr(attrs, "productName", driver), bool(shared), caps,
                             _attr(attrs, "uuid", driver), _attr(attrs, "parentUUID", driver)))
    return _Slice(tuple(out), frozenset(names), twice)
