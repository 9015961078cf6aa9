"""The event loop the asyncio servers (extender, router) run on: uvloop where it is installed
(a dependency on Linux), else asyncio's own.

uvloop's loop and its TLS transport are compiled (Cython over libuv), where asyncio's selector
loop and its TLS layer (``asyncio.sslproto``, a memory BIO driven from Python) run every read,
write and callback in Python: the scheduler extender, which answers kube-scheduler over mutual
TLS for every pod, spent most of its CPU there (docs/scale.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a new loop (uvloop's where installed) and close it."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(main)
    return uvloop.run(main)
