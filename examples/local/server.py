"""A small model server for gpuslice local mode: a PyTorch model with random weights behind
the Open Inference Protocol paths, on the port local mode gives it.

    python examples/local/server.py --model resnet50 --port 8001

Models: those of ``gpuslice profile`` (torchvision resnet50, mobilenet_v3, vit_b_16,
efficientnet_b0; a BERT-base sized transformer encoder; tiny, a NumPy stand-in for machines
without a GPU).

Endpoints: GET /v2/health/ready; POST /v2/models/<name>/infer runs one batch (size from the
X-Batch-Size header, else --batch) and answers its latency; GET /slice shows the slice this
replica was given (CUDA_VISIBLE_DEVICES and the MPS caps local mode set); GET /alloc?mib=N
allocates N MiB on the GPU and answers whether it fitted (the memory-cap check).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SLICE_VARS = ("CUDA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY",
              "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
              "CUDA_MPS_CLIENT_PRIORITY",
              "GPUSLICE_SERVICE", "GPUSLICE_REPLICA", "PORT")


class Model:
    """A gpuslice benchmark workload (``gpuslice.bench.workloads``) behind a lock, timed."""

    def __init__(self, name: str, batch: int, device: str) -> None:
        from gpuslice.bench.workloads import MissingPackage, make_workload
        from gpuslice.core.errors import GpusliceError

        self.name, self.batch, self.device = name, batch, device
        self.lock = threading.Lock()
        self.held: list[Any] = []
        try:
            self.workload = make_workload(name, device)
        except (MissingPackage, GpusliceError) as exc:
            sys.exit(f"model {name}: {exc}")

    def infer(self, batch: int) -> float:
        start = time.perf_counter()
        with self.lock:
            self.workload.run(batch)
        return time.perf_counter() - start

    def alloc(self, mib: int) -> dict[str, Any]:
        if self.name == "tiny":
            return {"allocated_mib": 0, "ok": False, "error": "no GPU in tiny mode"}
        import torch

        try:
            self.held.append(torch.empty(mib * 1024 * 1024, dtype=torch.uint8,
                                         device=self.device))
            if self.device.startswith("cuda"):
                torch.cuda.synchronize()
            return {"allocated_mib": mib, "ok": True}
        except torch.OutOfMemoryError as exc:
            return {"allocated_mib": 0, "ok": False, "error": f"OutOfMemoryError: {exc}"}


def handler(model: Model) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, code: int, doc: object) -> None:
            body = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path.startswith(("/v2/health/ready", "/v2/health/live", "/healthz")):
                self._send(200, {"ready": True})
            elif self.path == "/slice":
                self._send(200, {k: os.environ.get(k) for k in SLICE_VARS})
            elif self.path.startswith("/alloc?mib="):
                raw = self.path.split("=", 1)[1]
                if not raw.isdigit():
                    self._send(400, {"error": f"mib: expected a whole number of MiB, got {raw!r}"})
                    return
                try:
                    self._send(200, model.alloc(int(raw)))
                except Exception as exc:  # a failed check is an answer, never a dead replica
                    self._send(500, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            else:
                self._send(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(n)
            if not (self.path.startswith("/v2/models/") and self.path.endswith("/infer")):
                self._send(404, {"error": f"no route {self.path}"})
                return
            raw = self.headers.get("X-Batch-Size", "")
            batch = int(raw) if raw.isdigit() and int(raw) > 0 else model.batch
            took = model.infer(batch)
            self._send(200, {"model_name": model.name, "batch": batch,
                             "latency_ms": round(took * 1000, 3)})

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    args = ap.parse_args()
    device = args.device
    if device is None:
        device = "cpu"
        if args.model != "tiny":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
    model = Model(args.model, args.batch, device)
    model.infer(args.batch)  # warm-up before answering ready
    server = ThreadingHTTPServer(("127.0.0.1", args.port), handler(model))
    print(f"serving {args.model} on {device}, port {args.port}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()


if __name__ == "__main__":
    main()
