"""RFC 6901 JSON pointers and the RFC 6902 JSON patch operations the API server fake
applies (``kubectl patch --type=json``)."""

from __future__ import annotations

import copy
from typing import Any

from gpuslice.adapters.kube.ports import ApiInvalid


def json_pointer(*parts: str) -> str:
    """An RFC 6901 pointer to ``parts``: ``~`` is written ``~0`` and ``/`` ``~1``
    (``/status/capacity/gpuslice.io~1gpu-milli``), as ``kubectl patch --type=json`` wants."""
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


def apply_json_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """``doc`` with the RFC 6902 operations ``add``, ``remove``, ``replace`` and ``test``
    applied, all or none (a copy is changed), on object members and list items (an index,
    or ``-`` to append): a missing path (``remove``, ``replace``) or a failed ``test`` raises
    :class:`ApiInvalid`, as kube-apiserver answers 422."""
    out = copy.deepcopy(doc)
    for i, op in enumerate(ops):
        kind, path = op.get("op"), op.get("path")
        if kind not in ("add", "remove", "replace", "test") or not isinstance(path, str) or \
                (path and not path.startswith("/")):
            raise ApiInvalid(f"patch[{i}]: unsupported operation {op!r}")
        keys = [k.replace("~1", "/").replace("~0", "~") for k in path.split("/")[1:]]
        if not keys:
            raise ApiInvalid(f"patch[{i}]: the whole document cannot be patched")
        parent = out
        for k in keys[:-1]:
            if isinstance(parent, dict) and k in parent:
                parent = parent[k]
            elif isinstance(parent, list) and k.isdigit() and int(k) < len(parent):
                parent = parent[int(k)]
            else:
                raise ApiInvalid(f"patch[{i}] {kind} {path}: no such path")
        last = keys[-1]
        if isinstance(parent, list):
            _in_list(parent, last, kind, op, f"patch[{i}] {kind} {path}")
            continue
        if not isinstance(parent, dict):
            raise ApiInvalid(f"patch[{i}] {kind} {path}: no such path")
        if kind == "add":
            parent[last] = copy.deepcopy(op.get("value"))
        elif last not in parent:
            raise ApiInvalid(f"patch[{i}] {kind} {path}: Unable to {kind} nonexistent key: "
                             f"{last}: missing value")
        elif kind == "remove":
            del parent[last]
        elif kind == "replace":
            parent[last] = copy.deepcopy(op.get("value"))
        elif parent[last] != op.get("value"):
            raise ApiInvalid(f"patch[{i}] test {path}: testing value {parent[last]!r} failed")
    return out


def _in_list(items: list[Any], last: str, kind: object, op: dict[str, Any], where: str) -> None:
    """One operation on list item ``last`` (an index; ``-``, past the end, for ``add``)."""
    if kind == "add" and last == "-":
        items.append(copy.deepcopy(op.get("value")))
        return
    if not last.isdigit() or int(last) > len(items) or \
            (kind != "add" and int(last) == len(items)):
        raise ApiInvalid(f"{where}: no such index")
    at = int(last)
    if kind == "add":
        items.insert(at, copy.deepcopy(op.get("value")))
    elif kind == "remove":
        del items[at]
    elif kind == "replace":
        items[at] = copy.deepcopy(op.get("value"))
    elif items[at] != op.get("value"):
        raise ApiInvalid(f"{where}: testing value {items[at]!r} failed")
