"""The extender's wire format (kube-scheduler's extender API, k8s.io/kube-scheduler
extender/v1 types.go): the verbs' request bodies read and checked field by field, and their
JSON answers. A field of the wrong shape is a :class:`ValidationError` naming it, or a 400."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from gpuslice.core.errors import ValidationError


def answer(doc: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(doc), content_type="application/json")


def bad(message: str, status: int = 400) -> web.Response:
    return answer({"Error": message}, status)


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.read()
    except (web.RequestPayloadError, ConnectionError) as exc:  # a Content-Encoding it lies
        # about, a body cut short
        raise web.HTTPBadRequest(text=f"request body unreadable: {exc}") from None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise web.HTTPBadRequest(text=f"request body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise web.HTTPBadRequest(text="request body: expected a JSON object")
    return doc


def node_names(args: dict[str, Any]) -> tuple[list[str], dict[str, dict[str, Any]] | None]:
    """The candidate node names, and the node objects when the scheduler sent them."""
    if args.get("NodeNames") is not None:
        names = args["NodeNames"]
        # the element check in C (map, set): a generator over 1000 names was 0.1 ms a call
        if not isinstance(names, list) or (names and set(map(type, names)) != {str}):
            raise ValidationError("NodeNames", "a list of node names", type(names).__name__)
        return names, None
    nodes = args.get("Nodes") or {}
    if not isinstance(nodes, dict):
        raise ValidationError("Nodes", "a NodeList (or NodeNames)", type(nodes).__name__)
    items = nodes.get("items")
    if not isinstance(items, list):
        raise ValidationError("Nodes.items", "a list of nodes", type(items).__name__)
    by_name = {}
    for n in items:
        meta = n.get("metadata") if isinstance(n, dict) else None
        if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
            raise ValidationError("Nodes.items[].metadata.name", "a node name", n)
        by_name[n["metadata"]["name"]] = n
    return list(by_name), by_name


def victims_of(args: dict[str, Any]) -> tuple[dict[str, list[str]], dict[str, int]]:
    """Victim pod UIDs per node and the PDB violations counted for them, from either form the
    scheduler sends (``NodeNameToMetaVictims`` with UIDs, or ``NodeNameToVictims`` with pods)."""
    meta = args.get("NodeNameToMetaVictims")
    full = args.get("NodeNameToVictims")
    raw, key = (meta, "NodeNameToMetaVictims") if meta is not None else \
        (full, "NodeNameToVictims")
    if not isinstance(raw, dict):
        raise ValidationError(key, "a map of node name to victims", type(raw).__name__)
    victims: dict[str, list[str]] = {}
    pdb: dict[str, int] = {}
    for node, v in raw.items():
        pods = v.get("Pods") if isinstance(v, dict) else None
        if not isinstance(pods, list):
            raise ValidationError(f"{key}.{node}.Pods", "a list of pods", type(pods).__name__)
        uids = []
        for p in pods:
            if not isinstance(p, dict):
                uid = None
            elif meta is not None:
                uid = p.get("UID")
            else:
                pod_meta = p.get("metadata")
                uid = pod_meta.get("uid") if isinstance(pod_meta, dict) else None
            if not isinstance(uid, str) or not uid:
                raise ValidationError(f"{key}.{node}.Pods[]", "pods with their UID", p)
            uids.append(uid)
        victims[node] = uids
        n = v.get("NumPDBViolations", 0)
        pdb[node] = n if isinstance(n, int) and not isinstance(n, bool) else 0
    return victims, pdb


def pod_name(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def scheduled_pod(args: dict[str, Any]) -> dict[str, Any]:
    pod = args.get("Pod")
    if not isinstance(pod, dict):
        raise ValidationError("Pod", "a Pod object", type(pod).__name__)
    for part in ("metadata", "spec", "status"):  # what the verbs read with .get()
        if pod.get(part) is not None and not isinstance(pod[part], dict):
            raise ValidationError(f"Pod.{part}", "an object", type(pod[part]).__name__)
    return pod
