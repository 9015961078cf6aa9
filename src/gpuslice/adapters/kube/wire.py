"""Pieces of kube-apiserver's wire format that both API clients use (the synchronous
:mod:`.client` and the event loop's :mod:`.aio`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def binding_body(namespace: str, name: str, uid: str, node: str,
                 annotations: Mapping[str, str] | None = None,
                 resource_version: str | None = None) -> dict[str, Any]:
    """A Binding of the pod to ``node``: ``annotations`` are set on the pod in the same
    write, ``uid`` and ``resource_version`` (when given) are its preconditions (kube-apiserver's
    ``BindingREST.setPodNodeAndMetadata``, pkg/registry/core/pod/storage/storage.go)."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": uid}
    if annotations:
        meta["annotations"] = dict(annotations)
    if resource_version:
        meta["resourceVersion"] = resource_version
    return {"apiVersion": "v1", "kind": "Binding", "metadata": meta,
            "target": {"apiVersion": "v1", "kind": "Node", "name": node}}


def status_text(body: bytes | str | None, reason: str) -> str:
    """The API server's own message from the Status body of an error, else the HTTP reason."""
    try:
        status = json.loads(body or "")
        return f"{status.get('reason') or reason}: {status['message']}"
    except (ValueError, TypeError, KeyError, AttributeError):
        return str(reason)
