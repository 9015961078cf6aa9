"""What a benchmark worker runs: one batch at a time of a model, timed.

Built in: torchvision ``resnet50``, ``mobilenet_v3``, ``vit_b_16``, ``efficientnet_b0`` (and
any other torchvision classification model by its name), timm models as ``timm:NAME``, a
BERT-base sized transformer ``encoder`` (PyTorch, random weights, fp16 on CUDA), and ``tiny``
(a NumPy matrix product, no GPU). Any other program can be profiled through one of two tiny
protocols:

- ``cmd:PROGRAM ARGS``: the worker writes ``RUN <batch>`` lines on the program's stdin; the
  program answers each with one line ``OK`` when the batch is done (``ERR <message>`` on a
  failure). It is started once and kept for every batch.
- ``http://HOST:PORT/PATH``: one POST per batch with the ``X-Batch-Size`` header; any 2xx
  answer is a completed batch.

A missing package is reported by name (:class:`MissingPackage`), never as a traceback.
"""

from __future__ import annotations

import shlex
import subprocess
import urllib.request
from typing import Any, Protocol

from gpuslice.core.errors import GpusliceError, Unavailable, ValidationError

TORCHVISION = {"resnet50": "resnet50", "mobilenet_v3": "mobilenet_v3_large",
               "vit_b_16": "vit_b_16", "efficientnet_b0": "efficientnet_b0"}
BUILTIN = (*TORCHVISION, "encoder", "tiny")


class MissingPackage(Unavailable):
    """A package the benchmark needs is not installed; the message says which and how."""


class Workload(Protocol):
    name: str

    def run(self, batch: int) -> None:
        """Run one batch to completion (on a GPU: synchronised)."""
        ...

    def close(self) -> None: ...


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise MissingPackage("PyTorch is not installed: pip install torch (with CUDA for a "
                             "GPU), or profile --workload tiny / cmd:... / http://...") from None
    return torch


class TorchWorkload:
    def __init__(self, name: str, device: str | None = None) -> None:
        torch = _torch()
        self.torch = torch
        self.name = name
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.cuda = self.device.startswith("cuda")
        dtype = torch.float16 if self.cuda else torch.float32
        self.shape: tuple[int, ...] = (3, 224, 224)
        if name == "encoder":
            layer = torch.nn.TransformerEncoderLayer(768, 12, 3072, batch_first=True)
            net = torch.nn.TransformerEncoder(layer, 12)
            self.shape = (128, 768)
        elif name.startswith("timm:"):
            try:
                import timm
            except ImportError:
                raise MissingPackage(f"workload {name} needs timm: pip install timm") from None
            try:
                net = timm.create_model(name[5:], pretrained=False)
            except RuntimeError as exc:  # timm: "Unknown model (...)"
                raise GpusliceError(f"workload {name}: {exc}") from None
            cfg = getattr(net, "pretrained_cfg", None) or getattr(net, "default_cfg", {})
            self.shape = tuple(cfg.get("input_size", self.shape))
        else:
            try:
                import torchvision.models as tvm
            except ImportError:
                raise MissingPackage(f"workload {name} needs torchvision: pip install "
                                     "torchvision") from None
            arch = TORCHVISION.get(name, name)
            if arch not in tvm.list_models(module=tvm):
                raise GpusliceError(f"workload: expected one of {', '.join(BUILTIN)}, another "
                                    "torchvision classification model, timm:NAME, cmd:... or "
                                    f"http://..., got {name!r}")
            net = tvm.get_model(arch, weights=None)
        self.net = net.eval().to(device=self.device, dtype=dtype)
        self.dtype = dtype
        self._inputs: dict[int, Any] = {}

    def run(self, batch: int) -> None:
        torch = self.torch
        x = self._inputs.get(batch)
        if x is None:
            x = torch.randn((batch, *self.shape), device=self.device, dtype=self.dtype)
            self._inputs[batch] = x
        with torch.inference_mode():
            self.net(x)
        if self.cuda:
            torch.cuda.synchronize()

    def close(self) -> None:
        self._inputs.clear()


class TinyWorkload:
    """A NumPy stand-in for a model: runs anywhere, used by the CPU tests."""

    name = "tiny"

    def __init__(self) -> None:
        import numpy as np

        self.np = np
        self.w = np.random.default_rng(0).standard_normal((128, 128)).astype("float32")

    def run(self, batch: int) -> None:
        x = self.np.ones((batch, 128), dtype="float32")
        for _ in range(4):
            x = self.np.tanh(x @ self.w)

    def close(self) -> None:
        pass


class CommandWorkload:
    """``cmd:PROGRAM ARGS``: ``RUN <batch>`` on its stdin, ``OK`` back per batch."""

    def __init__(self, command: str) -> None:
        self.name = command
        argv = shlex.split(command)
        if not argv:
            raise GpusliceError("workload cmd: expected a program after 'cmd:'")
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True, bufsize=1)
        except OSError as exc:
            raise GpusliceError(f"workload cmd: cannot run {argv[0]!r}: {exc}") from None

    def run(self, batch: int) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(f"RUN {batch}\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise GpusliceError(f"workload {self.name!r} exited "
                                f"(status {self.proc.poll()})") from None
        line = self.proc.stdout.readline().strip()
        if line == "OK":
            return
        if line.startswith("ERR"):
            raise GpusliceError(f"workload {self.name!r} failed batch {batch}: {line[3:].strip()}")
        raise GpusliceError(f"workload {self.name!r}: expected OK or ERR, got {line!r} "
                            f"(exit status {self.proc.poll()})")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(5)


class HttpWorkload:
    """``http://...``: one POST per batch with ``X-Batch-Size``."""

    def __init__(self, url: str) -> None:
        self.name = url
        self.url = url

    def run(self, batch: int) -> None:
        req = urllib.request.Request(self.url, data=b"{}", method="POST",
                                     headers={"X-Batch-Size": str(batch),
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                r.read()
        except OSError as exc:
            raise GpusliceError(f"workload {self.url}: {exc}") from None

    def close(self) -> None:
        pass


def check_workload(spec: str) -> None:
    """What can be checked about a workload before any GPU is looked for: its form, the
    program of ``cmd:``, the URL, and (with torchvision installed) the model's name."""
    import shutil
    from urllib.parse import urlparse

    expected = (f"one of {', '.join(BUILTIN)}, another torchvision classification model, "
                "timm:NAME, cmd:PROGRAM or http://HOST:PORT/PATH")
    if spec in BUILTIN:
        return
    if spec.startswith("cmd:"):
        argv = spec[4:].split()
        if not argv:
            raise ValidationError("workload", "a program after 'cmd:'", spec)
        if shutil.which(argv[0]) is None:
            raise ValidationError("workload", "cmd: with a program that exists", argv[0])
        return
    if spec.startswith(("http://", "https://")):
        url = urlparse(spec)
        if not url.hostname:
            raise ValidationError("workload", "an http:// URL with a host", spec)
        return
    if spec.startswith("timm:"):
        if not spec[5:]:
            raise ValidationError("workload", "a timm model name after 'timm:'", spec)
        return
    if not spec or not spec.replace("_", "").isalnum():
        raise ValidationError("workload", expected, spec)
    try:
        import torchvision.models as tvm
    except ImportError:
        return  # said when the workload is built, with the pip command
    if TORCHVISION.get(spec, spec) not in tvm.list_models(module=tvm):
        raise ValidationError("workload", expected, spec)


def make_workload(spec: str, device: str | None = None) -> Workload:
    if spec == "tiny":
        return TinyWorkload()
    if spec.startswith("cmd:"):
        return CommandWorkload(spec[4:])
    if spec.startswith(("http://", "https://")):
        return HttpWorkload(spec)
    return TorchWorkload(spec, device)
