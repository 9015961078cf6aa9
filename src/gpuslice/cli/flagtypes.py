"""The parsers of option values: argparse ``type=`` functions that refuse a bad number at
parse time with the option's name ("argument --window: expected a positive number, got
'-5'"), and the parsers of structured option values (``--lease``, ``--seeds``, ``--policy``,
``HOST:PORT``) that raise :class:`ValidationError` naming the option."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from gpuslice.core.errors import ValidationError
from gpuslice.core.policies import ALIASES, make_policy, policy_names


def parse_lease(text: str, expected: str = "NAMESPACE/NAME",
                flag: str = "--lease") -> tuple[str, str]:
    """``--lease``'s value (or ``flag``'s): (namespace, name)."""
    ns, sep, name = text.partition("/")
    if not sep or not ns or not name or "/" in name:
        raise ValidationError(flag, expected, text)
    return ns, name


def parse_seeds(text: str) -> list[int]:
    """``42-51``, ``42,43`` or ``42`` -> a list of seeds."""
    seeds: list[int] = []
    for part in text.split(","):
        item = part.strip()
        if not item:
            continue
        lo, sep, hi = item.partition("-")
        try:
            if sep:
                a, b = int(lo), int(hi)
                if b < a:
                    raise ValueError
                seeds.extend(range(a, b + 1))
            else:
                seeds.append(int(item))
        except ValueError:
            raise ValidationError("--seeds", "seeds like 42-51, 42,43 or 42", text) from None
    if not seeds:
        raise ValidationError("--seeds", "at least one seed", text)
    return seeds


def parse_policies(text: str) -> list[str]:
    """``--policy a,b``: the policies, each once: a name and its alias (``ours`` is
    ``frag-strand``) are one policy, so one row, under the spelling given first."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise ValidationError("--policy", f"policy names from {', '.join(policy_names())}", text)
    out: dict[str, str] = {}  # the policy -> the spelling kept
    for n in names:
        try:
            make_policy(n)
        except ValidationError as exc:
            raise ValidationError("--policy", exc.expected, n) from None
        out.setdefault(ALIASES.get(n, n), n)
    return list(out.values())


def _finite(text: str, ok: Callable[[float], bool], expected: str) -> float:
    """A finite number for which ``ok`` holds, else argparse's error "expected ..."."""
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and ok(x)):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return x


def positive_float(text: str) -> float:
    """argparse ``type=``: a finite number > 0 (seconds, a window, a limit), refused at parse
    time with the option's name."""
    return _finite(text, lambda x: x > 0, "a positive number")


def fraction(text: str) -> float:
    """argparse ``type=``: a finite number in (0, 1] (a share, as ``plan --latency-factor``'s
    of the SLO)."""
    return _finite(text, lambda x: 0 < x <= 1, "a fraction, more than 0 and at most 1")


def non_negative_int(text: str) -> int:
    """argparse ``type=``: a whole number >= 0 (a seed)."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return n


def positive_int(text: str) -> int:
    """argparse ``type=``: a whole number >= 1 (a count of workers)."""
    n = non_negative_int(text) if text.strip().lstrip("+").isdigit() else 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return n


def non_negative_float(text: str) -> float:
    """argparse ``type=``: a finite number >= 0 (0 where it means "at once" or "none")."""
    return _finite(text, lambda x: x >= 0, "a number >= 0")


def parse_hostport(field_name: str, text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``PORT`` (every interface) of a listening option, the port 0..65535
    (0: any free one); an IPv6 host in brackets."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "0.0.0.0", text
    if not (port.isascii() and port.isdigit()) or len(port) > 5 or not 0 <= int(port) <= 65535:
        raise ValidationError(field_name, "HOST:PORT or PORT, the port from 0 to 65535", text)
    return host.strip("[]") or "0.0.0.0", int(port)
