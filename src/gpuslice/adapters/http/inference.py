"""What the router reads from an inference request: the model it names (KServe v1 / Open
Inference Protocol v2 paths) and its size (batch size from a header or the JSON body)."""

from __future__ import annotations

from collections.abc import Mapping

import orjson

from gpuslice.core.errors import ValidationError

MAX_SIZE_PARSE_BYTES = 256 * 1024
MAX_BATCH = 1 << 20


def model_from_path(path: str) -> str | None:
    """``/v2/models/NAME[/versions/V]/infer`` and ``/v1/models/NAME:predict`` -> NAME."""
    parts = path.split("/", 4)
    if len(parts) >= 4 and parts[1] in ("v1", "v2") and parts[2] == "models" and parts[3]:
        return parts[3].split(":", 1)[0] or None
    return None


def header_size(headers: Mapping[str, str], header: str) -> int | None:
    raw = headers.get(header)
    if raw is None:
        return None
    try:
        size = int(raw.strip())
    except ValueError:
        raise ValidationError(f"header {header}", "a positive integer batch size",
                              raw) from None
    if not 1 <= size <= MAX_BATCH:
        raise ValidationError(f"header {header}", f"a batch size from 1 to {MAX_BATCH}", raw)
    return size


def body_size(body: bytes, content_type: str) -> int:
    """Batch size from a JSON inference body; 1 when it cannot tell (the replica judges the
    body, the router only estimates cost).

    Open Inference Protocol v2: ``inputs[0].shape[0]``; KServe v1 / TF Serving: the length of
    ``instances`` or ``inputs``; else a top-level integer ``batch_size``.
    """
    if not body or len(body) > MAX_SIZE_PARSE_BYTES or "json" not in content_type:
        return 1
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:  # a ValueError: bad JSON or bad UTF-8
        return 1
    if not isinstance(doc, dict):
        return 1
    inputs = doc.get("inputs")
    if isinstance(inputs, list) and inputs:
        first = inputs[0]
        if isinstance(first, dict):
            shape = first.get("shape")
            if isinstance(shape, list) and shape and _ok(shape[0]):
                return int(shape[0])
            return 1
        return min(len(inputs), MAX_BATCH)
    instances = doc.get("instances")
    if isinstance(instances, list) and instances:
        return min(len(instances), MAX_BATCH)
    bs = doc.get("batch_size")
    return bs if isinstance(bs, int) and _ok(bs) else 1


def _ok(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= MAX_BATCH
