"""MIG instances as the extender sees them: the instances a MIG-isolated pod may take whole
(free, large enough), and the room MPS slices have inside the instances of MIG-enabled GPUs,
from the inventory and the ledger; and how a request maps to a sharing mode. :mod:`.view`'s
:class:`~.view.ClusterView` has these as methods; :mod:`.placement` decides with them."""

from __future__ import annotations

from dataclasses import dataclass

from gpuslice.adapters.kube.objects import InventoryMig
from gpuslice.core import catalog, migmps
from gpuslice.core.assignment import Assignment, Mode
from gpuslice.core.errors import ValidationError
from gpuslice.core.gpuselect import allows_gpu
from gpuslice.core.ledger import Ledger
from gpuslice.core.migmps import InstanceRoom
from gpuslice.core.model import Isolation, SliceRequest
from gpuslice.services.extender.inventory import Inventory

MigUse = dict[tuple[str, int], tuple[int, int, bool]]  # (GPU, start) -> milli, MiB, whole


@dataclass(frozen=True)
class MigWish:
    slices: int  # compute slices at least
    memory_mib: int
    models: frozenset[str]


def mig_wish(req: SliceRequest) -> MigWish:
    """A MIG-isolated request: the compute slices its milli stands for (3g for 429), memory."""
    return MigWish(max(1, round(req.milli * 7 / 1000)), req.gpu_memory_mib, req.models)


def memory_wish(req: SliceRequest) -> int | None:
    """MiB an MPS slice asks of a MIG instance: what the pod names, or None for its share of
    the instance's memory (its milli of the instance's)."""
    return None if req.memory_share and not req.gpu_memory_mib else req.gpu_memory_mib


def mode_of(req: SliceRequest) -> Mode:
    """The sharing mode a request gets: its isolation, a whole GPU exclusive, else MPS."""
    if req.isolation is Isolation.MIG:
        return Mode.MIG
    if req.isolation is Isolation.TIMESLICE:
        return Mode.TIMESLICE
    if req.milli == 1000 and req.isolation in (Isolation.ANY, Isolation.EXCLUSIVE):
        return Mode.EXCLUSIVE
    return Mode.MPS


class MigRooms:
    """The MIG side of the extender's view (a base of :class:`~.view.ClusterView`, which sets
    these attributes)."""

    inv: Inventory
    ledger: Ledger
    cordoned: set[str]
    _in_flight: dict[tuple[str, str], Assignment]
    _mig_use_of: tuple[Ledger, MigUse] | None

    # -- MPS slices inside MIG instances ----------------------------------------------------

    def _mig_use(self) -> MigUse:
        """What assignments hold of each MIG instance, from the ledger (which holds in-flight
        binds too); derived once per ledger value, which a bind or a pod's end replaces."""
        led = self.ledger
        cached = self._mig_use_of
        if cached is None or cached[0] is not led:
            cached = self._mig_use_of = (led, migmps.usage(led.owners.values()))
        return cached[1]

    def _mig_rooms(self, i: int, models: frozenset[str],
                   use: MigUse | None = None) -> list[InstanceRoom]:
        """The MIG instances of node ``i`` with what live assignments (or ``use``) hold."""
        if not self.inv.mig[i]:
            return []
        use = self._mig_use() if use is None else use
        out = []
        for gpu, model, m in self.inv.mig[i]:
            known = catalog.lookup(model)
            if known is None or known.mig is None or gpu in self.cordoned \
                    or not allows_gpu(models, model, m.uuid, gpu):
                continue
            try:
                slices = known.mig.profile(m.profile).compute_slices
            except ValidationError:  # a profile the catalogue does not know
                continue
            milli, mib, whole = use.get((gpu, m.start), (0, 0, False))
            out.append(InstanceRoom(gpu, m.profile, m.start,
                                    migmps.capacity_milli(slices, known.mig.compute_slices),
                                    m.memory_mib, milli, mib, whole))
        return out

    def _mig_room_for(self, i: int, req: SliceRequest,
                      profile: str = "") -> InstanceRoom | None:
        """The instance of node ``i`` for an MPS slice: the tightest of the planned
        ``profile`` when one has room, else the tightest of any profile."""
        if req.gpus != 1 or mode_of(req) is not Mode.MPS:
            return None
        rooms = self._mig_rooms(i, req.models)
        planned = [r for r in rooms if r.profile == profile]
        return migmps.best_instance(planned, req.milli, memory_wish(req)) or \
            migmps.best_instance(rooms, req.milli, memory_wish(req))

    # -- MIG instances named in assignments ------------------------------------------------

    def _taken_mig(self) -> set[tuple[str, int]]:
        """(GPU UUID, start) of the MIG instances that live assignments hold."""
        held = list(self.ledger.owners.values()) + list(self._in_flight.values())
        return {(g.uuid, g.mig_start) for a in held for c in a.containers for g in c.gpus
                if g.mig_profile}

    def _mig_fits(self, i: int, wish: MigWish,
                  taken: set[tuple[str, int]]) -> list[tuple[int, str, InventoryMig]]:
        """Free instances of node ``i`` big enough for ``wish``: (compute slices, GPU, inst)."""
        out = []
        for gpu, model, m in self.inv.mig[i]:
            known = catalog.lookup(model)
            if known is None or known.mig is None or (gpu, m.start) in taken \
                    or gpu in self.cordoned:
                continue
            if not allows_gpu(wish.models, model, m.uuid, gpu):
                continue
            size = known.mig.profile(m.profile).compute_slices
            if size >= wish.slices and m.memory_mib >= wish.memory_mib:
                out.append((size, gpu, m))
        return sorted(out, key=lambda x: (x[0], x[2].memory_mib, x[1], x[2].start))
