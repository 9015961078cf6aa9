"""Leader election over a Lease object, as a pure decision (the clock is passed in).

The holder renews the lease every few seconds; another candidate takes it only after it has
not been renewed for ``duration_s``. Writes go through the API server with the lease's
``resourceVersion``, so two candidates that decide to take it at once cannot both succeed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class LeaseAction(StrEnum):
    CREATE = "create"  # there is no lease: create it, holding it
    RENEW = "renew"  # we hold it: renew
    TAKE = "take"  # the holder let it expire: take it over
    WAIT = "wait"  # someone else holds a live lease


@dataclass(frozen=True, slots=True)
class LeaseState:
    holder: str
    renewed_at: float  # seconds, on the caller's clock
    duration_s: float
    transitions: int = 0


def decide(lease: LeaseState | None, me: str, now: float) -> LeaseAction:
    if lease is None:
        return LeaseAction.CREATE
    if lease.holder == me:
        return LeaseAction.RENEW
    if not lease.holder or now - lease.renewed_at > lease.duration_s:
        return LeaseAction.TAKE
    return LeaseAction.WAIT
