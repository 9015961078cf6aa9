"""What the router reads from an OpenAI-style request (``/v1/chat/completions``,
``/v1/completions``, ``/v1/embeddings``): the model named in the JSON body, whether the answer
is streamed, the prompt's tokens (a cheap estimate, no tokenizer: about four characters a
token, exact where the prompt is given as token ids) and the output tokens asked for; and the
answers it writes itself in OpenAI's shapes: errors and the ``/v1/models`` list.

Errors follow the shape vLLM's OpenAI server answers (``ErrorResponse`` in
vllm/entrypoints/openai: ``{"error": {"message", "type", "param", "code"}}``, ``code`` the HTTP
status, ``type`` e.g. ``NotFoundError`` for an unknown model, with 404), which OpenAI's clients
read as they read OpenAI's own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import orjson

ENDPOINTS: Mapping[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/embeddings": "embedding",
}
MODELS_PATH = "/v1/models"
CHARS_PER_TOKEN = 4.0  # OpenAI's rule of thumb for English text
MESSAGE_OVERHEAD = 4  # tokens of a chat message's framing (role, separators)
IMAGE_TOKENS = 576  # a guess for an image part (one 336-px tile of a LLaVA-style encoder)
COMPLETION_DEFAULT_MAX = 16  # OpenAI's (and vLLM's) default max_tokens of /v1/completions

_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
          413: "BadRequestError", 429: "RateLimitError", 502: "BadGatewayError",
          503: "ServiceUnavailableError", 504: "TimeoutError", 508: "LoopDetectedError"}


class OpenAIError(Exception):
    """A request the router refuses before any replica sees it; ``param`` names the field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    kind: str  # "chat", "completion" or "embedding"
    model: str
    stream: bool
    prompt_tokens: int
    max_tokens: int | None  # None: not said (a chat request may run to the model's limit)
    choices: int = 1


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": _TYPES.get(
        status, "InternalServerError" if status >= 500 else "BadRequestError"),
        "param": param, "code": status}})


def models_body(models: Iterable[tuple[str, str | None]], created: int) -> bytes:
    """``GET /v1/models``: every model and adapter the router's services serve (an adapter
    names its base model as ``parent``, as vLLM lists LoRA adapters)."""
    data = [{"id": m, "object": "model", "created": created, "owned_by": "gpuslice",
             "root": m if parent is None else None, "parent": parent}
            for m, parent in models]
    return orjson.dumps({"object": "list", "data": data})


def parse_request(kind: str, body: bytes) -> OpenAIRequest:
    """The fields the router needs from an OpenAI request body; the body itself is forwarded
    unchanged. A body that is not a JSON object, or names no model, is refused (400) with
    the field; other fields are the replica's to judge (a malformed ``max_tokens`` is taken
    as not given)."""
    try:
        doc = orjson.loads(body) if body else None
    except orjson.JSONDecodeError as exc:
        raise OpenAIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise OpenAIError(400, "the request body must be a JSON object with a model field")
    model = doc.get("model")
    if not isinstance(model, str) or not model.strip():
        raise OpenAIError(400, f"model: expected the name of a model (a non-empty string), "
                          f"got {_short(model)}", "model")
    if kind == "chat":
        prompt = messages_tokens(doc.get("messages"))
        out = _count(doc.get("max_completion_tokens", doc.get("max_tokens")))
    elif kind == "completion":
        prompt = prompt_tokens(doc.get("prompt"))
        raw = doc.get("max_tokens", COMPLETION_DEFAULT_MAX)
        out = COMPLETION_DEFAULT_MAX if raw is None else _count(raw)
    else:
        prompt = prompt_tokens(doc.get("input"))
        out = 0
    n = doc.get("n")
    choices = n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 128 else 1
    return OpenAIRequest(kind, model.strip(), doc.get("stream") is True, prompt, out, choices)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _count(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def text_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def prompt_tokens(prompt: object) -> int:
    """A completions ``prompt`` or an embeddings ``input``: a string, token ids, or a list of
    either."""
    if isinstance(prompt, str):
        return text_tokens(prompt)
    if isinstance(prompt, list):
        if all(isinstance(x, int) for x in prompt):
            return len(prompt)
        return sum(prompt_tokens(x) for x in prompt if isinstance(x, str | list))
    return 0


def messages_tokens(messages: object) -> int:
    """A chat request's ``messages``: the text of every message (a string, or parts of type
    text; image parts a fixed guess), plus a few tokens of framing each."""
    if not isinstance(messages, list):
        return 0
    total = 0
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        total += MESSAGE_OVERHEAD
        content = msg.get("content")
        if isinstance(content, str):
            total += text_tokens(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict):
                    text = part.get("text")
                    if isinstance(text, str):
                        total += text_tokens(text)
                    elif part.get("type") in ("image_url", "input_image", "image"):
                        total += IMAGE_TOKENS
    return total


def completion_tokens(body: bytes, limit: int = 1 << 20) -> int | None:
    """``usage.completion_tokens`` of a non-streamed answer (None when it has none)."""
    if not body or len(body) > limit:
        return None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    usage = doc.get("usage") if isinstance(doc, dict) else None
    n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None
