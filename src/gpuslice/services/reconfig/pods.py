"""What the reconfiguration controller reads of pods and GPUs, and the replacement pods it
writes: plain functions over the API server's JSON."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from gpuslice.adapters.kube.objects import DRAINING_ANNOTATION, DRAINING_LABEL
from gpuslice.core.assignment import ANNOTATION

TEMPLATE_HASH = "pod-template-hash"  # the ReplicaSet's label on its pods
# on a stand-in: the pod-template-hash of the ReplicaSet pod it stands in for, so that it can
# be handed to that ReplicaSet (which adopts it) when the ReplicaSet does not restore in time
STAND_IN_HASH = "gpuslice.io/template-hash"
REPLACES = "gpuslice.io/replaces"
_SUFFIX = re.compile(r"-m\d+$")


@dataclass(frozen=True)
class Gpu:
    node: str
    uuid: str
    model: str
    memory_mib: int


def now_text(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def label_key(uuid: str) -> str:
    """The GPU part of the label ``gpuslice.io/reconfig.<GPU>`` (a label name is at most 63
    characters, alphanumeric at both ends)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", uuid)[-(63 - len("reconfig.")):].strip("-_.")


def key(pod: dict[str, Any]) -> str:
    meta = pod["metadata"]
    return f"{meta.get('namespace', 'default')}/{meta['name']}"


def split(pod_key: str) -> tuple[str, str]:
    ns, name = pod_key.split("/", 1)
    return ns, name


def owner(pod: dict[str, Any]) -> str | None:
    """The UID of the ReplicaSet that owns ``pod`` (None: a bare pod)."""
    for ref in pod["metadata"].get("ownerReferences") or []:
        if ref.get("kind") == "ReplicaSet" and ref.get("controller", True):
            return str(ref.get("uid"))
    return None


def controlled(pod: dict[str, Any]) -> bool:
    """Whether a controller owns ``pod`` (a stand-in handed over: adopted)."""
    return any(ref.get("controller") for ref in pod["metadata"].get("ownerReferences") or [])


def ready(pod: dict[str, Any]) -> bool:
    st = pod.get("status") or {}
    return st.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in st.get("conditions") or [])


def draining(pod: dict[str, Any]) -> bool:
    return (pod["metadata"].get("annotations") or {}).get(DRAINING_ANNOTATION) == "true"


def replacement_names(on_gpu: list[str], base: int) -> dict[str, str]:
    """The name of each pod's replacement (``<name>-m<n>``, numbered from ``base``)."""
    return {k: f"{split(k)[0]}/{_SUFFIX.sub('', split(k)[1])}-m{base + i}"
            for i, k in enumerate(sorted(on_gpu))}


def replacement(src: dict[str, Any], pod_key: str) -> dict[str, Any]:
    """A copy of ``src`` named ``pod_key`` ("namespace/name"), unscheduled, without the old
    pod's assignment, draining mark and status."""
    ns, name = split(pod_key)
    meta = src["metadata"]
    ann = {k: v for k, v in (meta.get("annotations") or {}).items()
           if k not in (ANNOTATION, DRAINING_ANNOTATION)}
    ann[REPLACES] = f"{meta.get('namespace', 'default')}/{meta['name']}"
    spec = {k: v for k, v in (src.get("spec") or {}).items() if k != "nodeName"}
    # a ReplicaSet's pod: the stand-in keeps the labels Services select on, but not the
    # ReplicaSet's own pod-template-hash, so the ReplicaSet neither adopts nor counts it (the
    # hash is kept aside, to hand the stand-in over if the ReplicaSet does not restore)
    old = meta.get("labels") or {}
    labels = {k: v for k, v in old.items() if k not in (TEMPLATE_HASH, DRAINING_LABEL)}
    if TEMPLATE_HASH in old:
        ann[STAND_IN_HASH] = str(old[TEMPLATE_HASH])
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": labels,
                         "annotations": ann},
            "spec": spec}
