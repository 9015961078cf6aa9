"""Router config and planner plan files (JSON or TOML) -> validated :class:`RouterConfig`."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from gpuslice.core.errors import ValidationError
from gpuslice.core.routing_config import RouterConfig, parse_router_config


def read_text(path: Path, field: str) -> str:
    """A user's input file as text; missing or unreadable is one line naming ``field``."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValidationError(field, "an existing file", str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValidationError(field, "a readable UTF-8 file", f"{path}: {exc}") from None


def read_document(path: Path, field: str = "--config") -> object:
    text = read_text(path, field)
    if path.suffix.lower() == ".toml":
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValidationError(str(path), "valid TOML", str(exc)) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValidationError(str(path), "valid JSON",
                              f"{exc.msg} at line {exc.lineno} column {exc.colno}") from None


def read_config(path: Path, *, need_urls: bool = True, field: str = "--config") -> RouterConfig:
    """Read and validate a router config or a planner plan; errors name the file and field."""
    doc = read_document(path, field)
    try:
        return parse_router_config(doc, need_urls=need_urls)
    except ValidationError as exc:
        raise ValidationError(f"{path}: {exc.field}", exc.expected, exc.got) from None
