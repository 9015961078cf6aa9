"""Prometheus, the one place gpuslice talks to it: instant queries over its HTTP API
(``GET /api/v1/query``) and the text exposition format that ``/metrics`` endpoints serve
(read from a file, several scrapes concatenated). Errors are one :class:`ValidationError`
naming the option the URL or file came from."""

from __future__ import annotations

import http.client
import json
import math
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from gpuslice.core.errors import ValidationError

SERVER = "a Prometheus server answering GET /api/v1/query (like http://prometheus:9090)"
EXPOSITION = "a Prometheus text exposition (what a /metrics endpoint serves)"


@dataclass(frozen=True, slots=True)
class Sample:
    """One value of one series: its metric name, labels and value."""

    name: str
    labels: dict[str, str]
    value: float


def _words(exc: BaseException) -> str:
    """An exception in one line: urllib's reason where it has one ("connection refused")."""
    reason = getattr(exc, "reason", None)
    text = str(reason if reason is not None and not isinstance(exc, urllib.error.HTTPError)
               else exc)
    return " ".join(text.split()) or type(exc).__name__


def _get(url: str, field: str, timeout_s: float) -> bytes:
    """The body of ``url``; Prometheus's JSON error body where it answers 4xx/5xx with one."""
    # no proxy from the environment, as the aiohttp clients elsewhere in gpuslice (trust_env
    # off): a Prometheus on the cluster network is asked directly
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as r:
            body: bytes = r.read()
            return body
    except urllib.error.HTTPError as exc:
        body = exc.read() or b""
        if body.lstrip().startswith(b"{"):
            return body  # {"status": "error", "error": ...}: said below, with the reason
        raise ValidationError(field, SERVER, f"{url}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        raise ValidationError(field, SERVER, f"{url}: {_words(exc)}") from None


def instant_query(base_url: str, promql: str, *, field: str,
                  timeout_s: float = 30.0) -> list[Sample]:
    """The instant vector ``promql`` evaluates to now (``/api/v1/query``): one sample per
    series, named by its ``__name__`` label ("" for an expression's result). Values that are
    not finite numbers (a division by a zero cap) are left out."""
    url = f"{base_url.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    raw = _get(url, field, timeout_s)
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise ValidationError(field, SERVER, f"{base_url}: an answer that is not JSON "
                              f"({raw[:60]!r})") from None
    if not isinstance(doc, dict) or doc.get("status") != "success":
        said = doc.get("error") if isinstance(doc, dict) else None
        raise ValidationError(field, SERVER, f"{base_url}: "
                              f"{' '.join(str(said).split()) if said else 'no success status'}"
                              f" (query {promql})")
    data = doc.get("data")
    result = data.get("result") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("resultType") != "vector" or \
            not isinstance(result, list):
        raise ValidationError(field, SERVER, f"{base_url}: not an instant vector "
                              f"(query {promql})")
    out = []
    for item in result:
        try:
            metric, (_, value) = item["metric"], item["value"]
            labels = {str(k): str(v) for k, v in metric.items()}
            x = float(value)
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ValidationError(field, SERVER, f"{base_url}: a result that is not "
                                  f"{{metric, value: [time, number]}}: {item!r:.80}") from None
        if math.isfinite(x):
            out.append(Sample(labels.pop("__name__", ""), labels, x))
    return out


def read_exposition(path: Path, *, field: str) -> list[Sample]:
    """Every sample of a text exposition file (one or more scrapes concatenated)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValidationError(field, f"a Prometheus URL (http://...) or a file of {EXPOSITION}",
                              f"{path}: no such file") from None
    except UnicodeDecodeError:
        raise ValidationError(field, EXPOSITION, f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise ValidationError(field, EXPOSITION,
                              f"{path}: {exc.strerror or _words(exc)}") from None
    try:
        return [Sample(s.name, dict(s.labels), float(s.value))
                for fam in text_string_to_metric_families(text) for s in fam.samples]
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise ValidationError(field, EXPOSITION, f"{path}: {_words(exc)}") from None
