"""GPU catalogue: the models gpuslice knows, as pure data.

Figures are the vendors' published ones: memory in MiB (nominal: GiB x 1024), streaming
multiprocessors, dense (no sparsity) FP16/BF16 tensor TFLOPS, and whether MPS can cap a
client's compute (Volta and newer). MIG profile tables come from
``shared/reference/protocols.md`` section 4.2 (NVIDIA's MIG user guide and NVML captures).
SM counts of MIG profiles differ between SKUs: the node agent reads them from NVML, the figures
here are the catalogue's defaults.

Unknown models (the Alibaba trace's ``G2`` and ``G3``) are served as opaque models through
:func:`opaque_model`: a name and a memory size, nothing else assumed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpuslice.core.errors import ValidationError


@dataclass(frozen=True, slots=True)
class MigProfile:
    """A GPU-instance profile: ``memory_slices`` consecutive memory slices starting at one of
    ``starts``, ``compute_slices`` of the GPU's compute slices."""

    profile_id: int
    name: str
    compute_slices: int
    memory_slices: int
    memory_mib: int
    sms: int
    max_instances: int
    starts: tuple[int, ...]

    def span(self, start: int) -> range:
        return range(start, start + self.memory_slices)


@dataclass(frozen=True, slots=True)
class MigGeometry:
    """The slice counts of a MIG-capable GPU and its GPU-instance profiles."""

    memory_slices: int
    compute_slices: int
    profiles: tuple[MigProfile, ...]

    def profile(self, key: int | str) -> MigProfile:
        for p in self.profiles:
            if key in (p.profile_id, p.name):
                return p
        names = ", ".join(f"{p.name} ({p.profile_id})" for p in self.profiles)
        raise ValidationError("mig profile", f"one of {names}", key)


@dataclass(frozen=True, slots=True)
class GpuModel:
    """One GPU model of the catalogue."""

    name: str
    memory_mib: int
    sms: int | None = None
    fp16_tflops: float | None = None
    bf16_tflops: float | None = None
    compute_capability: tuple[int, int] | None = None
    mps: bool = False
    mps_limits: bool = False
    aliases: tuple[str, ...] = ()
    mig: MigGeometry | None = field(default=None)
    opaque: bool = False

    @property
    def mig_capable(self) -> bool:
        return self.mig is not None


def _p(
    pid: int, name: str, c: int, m: int, mib: int, sms: int, mx: int, starts: tuple[int, ...]
) -> MigProfile:
    return MigProfile(pid, name, c, m, mib, sms, mx, starts)


_ALL7 = (0, 1, 2, 3, 4, 5, 6)


def _seven_slice(names: tuple[str, str, str, str, str, str, str], mib: tuple[int, ...],
                 sms: tuple[int, ...]) -> MigGeometry:
    """A100/H100/H200 geometry: 8 memory slices, 7 compute slices, the same IDs and starts."""
    return MigGeometry(
        memory_slices=8,
        compute_slices=7,
        profiles=(
            _p(19, names[0], 1, 1, mib[0], sms[0], 7, _ALL7),
            _p(20, names[1], 1, 1, mib[1], sms[1], 1, _ALL7),
            _p(15, names[2], 1, 2, mib[2], sms[2], 4, (0, 2, 4, 6)),
            _p(14, names[3], 2, 2, mib[3], sms[3], 3, (0, 2, 4)),
            _p(9, names[4], 3, 4, mib[4], sms[4], 2, (0, 4)),
            _p(5, names[5], 4, 4, mib[5], sms[5], 1, (0,)),
            _p(0, names[6], 7, 8, mib[6], sms[6], 1, (0,)),
        ),
    )


def _gib(x: float) -> int:
    return round(x * 1024)


A100_40_MIG = _seven_slice(
    ("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
    tuple(_gib(x) for x in (4.75, 4.75, 9.62, 9.62, 19.50, 19.50, 39.25)),
    (14, 14, 14, 28, 42, 56, 98),
)
A100_80_MIG = _seven_slice(
    ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    tuple(_gib(x) for x in (9.50, 9.50, 19.50, 19.50, 39.25, 39.25, 79.00)),
    (14, 14, 14, 28, 42, 56, 98),
)
H100_SXM_MIG = _seven_slice(
    ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    (9984, 9984, 20096, 20096, 40448, 40448, 81152),
    (16, 16, 26, 32, 60, 64, 132),
)
H100_PCIE_MIG = _seven_slice(
    ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    (9984, 9984, 20096, 20096, 40448, 40448, 81152),
    (14, 14, 14, 30, 46, 62, 114),
)
H200_MIG = _seven_slice(
    ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
    (16384, 16384, 33280, 33280, 71424, 71424, 143360),
    (16, 16, 26, 32, 60, 64, 132),
)
A30_MIG = MigGeometry(
    memory_slices=4,
    compute_slices=4,
    profiles=(
        _p(14, "1g.6gb", 1, 1, _gib(5.81), 14, 4, (0, 1, 2, 3)),
        _p(21, "1g.6gb+me", 1, 1, _gib(5.81), 14, 1, (0, 1, 2, 3)),
        _p(5, "2g.12gb", 2, 2, _gib(11.69), 28, 2, (0, 2)),
        _p(6, "2g.12gb+me", 2, 2, _gib(11.69), 28, 1, (0, 2)),
        _p(0, "4g.24gb", 4, 4, _gib(23.44), 56, 1, (0,)),
    ),
)

_MODELS: tuple[GpuModel, ...] = (
    GpuModel("P100", 16384, 56, 18.7, None, (6, 0), mps=True, mps_limits=False,
             aliases=("Tesla-P100", "P100-PCIE-16GB")),
    GpuModel("T4", 15360, 40, 65.0, None, (7, 5), mps=True, mps_limits=True,
             aliases=("Tesla-T4",)),
    GpuModel("V100M16", 16384, 80, 125.0, None, (7, 0), mps=True, mps_limits=True,
             aliases=("V100-16GB", "V100-SXM2-16GB", "V100-PCIE-16GB")),
    GpuModel("V100M32", 32768, 80, 125.0, None, (7, 0), mps=True, mps_limits=True,
             aliases=("V100-32GB", "V100-SXM2-32GB", "V100-PCIE-32GB")),
    GpuModel("A10", 24576, 72, 125.0, 125.0, (8, 6), mps=True, mps_limits=True),
    GpuModel("A30", 24576, 56, 165.0, 165.0, (8, 0), mps=True, mps_limits=True, mig=A30_MIG),
    GpuModel("L4", 24576, 58, 121.0, 121.0, (8, 9), mps=True, mps_limits=True),
    GpuModel("L40S", 49152, 142, 362.0, 362.0, (8, 9), mps=True, mps_limits=True),
    GpuModel("A100-40GB", 40960, 108, 312.0, 312.0, (8, 0), mps=True, mps_limits=True,
             aliases=("A100-SXM4-40GB", "A100-PCIE-40GB", "A100"), mig=A100_40_MIG),
    GpuModel("A100-80GB", 81920, 108, 312.0, 312.0, (8, 0), mps=True, mps_limits=True,
             aliases=("A100-SXM4-80GB", "A100-PCIE-80GB", "A100-80GB-PCIE", "A100M80"),
             mig=A100_80_MIG),
    GpuModel("H100-SXM", 81920, 132, 989.0, 989.0, (9, 0), mps=True, mps_limits=True,
             aliases=("H100-80GB-HBM3", "H100", "H100-SXM5-80GB"), mig=H100_SXM_MIG),
    GpuModel("H100-PCIE", 81920, 114, 756.0, 756.0, (9, 0), mps=True, mps_limits=True,
             aliases=("H100-PCIe", "H100-PCIE-80GB"), mig=H100_PCIE_MIG),
    GpuModel("H200", 144384, 132, 989.0, 989.0, (9, 0), mps=True, mps_limits=True,
             aliases=("H200-141GB",), mig=H200_MIG),
)


def _index(models: tuple[GpuModel, ...]) -> Mapping[str, GpuModel]:
    out: dict[str, GpuModel] = {}
    for m in models:
        for key in (m.name, *m.aliases):
            out[_norm(key)] = m
    return out


def _norm(name: str) -> str:
    key = name.strip().upper().replace(" ", "-").replace("_", "-")
    return key.removeprefix("NVIDIA-").removeprefix("TESLA-")


_BY_NAME = _index(_MODELS)


def mig_table_differences(model: GpuModel, reported: Iterable[MigProfile]) -> list[str]:
    """The GPU-instance profiles on which a driver's table (NVML's, with their placements)
    and the catalogue's for ``model`` disagree, by name; [] when they agree."""
    known = {p.profile_id: p for p in model.mig.profiles} if model.mig else {}
    seen = {p.profile_id: p for p in reported}
    return sorted({(seen.get(i) or known[i]).name for i in known.keys() | seen.keys()
                   if known.get(i) != seen.get(i)})


def known_models() -> tuple[GpuModel, ...]:
    """Every model of the catalogue, in a stable order."""
    return _MODELS


def lookup(name: str) -> GpuModel | None:
    """The catalogue entry for ``name`` (case and separator insensitive, aliases accepted)."""
    return _BY_NAME.get(_norm(name))


def opaque_model(name: str, memory_mib: int) -> GpuModel:
    """A model the catalogue does not know: only its name and memory are used."""
    if not name.strip():
        raise ValidationError("gpu model", "a non-empty name", name)
    # a whole number: text, a float (NaN, infinity, 1.5) or a bool from a user's file is not
    if not isinstance(memory_mib, int) or isinstance(memory_mib, bool) or memory_mib <= 0:
        raise ValidationError("gpu memory_mib", "a positive whole number of MiB", memory_mib)
    return GpuModel(name=name.strip(), memory_mib=memory_mib, opaque=True)


def resolve(name: str, memory_mib: int | None = None) -> GpuModel:
    """The catalogue model for ``name``, or an opaque one when ``memory_mib`` is given.

    Raises :class:`ValidationError` for an unknown model without a memory size.
    """
    found = lookup(name)
    if found is not None:
        return found
    if memory_mib is None:
        known = ", ".join(m.name for m in _MODELS)
        raise ValidationError(
            "gpu model", f"a known model ({known}) or an opaque model with its memory", name
        )
    return opaque_model(name, memory_mib)
