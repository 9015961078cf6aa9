"""An in-memory API server fake behind the same port the extender uses.

Pods and nodes are plain Kubernetes JSON objects. Every write bumps a cluster-wide
``resourceVersion``; a patch that names a stale ``resourceVersion`` fails with :class:`Conflict`
(optimistic concurrency, as the API server's 409). A Binding sets ``spec.nodeName`` once; binding
a bound pod again to another node is a conflict. Thread-safe, so concurrent extender requests
can share it.

The port Protocols and errors are in :mod:`~gpuslice.adapters.kube.ports`, JSON patches in
:mod:`~gpuslice.adapters.kube.jsonpatch`, the ResourceSlice strategy in
:mod:`~gpuslice.adapters.kube.slice_strategy`; the fake's stores are split by API group into
:mod:`~gpuslice.adapters.kube.fake_core`, :mod:`~gpuslice.adapters.kube.fake_objects` and
:mod:`~gpuslice.adapters.kube.fake_dra`. Every name is importable from here as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuslice.adapters.kube.fake_core import FakeCoreApi
from gpuslice.adapters.kube.fake_dra import FakeDraApi
from gpuslice.adapters.kube.fake_objects import FakeObjectsApi
from gpuslice.adapters.kube.jsonpatch import apply_json_patch, json_pointer
from gpuslice.adapters.kube.ports import (
    ApiConflict,
    ApiInvalid,
    ApiNotFound,
    ClusterPort,
    DaemonSetPort,
    DraApiPort,
    DraPort,
    KubePort,
    NodeCleanupPort,
    PodGatePort,
    PodLabelPort,
    WatchEvent,
)
from gpuslice.adapters.kube.slice_strategy import (
    GATED_FIELDS,
    drop_gated_fields,
    normalize_slice_spec,
)
from gpuslice.core.errors import ValidationError

__all__ = [
    "FAKE_CLUSTER_KEYS",
    "GATED_FIELDS",
    "ApiConflict",
    "ApiInvalid",
    "ApiNotFound",
    "ClusterPort",
    "DaemonSetPort",
    "DraApiPort",
    "DraPort",
    "FakeApiServer",
    "KubePort",
    "NodeCleanupPort",
    "PodGatePort",
    "PodLabelPort",
    "WatchEvent",
    "apply_json_patch",
    "drop_gated_fields",
    "json_pointer",
    "load_fake_cluster",
    "normalize_slice_spec",
]


class FakeApiServer(FakeCoreApi, FakeObjectsApi, FakeDraApi):
    """The whole fake: core/v1, Leases, custom objects, Deployments, DaemonSets and
    resource.k8s.io/v1, sharing one store, lock and resourceVersion (:class:`FakeState`)."""


def load_fake_cluster(path: Path) -> FakeApiServer:
    """A fake API server holding the ``nodes``, ``pods`` and ``sliceschedules`` lists of a
    YAML file (the ``--fake-cluster`` option of ``gpuslice extender``, ``gpuslice reconfig``
    and ``kubectl gpuslice``)."""
    from gpuslice.adapters.kube.objects import node_inventory
    from gpuslice.adapters.yamlfile import read_yaml

    where = f"--fake-cluster {path}"
    doc = read_yaml(Path(path), where, "a readable YAML file") or {}
    if not isinstance(doc, dict):
        raise ValidationError(where, "a mapping with 'nodes' (and 'pods', 'sliceschedules'); "
                              "see examples/fake-cluster.yaml", type(doc).__name__)
    unknown = sorted(str(k) for k in doc if k not in FAKE_CLUSTER_KEYS)
    if unknown or not any(k in doc for k in FAKE_CLUSTER_KEYS):
        raise ValidationError(where, f"only the keys {', '.join(FAKE_CLUSTER_KEYS)} (see "
                              "examples/fake-cluster.yaml)",
                              f"keys {unknown}" if unknown else "none of them")
    lists: dict[str, list[Any]] = {}
    for key in FAKE_CLUSTER_KEYS:
        items = doc.get(key) or []
        if not isinstance(items, list):
            raise ValidationError(f"{where}: {key}", "a list", type(items).__name__)
        seen: dict[tuple[str, str], int] = {}  # (namespace, name) -> index
        for i, item in enumerate(items):
            meta = item.get("metadata") if isinstance(item, dict) else None
            if not isinstance(meta, dict):
                raise ValidationError(f"{where}: {key}[{i}].metadata.name",
                                      "an object with a name", _short(item))
            if not isinstance(meta.get("name"), str) or not meta["name"]:
                raise ValidationError(f"{where}: {key}[{i}].metadata.name", "a name (text)",
                                      _short(meta.get("name")))
            if key == "pods" and (not isinstance(meta.get("namespace"), str)
                                  or not meta["namespace"]):
                raise ValidationError(f"{where}: pods[{i}].metadata.namespace",
                                      "the pod's namespace (text)", _short(meta.get("namespace")))
            _check_meta(where, key, i, meta, seen)
            if key == "nodes":
                try:
                    node_inventory(item)  # a bad GPU inventory annotation is named here
                except ValidationError as exc:
                    raise ValidationError(f"{where}: {exc.field}", exc.expected,
                                          exc.got) from None
        lists[key] = items
    fake = FakeApiServer()
    for n in lists["nodes"]:
        fake.add_node(n)
    for p in lists["pods"]:
        fake.add_pod(p)
    for o in lists["sliceschedules"]:
        fake.replace_custom("sliceschedules", o)
    return fake


FAKE_CLUSTER_KEYS = ("nodes", "pods", "sliceschedules")

_KIND = {"nodes": "node", "pods": "pod", "sliceschedules": "SliceSchedule"}


def _check_meta(where: str, key: str, i: int, meta: dict[str, Any],
                seen: dict[tuple[str, str], int]) -> None:
    """``{key}[{i}]``'s metadata: a name no earlier object of ``key`` has (in its namespace,
    for pods), and labels and annotations that are mappings, if given."""
    name = meta["name"]
    ident = (str(meta.get("namespace")) if key == "pods" else "", name)
    if ident in seen:
        raise ValidationError(f"{where}: {key}[{i}].metadata.name",
                              f"a name no other {_KIND[key]}"
                              f"{' of its namespace' if key == 'pods' else ''} has "
                              f"({key}[{seen[ident]}] has it too)", "/".join(filter(None, ident)))
    seen[ident] = i
    for field in ("labels", "annotations"):
        value = meta.get(field)
        if value is not None and not isinstance(value, dict):
            raise ValidationError(f"{where}: {key}[{i}].metadata.{field} ({_KIND[key]} "
                                  f"{name!r})", "a mapping (name: value)", _short(value))


def _short(value: object) -> object:
    """``value`` for an error message: its text cut short when it is long."""
    text = repr(value)
    return value if len(text) <= 80 else f"{text[:77]}..."
