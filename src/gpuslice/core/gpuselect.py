"""GPU selection per pod: which GPU models and which GPUs (by UUID) a pod may be given.

One rule, read from the pod's annotations, for every part that places a pod: the admission
webhook (which refuses a selection nothing could ever match), the extender and the DRA claim
allocator. Two spellings are read:

| gpuslice | HAMi (the anchor) | meaning |
|---|---|---|
| ``gpuslice.io/gpu-model: "T4|L4"`` | ``nvidia.com/use-gputype: "T4,L4"`` | only these models |
| ``gpuslice.io/gpu-model-exclude`` | ``nvidia.com/nouse-gputype`` | never these models |
| ``gpuslice.io/gpu-uuid`` | ``nvidia.com/use-gpuuuid`` | only these GPUs |
| ``gpuslice.io/gpu-uuid-exclude`` | ``nvidia.com/nouse-gpuuuid`` | never these GPUs |

Lists take ``|`` or ``,`` between items. gpuslice's model names match a model by its name or
one of its catalogue aliases (case and ``-``/``_``/space insensitive: ``a100-80gb`` is
``A100-80GB``, ``A100-SXM4-80GB`` too); HAMi's match as HAMi does, as a case-insensitive part
of the model's name (``A100`` selects ``A100-40GB`` and ``A100-80GB``). The includes of both
spellings add up (a model either names is allowed), and so do the excludes; an exclude wins
over an include. A MIG instance's UUID (``MIG-...``) selects that instance, its GPU's UUID every
instance of the GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from gpuslice.core import catalog
from gpuslice.core.errors import ValidationError

MODEL = "gpuslice.io/gpu-model"
MODEL_EXCLUDE = "gpuslice.io/gpu-model-exclude"
UUID = "gpuslice.io/gpu-uuid"
UUID_EXCLUDE = "gpuslice.io/gpu-uuid-exclude"
HAMI_MODEL = "nvidia.com/use-gputype"
HAMI_MODEL_EXCLUDE = "nvidia.com/nouse-gputype"
HAMI_UUID = "nvidia.com/use-gpuuuid"
HAMI_UUID_EXCLUDE = "nvidia.com/nouse-gpuuuid"
ANNOTATIONS = (MODEL, MODEL_EXCLUDE, UUID, UUID_EXCLUDE, HAMI_MODEL, HAMI_MODEL_EXCLUDE,
               HAMI_UUID, HAMI_UUID_EXCLUDE)
MAX_ITEMS = 256  # names per annotation: more than any cluster's models or a node's GPUs


def _norm(name: str) -> str:
    return name.strip().upper().replace(" ", "-").replace("_", "-")


def model_key(name: str) -> str:
    """The key two spellings of one model share: the catalogue's name for a known model or
    alias, else the name normalised (case, separators, an ``NVIDIA-``/``TESLA-`` prefix)."""
    known = catalog.lookup(name)
    if known is not None:
        return known.name.upper()
    return _norm(name).removeprefix("NVIDIA-").removeprefix("TESLA-")


def split_list(text: str, field: str) -> frozenset[str]:
    """The items of a ``|`` or ``,`` separated annotation value (blanks dropped)."""
    items = [p.strip() for p in text.replace(",", "|").split("|")]
    out = frozenset(p for p in items if p)
    if len(out) > MAX_ITEMS:
        raise ValidationError(field, f"at most {MAX_ITEMS} names", len(out))
    return out


@dataclass(frozen=True, slots=True)
class GpuSelection:
    """The GPUs a pod accepts; empty sets put no constraint."""

    models: frozenset[str] = frozenset()  # exact (catalogue-aware) names
    model_parts: frozenset[str] = frozenset()  # HAMi's: a part of the name
    exclude_models: frozenset[str] = frozenset()
    exclude_model_parts: frozenset[str] = frozenset()
    uuids: frozenset[str] = frozenset()
    exclude_uuids: frozenset[str] = frozenset()

    @property
    def empty(self) -> bool:
        return not (self.models or self.model_parts or self.exclude_models
                    or self.exclude_model_parts or self.uuids or self.exclude_uuids)

    @property
    def by_model(self) -> bool:
        """Whether the selection says anything about models."""
        return bool(self.models or self.model_parts or self.exclude_models
                    or self.exclude_model_parts)

    def allows_model(self, model: str) -> bool:
        key = model_key(model)
        upper = _norm(model)
        if key in {model_key(m) for m in self.exclude_models} or any(
                _norm(p) in upper for p in self.exclude_model_parts):
            return False
        if not (self.models or self.model_parts):
            return True
        return key in {model_key(m) for m in self.models} or any(
            _norm(p) in upper for p in self.model_parts)

    def allows_uuid(self, uuid: str, gpu_uuid: str = "") -> bool:
        """Whether the GPU (or MIG instance ``uuid`` of the GPU ``gpu_uuid``) may be used."""
        names = {uuid, gpu_uuid} - {""}
        if names & self.exclude_uuids:
            return False
        return not self.uuids or bool(names & self.uuids)

    def allows(self, model: str, uuid: str, gpu_uuid: str = "") -> bool:
        return self.allows_model(model) and self.allows_uuid(uuid, gpu_uuid)

    def allowed_models(self, models: Iterable[str]) -> frozenset[str]:
        """Those of ``models`` (names as the nodes report them) the selection allows."""
        return frozenset(m for m in models if self.allows_model(m))


class ModelSet(frozenset[str]):
    """The GPUs a pod accepts, carried where placement reads a set of model names
    (``SliceRequest.models`` in the extender and the simulator, ``DeviceRequest.models`` in
    the DRA claim allocator): ``model in models`` is :meth:`GpuSelection.allows_model`, the
    one rule, and :func:`allows_gpu` adds the UUIDs; the items describe the selection (``!``
    an exclude, ``*..*`` a part of a name, ``@`` a UUID) for messages and cache keys, and an
    empty set, as before, accepts any model."""

    selection: GpuSelection

    def __new__(cls, sel: GpuSelection) -> ModelSet:
        items = [*sel.models, *(f"*{p}*" for p in sel.model_parts),
                 *(f"!{m}" for m in sel.exclude_models),
                 *(f"!*{p}*" for p in sel.exclude_model_parts),
                 *(f"@{u}" for u in sel.uuids), *(f"!@{u}" for u in sel.exclude_uuids)]
        out = super().__new__(cls, items)
        out.selection = sel
        return out

    def __contains__(self, model: object) -> bool:
        return isinstance(model, str) and self.selection.allows_model(model)


def accepted_models(annotations: Mapping[str, object], where: str = "pod") -> frozenset[str]:
    """The GPUs a pod accepts, by its annotations: a :class:`ModelSet` when it says anything
    about models or UUIDs, else the empty set (any)."""
    sel = selection(annotations, where)
    return frozenset() if sel.empty else ModelSet(sel)


def by_uuid(models: frozenset[str]) -> GpuSelection | None:
    """The selection behind ``models`` when it names GPUs by UUID (which the placement's
    arrays of GPU slots must then close to the pod: :func:`slot_mask`), else None."""
    if isinstance(models, ModelSet):
        sel = models.selection
        if sel.uuids or sel.exclude_uuids:
            return sel
    return None


def allows_gpu(models: frozenset[str], model: str, uuid: str = "",
               gpu_uuid: str = "") -> bool:
    """Whether a request accepting ``models`` may be given the GPU (or the MIG instance
    ``uuid`` of the GPU ``gpu_uuid``) of ``model``: the one rule for every placing part."""
    if isinstance(models, ModelSet):
        return models.selection.allows(model, uuid, gpu_uuid)
    return not models or model in models


def slot_mask(sel: GpuSelection, uuids: Sequence[Sequence[str]],
              width: int) -> npt.NDArray[np.bool_]:
    """Per node (rows) and GPU slot (columns, ``width`` of them), whether ``sel`` lets the
    pod use the whole GPU (or a share of it) whose UUID is ``uuids[row][slot]``."""
    out = np.zeros((len(uuids), max(width, 1)), dtype=np.bool_)
    for i, row in enumerate(uuids):
        for j, u in enumerate(row):
            out[i, j] = sel.allows_uuid(u)
    return out


def selection(annotations: Mapping[str, object], where: str = "pod") -> GpuSelection:
    """The pod's selection from its annotations (see the module docstring); a value that is
    not text is a :class:`ValidationError` naming the annotation."""

    def read(key: str) -> frozenset[str]:
        raw = annotations.get(key)
        if raw is None:
            return frozenset()
        if not isinstance(raw, str):
            raise ValidationError(f"{where}: annotation {key}", "a list of names (text)",
                                  type(raw).__name__)
        return split_list(raw, f"{where}: annotation {key}")

    return GpuSelection(
        models=read(MODEL), model_parts=read(HAMI_MODEL),
        exclude_models=read(MODEL_EXCLUDE), exclude_model_parts=read(HAMI_MODEL_EXCLUDE),
        uuids=read(UUID) | read(HAMI_UUID), exclude_uuids=read(UUID_EXCLUDE) | read(
            HAMI_UUID_EXCLUDE))


def contradictions(sel: GpuSelection, where: str = "pod") -> list[str]:
    """What makes the selection unable to match any GPU whatever the cluster holds: every
    included model or UUID also excluded. Each names the annotations."""
    out: list[str] = []
    if sel.models and not sel.model_parts and all(
            not sel.allows_model(m) for m in sel.models):
        out.append(f"{where}: annotation {MODEL} names only models that "
                   f"{MODEL_EXCLUDE}/{HAMI_MODEL_EXCLUDE} exclude "
                   f"({', '.join(sorted(sel.models))})")
    if sel.uuids and sel.uuids <= sel.exclude_uuids:
        out.append(f"{where}: annotation {UUID}/{HAMI_UUID} names only GPUs that "
                   f"{UUID_EXCLUDE}/{HAMI_UUID_EXCLUDE} exclude "
                   f"({', '.join(sorted(sel.uuids))})")
    return out
