"""A simulated GPU's speed: how long a model takes on a slice of a GPU (the demo, fake timers).

One small, documented model drives both sides of the demo, so the plan and the replicas agree:
the planner's profiles are drawn from it, and each simulated replica serves with the service
time it gives for the slice its pod was actually handed (GPU model from the device plugin's
``NVIDIA_VISIBLE_DEVICES``, share from ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``).

- A GPU's speed relative to a T4 is ``(fp16 TFLOPS / 65) ** 0.6`` from the catalogue (inference
  gains less than peak FLOPS): V100 1.5x, A100 2.6x, H100 5.1x.
- A slice with a fraction ``f`` of the GPU runs at ``f ** 0.8`` of its speed: small slices are
  relatively more efficient, which is why sharing pays.
- A batch of ``b`` takes ``base_ms * (1 + growth * (b - 1))`` on a whole T4.

These are illustrative shapes, not measurements (``gpuslice profile`` measures real ones).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpuslice.core import catalog
from gpuslice.core.errors import ValidationError
from gpuslice.core.profiles import ProfilePoint, ProfileSet


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    base_ms: float  # batch 1 on a whole T4
    growth: float  # extra time per extra item in a batch, as a fraction of base_ms
    memory_mib: int  # weights and activations of one replica


MODELS: dict[str, ModelShape] = {
    m.name: m for m in (
        ModelShape("resnet50", 20.0, 0.35, 2500),
        ModelShape("bert-base", 40.0, 0.45, 3500),
        ModelShape("mobilenet-v3", 8.0, 0.30, 1200),
        ModelShape("embedder", 15.0, 0.40, 2000),
    )
}

BATCHES = (1, 2, 4, 8)
MIG_SIZES = (1, 2, 3, 4, 7)


FAKE_TIMER_GPU = "H100-SXM"  # the GPU of a --fake-timer that names none


def parse_fake_timer(text: str, field: str = "--fake-timer") -> tuple[str, str]:
    """``MODEL@GPU`` of a ``--fake-timer`` (``MODEL`` alone: on :data:`FAKE_TIMER_GPU`): the
    model of :data:`MODELS` and the catalogue's name of a GPU with a known FP16 rate; anything
    else is a :class:`ValidationError` of ``field`` listing what would do."""
    model, _, gpu = text.strip().partition("@")
    if model not in MODELS:
        raise ValidationError(field, f"MODEL@GPU with MODEL one of {', '.join(sorted(MODELS))}",
                              text)
    found = catalog.lookup(gpu.strip() or FAKE_TIMER_GPU)
    if found is None or found.fp16_tflops is None:
        known = ", ".join(m.name for m in catalog.known_models() if m.fp16_tflops is not None)
        raise ValidationError(field, f"MODEL@GPU with GPU a catalogue model ({known})", text)
    return model, found.name


def gpu_speed(gpu: str) -> float:
    model = catalog.lookup(gpu)
    if model is None or model.fp16_tflops is None:
        raise ValidationError("gpu", "a catalogue GPU model with a known FP16 rate", gpu)
    return math.pow(model.fp16_tflops / 65.0, 0.6)


def service_time_s(model: str, gpu: str, fraction: float, batch: int = 1) -> float:
    """Seconds for one batch of ``batch`` of ``model`` on ``fraction`` (0..1] of a ``gpu``."""
    shape = MODELS.get(model)
    if shape is None:
        raise ValidationError("model", f"one of {', '.join(sorted(MODELS))}", model)
    if not 0 < fraction <= 1:
        raise ValidationError("fraction", "a share of the GPU in (0, 1]", fraction)
    if batch < 1:
        raise ValidationError("batch", "a batch size >= 1", batch)
    work = shape.base_ms * (1 + shape.growth * (batch - 1)) / 1000.0
    return work / (gpu_speed(gpu) * math.pow(fraction, 0.8))


def rescale(measured: ProfileSet, source: str, target: str) -> ProfileSet:
    """MIG profiles of ``target`` drawn from those measured on ``source`` by this model, for a
    fleet that names a GPU type nobody profiled (``profiles_from`` in a fleet file): a slice
    of ``s`` of the ``C`` compute slices runs at ``gpu_speed * (s / C) ** 0.8``, so each point
    of a size ``target`` has keeps its batch and processes, its latency divided and its
    throughput multiplied by the ratio of the two speeds. Illustrative, as the model is."""
    src, dst = catalog.lookup(source), catalog.lookup(target)
    if src is None or src.mig is None:
        raise ValidationError("profiles_from", "a MIG-capable GPU model of the catalogue",
                              source)
    if dst is None or dst.mig is None:
        raise ValidationError("gpu", "a MIG-capable GPU model of the catalogue", target)
    sizes = {p.compute_slices for p in dst.mig.profiles}
    points = []
    for p in measured.points:
        if p.gpu != src.name or p.slice_kind != "mig" or p.slice_size not in sizes:
            continue
        f = (gpu_speed(dst.name) * math.pow(p.slice_size / dst.mig.compute_slices, 0.8)) / (
            gpu_speed(src.name) * math.pow(p.slice_size / src.mig.compute_slices, 0.8))
        p99 = None if p.latency_p99_s is None else p.latency_p99_s / f
        points.append(ProfilePoint(p.model, dst.name, "mig", p.slice_size, p.batch, p.procs,
                                   p.throughput * f, p.latency_s / f, p99))
    return ProfileSet.of(points)


def profiles(gpus: list[str], models: list[str] | None = None) -> ProfileSet:
    """Planner profiles (one process per MIG slice, batches 1-8) for ``gpus`` and ``models``."""
    points = []
    for gpu in gpus:
        for name in models or sorted(MODELS):
            for size in MIG_SIZES:
                for b in BATCHES:
                    t = service_time_s(name, gpu, size / 7, b)
                    points.append(ProfilePoint(name, gpu, "mig", size, b, 1, b / t, t, t))
    return ProfileSet.of(points)
