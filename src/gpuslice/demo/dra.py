"""``gpuslice demo --dra``: the DRA path end to end on this machine, with no cluster binary and
no GPU.

What is real: the DRA driver (:func:`gpuslice.services.dra_driver.run`, as the DaemonSet runs it:
feature detection, ResourceSlices, its registration and DRA gRPC services on unix sockets, the
checkpoint, CDI spec files, MPS control daemons, MIG instances), gpuslice's claim allocator
(:class:`~gpuslice.services.dra_allocator.DraAllocator`, which decides with
:mod:`gpuslice.core.dra_placement`) and the wire between the kubelet and the driver
(``pluginregistration/v1`` then ``dra/v1`` NodePrepareResources / NodeUnprepareResources).

What is simulated: the GPUs (:class:`~gpuslice.adapters.nvml.port.FakeNvml`: an H100 for shares,
an A100 in MIG mode, an L4 taken whole), the API server
(:class:`~gpuslice.adapters.kube.fake.FakeApiServer`, in memory), the resource claim controller
(claims made from the example templates of ``deploy/dra/examples``), the kubelet (its
registration and DRA calls, :class:`KubeletDra`), and kube-scheduler for the one claim shape
gpuslice's allocator leaves to it: a MIG profile chosen by a CEL selector, allocated here first
fit with the pool's shared counters (:func:`first_fit_counters`). ``nvidia-cuda-mps-control``
is the real one when it is on PATH, else the stand-in of :mod:`gpuslice.adapters.mps.fake`.

Everything lives in one temporary directory (short: unix socket paths are limited), removed at
the end with the sockets, the MPS daemons and the MIG instances; any step that does not do
what it should raises :class:`DraDemoFailed`, naming the step.
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from gpuslice import __version__
from gpuslice.adapters.kube import dra as kdra
from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.adapters.kube.objects import quantity
from gpuslice.adapters.kubelet import dra_v1_pb2 as v1
from gpuslice.adapters.kubelet import dra_v1_pb2_grpc as v1g
from gpuslice.adapters.kubelet import pluginregistration_v1_pb2 as rpb
from gpuslice.adapters.kubelet import pluginregistration_v1_pb2_grpc as rpbg
from gpuslice.adapters.mps import CONTROL
from gpuslice.adapters.mps.fake import write_fake_control
from gpuslice.adapters.nvml.port import FakeNvml
from gpuslice.core import dra
from gpuslice.core.errors import GpusliceError
from gpuslice.demo.dra_first_fit import DraDemoFailed, first_fit_counters
from gpuslice.services.dra_allocator import DraAllocator
from gpuslice.services.dra_driver import DraConfig, DraDriver
from gpuslice.services.dra_driver import run as run_driver

NODE = "dra-node"
# the image deploy/dra/examples runs its pod from (deploy/image.env; the demo's pods run no
# container, the name is for show)
IMAGE = f"registry.example.com/gpuslice:{__version__}"
NAMESPACE = "default"
# GPU 0 for shares, GPU 1 in MIG mode (instances made on prepare), GPU 2 handed over whole
GPUS = ({"model": "H100-SXM"}, {"model": "A100-80GB", "mig_enabled": True}, {"model": "L4"})
MODES = {"0": dra.SHARE, "1": dra.MIG}  # the others: whole

# deploy/dra's DeviceClasses and example ResourceClaimTemplates, read from there: a wheel has
# them beside this module (setup.py copies them in as gpuslice/demo/deploy/...), a checkout
# (an editable install) has deploy/ itself
DEPLOY_FILES = ("dra/deviceclasses.yaml", "dra/examples/claims.yaml")

# a second share of the same GPU with other limits: a claim written directly (no template)
SECOND_SHARE = {"devices": {"requests": [{"name": "gpu", "exactly": {
    "deviceClassName": "share.gpuslice.io",
    "capacity": {"requests": {"compute": "40", "memory": "8Gi"}}}}]}}

# pod -> the ResourceClaimTemplate it names, or the claim spec it uses directly
PODS: tuple[tuple[str, str | dict[str, Any]], ...] = (
    ("inference-quarter", "gpu-quarter"),
    ("embedder-share", SECOND_SHARE),
    ("trainer-mig", "mig-3g"),
    ("batch-whole", "whole-gpu"),
)


@dataclass
class Row:
    """One prepared claim, as the table shows it."""

    claim: str
    model: str
    device: str
    limits: str
    cdi_id: str
    env: dict[str, str]
    mounts: list[str]
    spec_path: Path


@dataclass
class DraDemoResult:
    rows: list[Row] = field(default_factory=list)
    mps: str = ""  # "real" or "stand-in"
    workdir: Path | None = None
    removed: list[str] = field(default_factory=list)  # CDI specs removed on unprepare


def deploy_file(rel: str) -> str:
    """deploy/``rel`` (one of :data:`DEPLOY_FILES`): the wheel's copy, else the checkout's."""
    from importlib.resources import files

    packaged = files("gpuslice.demo").joinpath("deploy", *rel.split("/"))
    if packaged.is_file():
        return packaged.read_text()
    checkout = Path(__file__).resolve().parents[3] / "deploy" / rel
    if checkout.is_file():
        return checkout.read_text()
    raise DraDemoFailed(f"deploy/{rel}: not in this install (a wheel built from a gpuslice "
                        "checkout or sdist has it) nor beside it in a checkout")


def manifests() -> dict[str, dict[str, Any]]:
    """deploy/dra's DeviceClasses and ResourceClaimTemplates by ``<kind>/<name>`` (the
    example pod beside the templates is the demo's own)."""
    return {f"{d['kind']}/{d['metadata']['name']}": d
            for rel in DEPLOY_FILES for d in yaml.safe_load_all(deploy_file(rel))
            if d and d.get("kind") in ("DeviceClass", "ResourceClaimTemplate")}


# -- the kubelet's side of DRA -------------------------------------------------------------------

KUBELET_VERSIONS = ("v1.DRAPlugin",)  # what this kubelet stand-in speaks
CALL_TIMEOUT_S = 45.0  # the kubelet's per-call timeout


class KubeletDra:
    """What the kubelet does with a DRA plugin: the plugin watcher's registration (GetInfo, a
    type and version check, NotifyRegistrationStatus), then the DRA service at the endpoint
    the plugin gave, in ``dra/v1``."""

    def __init__(self, registration_socket: Path) -> None:
        with grpc.insecure_channel(f"unix://{registration_socket}") as ch:
            reg = rpbg.RegistrationStub(ch)  # type: ignore[no-untyped-call]
            info = reg.GetInfo(rpb.InfoRequest(), timeout=CALL_TIMEOUT_S)
            versions = list(info.supported_versions)
            chosen = next((v for v in versions if v in KUBELET_VERSIONS), "")
            error = ""
            if info.type != "DRAPlugin":
                error = f"plugin type {info.type!r}, expected 'DRAPlugin'"
            elif not chosen:
                error = f"none of the plugin's versions {versions} is {KUBELET_VERSIONS[0]}"
            elif not Path(info.endpoint).is_absolute():
                error = f"endpoint {info.endpoint!r} is not an absolute path"
            reg.NotifyRegistrationStatus(rpb.RegistrationStatus(
                plugin_registered=not error, error=error), timeout=CALL_TIMEOUT_S)
            if error:
                raise DraDemoFailed(f"registration refused: {error}")
        self.driver, self.endpoint, self.version = info.name, info.endpoint, chosen
        self.channel = grpc.insecure_channel(f"unix://{info.endpoint}")
        self.stub = v1g.DRAPluginStub(self.channel)  # type: ignore[no-untyped-call]

    def prepare(self, claim: Mapping[str, Any]) -> Any:
        """NodePrepareResources for one claim: its NodePrepareResourceResponse."""
        m = claim["metadata"]
        resp = self.stub.NodePrepareResources(v1.NodePrepareResourcesRequest(claims=[v1.Claim(
            namespace=m["namespace"], uid=m["uid"], name=m["name"])]), timeout=CALL_TIMEOUT_S)
        if m["uid"] not in resp.claims:
            raise DraDemoFailed(f"NodePrepareResources left out claim {m['name']}")
        return resp.claims[m["uid"]]

    def unprepare(self, claim: Mapping[str, Any]) -> str:
        """NodeUnprepareResources for one claim: its error ("" when done)."""
        m = claim["metadata"]
        resp = self.stub.NodeUnprepareResources(v1.NodeUnprepareResourcesRequest(
            claims=[v1.Claim(namespace=m["namespace"], uid=m["uid"], name=m["name"])]),
            timeout=CALL_TIMEOUT_S)
        if m["uid"] not in resp.claims:
            raise DraDemoFailed(f"NodeUnprepareResources left out claim {m['name']}")
        return str(resp.claims[m["uid"]].error)

    def close(self) -> None:
        self.channel.close()


# -- kube-scheduler's part, for the claim shape gpuslice's allocator leaves to it ---------------

# -- the run --------------------------------------------------------------------------------------

def _pod(name: str, uid: str, created: str, claim_ref: dict[str, str],
         claim_status: list[dict[str, str]]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid,
                         "creationTimestamp": created},
            "spec": {"resourceClaims": [{"name": "gpu", **claim_ref}], "containers": [{
                "name": "server", "image": IMAGE,
                "resources": {"requests": {"cpu": "500m", "memory": "1Gi"},
                              "claims": [{"name": "gpu"}]}}]},
            "status": {"phase": "Pending", "resourceClaimStatuses": claim_status}}


def _claims_of_pods(api: FakeApiServer) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Create the demo's pods and their claims, as the resource claim controller makes a
    claim from a pod's template (``<pod>-<ref>-<suffix>``, owned by the pod, named in the
    pod's ``status.resourceClaimStatuses``); (pod, claim) pairs."""
    docs = manifests()
    out = []
    for i, (pod_name, source) in enumerate(PODS):
        pod_uid = str(uuid.uuid4())
        created = f"2026-01-01T00:00:{i:02d}Z"
        if isinstance(source, str):
            claim_name = f"{pod_name}-gpu-{uuid.uuid4().hex[:5]}"
            spec = copy.deepcopy(docs[f"ResourceClaimTemplate/{source}"]["spec"]["spec"])
            ref = {"resourceClaimTemplateName": source}
            status = [{"name": "gpu", "resourceClaimName": claim_name}]
            owner = [{"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": pod_uid,
                      "controller": True, "blockOwnerDeletion": True}]
        else:
            claim_name = f"{pod_name}-gpu"
            spec, ref, status, owner = copy.deepcopy(source), \
                {"resourceClaimName": claim_name}, [], []
        claim = api.add_resourceclaim({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": claim_name, "namespace": NAMESPACE, "uid": str(uuid.uuid4()),
                         "ownerReferences": owner,
                         "annotations": {"resource.kubernetes.io/pod-claim-name": "gpu"}},
            "spec": spec})
        pod = api.add_pod(_pod(pod_name, pod_uid, created, ref, status))
        out.append((pod, claim))
    return out


def _gib(value: object) -> str:
    return f"{quantity(value, 'memory') / 2 ** 30:g} GiB"


def _limits(result: Mapping[str, Any], ref: dra.DeviceRef, config: list[Any]) -> str:
    if ref.type == dra.TYPE_SHARE:
        consumed = result.get("consumedCapacity") or {}
        return f"{consumed.get('compute', '?')}% SMs, {_gib(consumed.get('memory', 0))}"
    if ref.type == dra.TYPE_MIG:
        return f"MIG {ref.profile} ({ref.memory_mib} MiB) at placement {ref.start}"
    sharing = next((c["opaque"]["parameters"].get("sharing") for c in config
                    if (c.get("opaque") or {}).get("driver") == dra.DRIVER), None) or {}
    how = sharing.get("strategy", "Exclusive")
    if how == "TimeSlicing":
        how += f" ({(sharing.get('timeSlicing') or {}).get('interval', 'Default')})"
    return f"whole GPU, {ref.memory_mib // 1024} GiB, {how}"


@contextlib.contextmanager
def _step(what: str) -> Iterator[None]:
    """Run one step; any error becomes a DraDemoFailed naming it."""
    try:
        yield
    except DraDemoFailed as exc:
        raise DraDemoFailed(f"{what}: {exc}") from None
    except Exception as exc:  # any failure of the step: named, not a traceback
        detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
        raise DraDemoFailed(f"{what}: {type(exc).__name__}: {detail}") from exc


def run_dra_demo(say: Callable[[str], None], mps_binary: str | None = None) -> DraDemoResult:
    """Run the DRA demo (see the module doc); ``say`` gets one line per step done.
    ``mps_binary``: the MPS control program (default: the real one on PATH, else the
    stand-in; ``""``: the stand-in). Raises :class:`DraDemoFailed`; leaves nothing behind."""
    return _DemoRun(say).run(mps_binary)


class _DemoRun:
    """One run of the demo: each step a method, run in order by :meth:`run`, which cleans up
    whatever the steps made however they end."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.result = DraDemoResult()
        self.stop = threading.Event()
        self.crashed: list[BaseException] = []
        self.thread: threading.Thread | None = None
        self.kubelet: KubeletDra | None = None
        self.driver: DraDriver | None = None

    def run(self, mps_binary: str | None) -> DraDemoResult:
        failed: BaseException | None = None
        # no Ctrl-C / SIGTERM between making the directory and the try that removes it
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        self.root = root = Path(tempfile.mkdtemp(prefix="gpuslice-dra-", dir="/tmp"))
        self.result.workdir = root
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
            with _step("fake GPUs"):
                self._fake_gpus()
            with _step("API server"):
                self._api_server()
            with _step("MPS"):
                mps = self._mps(mps_binary)
            with _step("DRA driver start"):
                self._start_driver(mps)
            with _step("kubelet registration"):
                self.kubelet = KubeletDra(self.cfg.registration_socket)
                self.say(f"kubelet registered the plugin {self.kubelet.driver} "
                         f"({self.kubelet.version}) at {self.kubelet.endpoint}")
            with _step("claims"):
                pairs = _claims_of_pods(self.api)
                self.say(f"{len(pairs)} pods and their ResourceClaims: " + ", ".join(
                    c["metadata"]["name"] for _, c in pairs))
            with _step("allocation by gpuslice's allocator"):
                claims = self._allocate(pairs)
            for claim in claims:
                with _step(f"NodePrepareResources {NAMESPACE}/{claim['metadata']['name']}"):
                    self._prepare(claim)
            with _step("the shares' limits"):
                self._check_limits()
            for claim, row in zip(claims, self.result.rows, strict=True):
                with _step(f"NodeUnprepareResources {row.claim}"):
                    self._unprepare(claim, row)
            with _step("after unprepare"):
                self._check_clean()
            return self.result
        except BaseException as exc:
            failed = exc
            raise
        finally:
            # a Ctrl-C or SIGTERM now would leave things behind: hold them until clean
            held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            try:
                self._clean(failed)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)

    # -- the steps ---------------------------------------------------------------------------

    def _fake_gpus(self) -> None:
        inv = self.root / "gpus.yaml"
        inv.write_text(yaml.safe_dump({"driver": "580.95.05", "gpus": list(GPUS)}))
        self.nvml = FakeNvml.from_yaml(inv, NODE)
        self.gpus = self.nvml.devices()
        self.say(f"fake NVML: {len(self.gpus)} GPUs on node {NODE}: " + ", ".join(
            f"{g.index} {g.model} ({dict(MODES).get(str(g.index), dra.WHOLE)})"
            for g in self.gpus))

    def _api_server(self) -> None:
        self.api = api = FakeApiServer()
        api.add_node({"apiVersion": "v1", "kind": "Node",
                      "metadata": {"name": NODE, "uid": str(uuid.uuid4())},
                      "status": {"allocatable": {"cpu": "16", "memory": "64Gi"}}})
        for key, doc in manifests().items():
            if key.startswith("DeviceClass/"):
                api.add_deviceclass(doc)
        self.say("in-memory API server (resource.k8s.io/v1) with the DeviceClasses of "
                 "deploy/dra")

    def _mps(self, mps_binary: str | None) -> str:
        """The MPS control program: the real one (on PATH, or ``mps_binary``), else the
        stand-in, written into the work directory."""
        found = shutil.which(CONTROL) if mps_binary is None else mps_binary
        if found:
            self.result.mps = "real"
        else:
            found = str(write_fake_control(self.root / "mps-control"))
            self.result.mps = "stand-in"
        why = f"{CONTROL} is not on PATH" if mps_binary is None else "this machine's unused"
        self.say(f"MPS control: {found} ({self.result.mps}"
                 f"{'' if self.result.mps == 'real' else ': ' + why})")
        return found

    def _start_driver(self, mps: str) -> None:
        """The driver on a thread as the DaemonSet runs it; up once both sockets exist, and
        it must serve shares, MIG placements and a whole GPU."""
        root = self.root
        self.cfg = cfg = DraConfig(NODE, kubelet_dir=root / "kubelet", cdi_dir=root / "cdi",
                                   mps_pipe_dir=str(root / "mps"), mps_binary=mps,
                                   modes=dict(MODES), allocator_lease=None, dev_dir="/dev")
        self.driver = driver = DraDriver(cfg, self.nvml, self.api)

        def serve() -> None:
            try:
                run_driver(driver, self.stop, poll_s=0.2)
            except BaseException as exc:
                self.crashed.append(exc)

        self.thread = thread = threading.Thread(target=serve, name="dra-driver", daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while not (cfg.registration_socket.exists() and cfg.dra_socket.exists()):
            if self.crashed or not thread.is_alive():
                raise DraDemoFailed(f"the driver stopped: {self.crashed[:1] or 'no reason'}")
            if time.monotonic() > deadline:
                raise DraDemoFailed(f"no sockets in {cfg.kubelet_dir} after 20 s")
            time.sleep(0.05)
        feats = driver.features or dra.Features()
        slices = self.api.list_resource_slices(dra.DRIVER, NODE)
        kinds: dict[str, int] = {}
        for s in slices:
            for d in s["spec"].get("devices") or []:
                t = ((d.get("attributes") or {}).get("type") or {}).get("string", "?")
                kinds[t] = kinds.get(t, 0) + 1
        if not (feats.consumable_capacity and feats.partitionable):
            raise DraDemoFailed(f"features detected {feats}: consumable capacity and "
                                "partitionable devices should be served")
        if not all(kinds.get(t) for t in (dra.TYPE_SHARE, dra.TYPE_MIG, dra.TYPE_GPU)):
            raise DraDemoFailed(f"published devices {kinds}: a share, MIG placements and "
                                "a whole GPU were expected")
        self.say(f"DRA driver serving on {cfg.dra_socket}; {len(slices)} ResourceSlices, "
                 "devices: " + ", ".join(f"{n} {t}" for t, n in sorted(kinds.items())))

    def _allocate(self, pairs: list[tuple[dict[str, Any], dict[str, Any]]]) \
            -> list[dict[str, Any]]:
        """gpuslice's allocator places what it places; kube-scheduler's stand-in the rest
        (first fit with counters), then reserves each claim for its pod when the allocator
        has not (its PreBind) and binds the pod. The claims as allocated."""
        api = self.api
        report = DraAllocator(api, require_taint=False, settle_s=0.0).run_once()
        if report.unplaced:
            raise DraDemoFailed(f"not placed: {report.unplaced}")
        for name, where in sorted(report.allocated.items()):
            self.say(f"allocated {name} -> {where} (gpuslice allocator, policy frag-strand)")
        for _, claim in pairs:
            if f"{NAMESPACE}/{claim['metadata']['name']}" not in report.allocated:
                self._first_fit(claim)
        for pod, claim in pairs:
            cur = api.get_resource_claim(NAMESPACE, claim["metadata"]["name"])
            if not (cur.get("status") or {}).get("allocation"):
                raise DraDemoFailed(f"claim {cur['metadata']['name']} is not allocated")
            me = kdra.reservation(pod)
            if me is None:
                raise DraDemoFailed(f"pod {pod['metadata'].get('name')} has no name or UID")
            reserved = list(cur["status"].get("reservedFor") or [])
            if me["uid"] not in {r.get("uid") for r in reserved}:
                cur["status"]["reservedFor"] = [*reserved, me]
                api.update_resource_claim_status(cur)
            api.bind(NAMESPACE, pod["metadata"]["name"], pod["metadata"]["uid"], NODE)
        return [api.get_resource_claim(NAMESPACE, c["metadata"]["name"]) for _, c in pairs]

    def _first_fit(self, claim: Mapping[str, Any]) -> None:
        """kube-scheduler's allocation of a claim the allocator leaves to it: finalizer, then
        the allocation (first fit with the pool's counters)."""
        api = self.api
        cur = api.get_resource_claim(NAMESPACE, claim["metadata"]["name"])
        placement = first_fit_counters(cur, api.list_resource_slices(),
                                       api.list_resource_claims(), NODE)
        cur["metadata"].setdefault("finalizers", []).append(kdra.FINALIZER)
        cur = api.update_resource_claim(cur)
        cur.setdefault("status", {})["allocation"] = kdra.allocation(
            cur, placement, api.list_device_classes(), lambda: str(uuid.uuid4()),
            allocated_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        api.update_resource_claim_status(cur)
        self.say(f"allocated {NAMESPACE}/{cur['metadata']['name']} -> {NODE}: "
                 f"{placement.results[0].device} (first fit with counters: what "
                 "kube-scheduler does for a CEL-selected MIG profile)")

    def _prepare(self, claim: dict[str, Any]) -> None:
        """NodePrepareResources over gRPC; the CDI spec it names must exist and set the
        device's visibility."""
        assert self.kubelet is not None and self.driver is not None
        name = claim["metadata"]["name"]
        got = self.kubelet.prepare(claim)
        if got.error:
            raise DraDemoFailed(got.error)
        (dev,) = got.devices
        (cdi_id,) = dev.cdi_device_ids
        path = self.driver.cdi.path(claim["metadata"]["uid"])
        spec = json.loads(path.read_text())  # what the runtime applies: it must exist
        found_dev = [d for d in spec["devices"] if f"{spec['kind']}={d['name']}" == cdi_id]
        if not found_dev:
            raise DraDemoFailed(f"CDI device {cdi_id} is not in {path}")
        edits = found_dev[0]["containerEdits"]
        env = dict(e.split("=", 1) for e in edits.get("env") or [])
        if not env.get("CUDA_VISIBLE_DEVICES"):
            raise DraDemoFailed(f"{cdi_id}: no CUDA_VISIBLE_DEVICES in its CDI edits")
        alloc = claim["status"]["allocation"]["devices"]
        res = alloc["results"][0]
        ref = self.driver.plan.devices[res["device"]]
        self.result.rows.append(Row(
            f"{NAMESPACE}/{name}", ref.type if ref.type != dra.TYPE_GPU else dra.WHOLE,
            res["device"], _limits(res, ref, alloc.get("config") or []), cdi_id, env,
            [f"{m['hostPath']}:{m['containerPath']}" for m in edits.get("mounts") or []],
            path))
        self.say(f"prepared {NAMESPACE}/{name} over gRPC: CDI spec {path.name} written")

    def _check_limits(self) -> None:
        """Two shares of one GPU, each with its own MPS limits; a MIG instance made."""
        shares = [r for r in self.result.rows if r.model == dra.TYPE_SHARE]
        gpus_of = {r.env["CUDA_VISIBLE_DEVICES"] for r in shares}
        limits = {(r.env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
                   r.env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")) for r in shares}
        if len(shares) != 2 or len(gpus_of) != 1 or len(limits) != 2:
            raise DraDemoFailed(f"expected two shares of one GPU with their own limits, "
                                f"got GPUs {sorted(gpus_of)} and limits {sorted(limits)}")
        mig = next(r for r in self.result.rows if r.model == dra.TYPE_MIG)
        layout = self.nvml.mig_layout(self.gpus[1].uuid)
        if not layout:
            raise DraDemoFailed(f"no MIG instance on GPU 1 after preparing {mig.claim}")
        self.say(f"two shares of {gpus_of.pop()} with their own MPS limits; MIG instance "
                 f"{layout[0][0]}@{layout[0][1]} created for {mig.claim}")

    def _unprepare(self, claim: dict[str, Any], row: Row) -> None:
        assert self.kubelet is not None
        err = self.kubelet.unprepare(claim)
        if err:
            raise DraDemoFailed(err)
        if row.spec_path.exists():
            raise DraDemoFailed(f"{row.spec_path} is still there")
        self.result.removed.append(str(row.spec_path))
        self.say(f"unprepared {row.claim}: CDI spec {row.spec_path.name} removed")

    def _check_clean(self) -> None:
        """No MIG instance and no claim in the checkpoint left after unprepare."""
        assert self.driver is not None
        if left := self.nvml.mig_layout(self.gpus[1].uuid):
            raise DraDemoFailed(f"MIG instances left on GPU 1: {left}")
        if self.driver.checkpoint.claims:
            raise DraDemoFailed(f"claims left in the checkpoint: "
                                f"{sorted(self.driver.checkpoint.claims)}")

    def _clean(self, failed: BaseException | None) -> None:
        """Stop the driver and its MPS daemons, remove the work directory; raise when
        something is left (unless the run failed already: then say it)."""
        say, root, thread, driver = self.say, self.root, self.thread, self.driver
        if self.kubelet is not None:
            self.kubelet.close()
        self.stop.set()
        if thread is not None:
            thread.join(15)
        problems = []
        if thread is not None and thread.is_alive():
            problems.append("the driver did not stop")
        if driver is not None:
            try:
                stopped = driver.stop_mps()
                if stopped:
                    say(f"stopped {len(stopped)} MPS control daemon(s)")
            except GpusliceError as exc:
                problems.append(f"MPS daemons: {exc}")
            problems += [f"{p} left" for p in (driver.cfg.registration_socket,
                                               driver.cfg.dra_socket) if p.exists()]
        shutil.rmtree(root, ignore_errors=True)
        if root.exists():
            problems.append(f"{root} not removed")
        say(f"removed {root}" if not root.exists() else f"could not remove {root}")
        if problems and failed is None:
            raise DraDemoFailed("clean-up: " + "; ".join(problems))
        if problems:
            say("clean-up: " + "; ".join(problems))
