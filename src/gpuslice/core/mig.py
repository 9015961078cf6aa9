"""MIG geometry: which sets of GPU instances a MIG-capable GPU can hold.

A GPU instance occupies ``memory_slices`` consecutive memory slices starting at one of its
profile's allowed starts; instances may not overlap, the compute slices they use may not exceed
the GPU's, and no profile may have more than its ``max_instances``. These are the rules NVML
enforces in ``nvmlDeviceCreateGpuInstanceWithPlacement``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from gpuslice.core.catalog import MigGeometry, MigProfile
from gpuslice.core.errors import ValidationError


@dataclass(frozen=True, slots=True)
class MigPlacement:
    """One GPU instance: a profile at a start memory slice."""

    start: int
    profile: MigProfile

    @property
    def end(self) -> int:
        return self.start + self.profile.memory_slices

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.start, -self.profile.memory_slices, self.profile.profile_id)

    def __str__(self) -> str:
        return f"{self.profile.name}@{self.start}"


def _sorted(layout: Iterable[MigPlacement]) -> list[MigPlacement]:
    return sorted(layout, key=lambda p: p.key)


def layout_problems(geometry: MigGeometry, layout: Iterable[MigPlacement]) -> list[str]:
    """Every reason ``layout`` cannot exist on a GPU of ``geometry`` (empty when it can)."""
    items = _sorted(layout)
    problems: list[str] = []
    known = {p.profile_id for p in geometry.profiles}
    for pl in items:
        if pl.profile.profile_id not in known:
            problems.append(f"{pl}: profile {pl.profile.name} is not offered by this GPU")
        elif pl.start not in pl.profile.starts:
            starts = ",".join(str(s) for s in pl.profile.starts)
            problems.append(f"{pl}: start {pl.start} is not one of the allowed starts {starts}")
    occupied: dict[int, MigPlacement] = {}
    for pl in items:
        for s in pl.profile.span(pl.start):
            if s >= geometry.memory_slices:
                problems.append(f"{pl}: memory slice {s} is past the GPU's last slice")
            elif s in occupied:
                problems.append(f"{pl}: memory slice {s} is already used by {occupied[s]}")
            else:
                occupied[s] = pl
    compute = sum(pl.profile.compute_slices for pl in items)
    if compute > geometry.compute_slices:
        problems.append(
            f"layout uses {compute} compute slices, the GPU has {geometry.compute_slices}"
        )
    counts = Counter(pl.profile.profile_id for pl in items)
    for pl_id, n in sorted(counts.items()):
        prof = geometry.profile(pl_id) if pl_id in known else None
        if prof is not None and n > prof.max_instances:
            problems.append(f"{n} instances of {prof.name}, at most {prof.max_instances} allowed")
    return problems


def is_valid_layout(geometry: MigGeometry, layout: Iterable[MigPlacement]) -> bool:
    return not layout_problems(geometry, layout)


def fitting_placements(
    geometry: MigGeometry, used: Iterable[MigPlacement], *, include_media: bool = True
) -> list[MigPlacement]:
    """Every (profile, start) that can still be created next to the instances in ``used``."""
    current = list(used)
    out: list[MigPlacement] = []
    for prof in geometry.profiles:
        if not include_media and prof.name.endswith("+me"):
            continue
        for start in prof.starts:
            cand = MigPlacement(start, prof)
            if is_valid_layout(geometry, [*current, cand]):
                out.append(cand)
    return out


def fitting_profiles(
    geometry: MigGeometry, used: Iterable[MigPlacement], *, include_media: bool = True
) -> list[MigProfile]:
    """The profiles that still fit on a partly used GPU, each once, largest first."""
    seen: dict[int, MigProfile] = {}
    for pl in fitting_placements(geometry, used, include_media=include_media):
        seen.setdefault(pl.profile.profile_id, pl.profile)
    return sorted(seen.values(), key=lambda p: (-p.compute_slices, -p.memory_slices, p.name))


def maximal_layouts(
    geometry: MigGeometry, *, include_media: bool = False,
    profiles: Iterable[MigProfile] | None = None,
) -> list[tuple[MigPlacement, ...]]:
    """All layouts to which no further instance can be added, each once, sorted by start.

    ``+me`` profiles (one per GPU, with the media engines) are left out unless
    ``include_media`` is set; they only repeat the geometry of their plain twin. ``profiles``
    restricts the layouts to those profiles (maximal among layouts made of them).
    """
    allowed = list(geometry.profiles if profiles is None else profiles)
    candidates = _sorted(
        MigPlacement(start, prof)
        for prof in allowed
        if include_media or not prof.name.endswith("+me")
        for start in prof.starts
    )
    found: set[tuple[MigPlacement, ...]] = set()

    def extend(layout: list[MigPlacement], first: int) -> None:
        grown = False
        for i in range(len(candidates)):
            cand = candidates[i]
            if is_valid_layout(geometry, [*layout, cand]):
                grown = True
                if i >= first:
                    extend([*layout, cand], i + 1)
        if not grown:
            found.add(tuple(_sorted(layout)))

    extend([], 0)
    return sorted(found, key=lambda lay: [p.key for p in lay])


def check_layout(geometry: MigGeometry, layout: Iterable[MigPlacement],
                 where: str = "mig layout") -> list[MigPlacement]:
    """``layout`` as a list when a GPU of ``geometry`` can hold it; else a
    :class:`ValidationError` naming ``where`` and every problem."""
    items = list(layout)
    problems = layout_problems(geometry, items)
    if problems:
        raise ValidationError(where, "instances that fit one GPU together", "; ".join(problems))
    return items


def parse_layout(geometry: MigGeometry, text: str, *, check: bool = False) -> list[MigPlacement]:
    """Parse ``"3g.40gb@0,2g.20gb@4,1g.10gb@6"`` (profile name or ID ``@`` start). With
    ``check``, a layout no GPU of ``geometry`` can hold (overlapping or repeated instances, a
    start the profile does not allow, ...) is refused (:func:`check_layout`)."""
    out: list[MigPlacement] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        name, sep, start = item.partition("@")
        # a start or profile ID is a slice index: a few digits (an int of 5000 would be a
        # ValueError, not a layout error)
        if not sep or not start.strip().isdigit() or len(start.strip()) > 3:
            raise ValidationError("mig layout", "items like '3g.40gb@0'", item[:80])
        key: int | str = int(name) if name.strip().isdigit() and len(name.strip()) <= 3 \
            else name.strip()
        out.append(MigPlacement(int(start), geometry.profile(key)))
    return check_layout(geometry, out) if check else out


def layout_for_counts(geometry: MigGeometry, counts: dict[str, int]) -> list[MigPlacement]:
    """A valid layout with exactly ``counts`` instances per profile name (mig-parted's
    ``mig-devices``), largest profiles placed first; raises when none exists.

    Counts over a profile's ``max_instances``, or more compute or memory slices than the GPU
    has, are refused before any search; the search places the instances of one profile at
    increasing starts (each set of starts is tried once, not in every order)."""
    wanted: list[MigProfile] = []
    for name, n in counts.items():
        if n < 0:
            raise ValidationError(f"mig-devices {name}", "a count >= 0",
                                  n if n > -10**9 else "a huge negative count")
        prof = geometry.profile(name)
        if n > prof.max_instances:
            raise ValidationError(f"mig-devices {name}",
                                  f"at most {prof.max_instances}: no more fits one GPU",
                                  n if n < 10**9 else "a count over 10**9")
        wanted.extend([prof] * n)
    wanted.sort(key=lambda p: (-p.memory_slices, -p.compute_slices, p.profile_id))
    shown = ", ".join(f"{n} x {k}" for k, n in counts.items())
    if (sum(p.compute_slices for p in wanted) > geometry.compute_slices
            or sum(p.memory_slices for p in wanted) > geometry.memory_slices):
        raise ValidationError("mig-devices", "a combination that fits one GPU", shown)

    def place(i: int, layout: list[MigPlacement]) -> list[MigPlacement] | None:
        if i == len(wanted):
            return layout
        # the same profile as the instance before it: only later starts (no permutations)
        after = layout[-1].start if i and wanted[i - 1] == wanted[i] else -1
        for start in wanted[i].starts:
            if start <= after:
                continue
            cand = [*layout, MigPlacement(start, wanted[i])]
            if is_valid_layout(geometry, cand):
                found = place(i + 1, cand)
                if found is not None:
                    return found
        return None

    found = place(0, [])
    if found is None:
        raise ValidationError("mig-devices", "a combination that fits one GPU", shown)
    return _sorted(found)


@dataclass(frozen=True, slots=True)
class MigChange:
    action: str  # "destroy" or "create"
    placement: MigPlacement

    def __str__(self) -> str:
        return f"{self.action} {self.placement}"


def layout_changes(current: Iterable[MigPlacement],
                   desired: Iterable[MigPlacement]) -> list[MigChange]:
    """What turns ``current`` into ``desired``: instances to destroy (first), then to create;
    instances already where they should be are kept. A ``desired`` no GPU can hold (the same
    instance twice, overlapping instances, a start its profile does not allow, more instances
    of a profile than it allows) is refused, before anything is changed."""
    want_list = list(desired)
    problems = _self_conflicts(want_list)
    if problems:
        shown = ",".join(str(p) for p in _sorted(want_list))
        raise ValidationError("mig layout", f"instances that fit one GPU together ({shown})",
                              "; ".join(problems))
    cur = {(p.start, p.profile.profile_id): p for p in current}
    want = {(p.start, p.profile.profile_id): p for p in want_list}
    out = [MigChange("destroy", p) for k, p in sorted(cur.items()) if k not in want]
    out += [MigChange("create", p) for k, p in sorted(want.items()) if k not in cur]
    return out


def _self_conflicts(layout: list[MigPlacement]) -> list[str]:
    """The problems of ``layout`` that need no GPU geometry: overlaps (repeats included),
    starts a profile does not allow, too many instances of a profile (a geometry as large as
    the layout itself, so that only these can show)."""
    if not layout:
        return []
    profiles = {p.profile.profile_id: p.profile for p in layout}
    roomy = MigGeometry(max(p.end for p in layout), sum(p.profile.compute_slices for p in layout),
                        tuple(profiles.values()))
    return layout_problems(roomy, layout)
