"""What a real node changes on its host, recorded before it starts and undone after it stops.

The kubelet and containerd change the machine they run on: the kubelet sets kernel tunables
(``setupKernelTunables`` in kubernetes ``pkg/kubelet/cm/container_manager_linux.go``: the six
sysctls of :data:`KUBELET_SYSCTLS`, since ``protectKernelDefaults`` is false), adds iptables
chains (``KUBE-FIREWALL``, ``KUBE-KUBELET-CANARY``, ``KUBE-IPTABLES-HINT``), makes cgroups
(``kubepods``) and mounts (``/var/lib/kubelet``, pods' volumes); containerd and the CNI bridge
plugin add mounts, network namespaces, a bridge and ``net.ipv4.ip_forward``. :func:`snapshot`
records all of these; :func:`restore` undoes what differs from a snapshot; :func:`diff` says
what still differs (the real-node tests assert it is nothing).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

KUBELET_SYSCTLS = ("vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic",
                   "kernel.panic_on_oops", "kernel.keys.root_maxkeys",
                   "kernel.keys.root_maxbytes")
# the CNI bridge plugin with isGateway turns forwarding on
# kube-proxy's (with the conntrack and localhost-NodePort settings realnode.py gives it, it
# should leave them alone)
KUBE_PROXY_SYSCTLS = ("net.ipv4.conf.all.route_localnet", "net.bridge.bridge-nf-call-iptables",
                      "net.netfilter.nf_conntrack_max",
                      "net.netfilter.nf_conntrack_tcp_timeout_established",
                      "net.netfilter.nf_conntrack_tcp_timeout_close_wait")
SYSCTLS = (*KUBELET_SYSCTLS, "net.ipv4.ip_forward", *KUBE_PROXY_SYSCTLS)
# files and folders the node's components make (kubelet, containerd as configured by
# realnode.py, CNI, CDI specs written by plugins)
PATHS = ("/var/lib/kubelet", "/var/log/pods", "/var/log/containers", "/var/lib/cni",
         "/run/netns", "/var/run/cdi", "/etc/cdi", "/var/lib/gpuslice-node",
         "/run/gpuslice-node", "/run/nvidia-container-devices", "/dev/shm/gpuslice-test",
         "/run/gpuslice", "/opt/containerd")  # /run/gpuslice: the manifests' hostPaths
LISTED = ("/var/run/cdi", "/etc/cdi", "/run/netns")  # folders whose entries are compared
CGROUP_ROOT = Path("/sys/fs/cgroup")
IPTABLES = ("iptables", "ip6tables")
BUILTIN_CHAINS = ("INPUT", "OUTPUT", "FORWARD", "PREROUTING", "POSTROUTING")


@dataclass
class Snapshot:
    sysctls: dict[str, str] = field(default_factory=dict)
    mounts: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    iptables: dict[str, list[str]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Snapshot:
        return cls(**{k: doc[k] for k in cls.__dataclass_fields__ if k in doc})


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def _read_sysctls() -> dict[str, str]:
    out = {}
    for name in SYSCTLS:
        with contextlib.suppress(OSError):
            out[name] = _sysctl_path(name).read_text().strip()
    return out


def _mounts() -> list[str]:
    points = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            parts = line.split()
            if len(parts) > 4:
                points.append(parts[4])
    return sorted(set(points))


def _cgroups(depth: int = 2) -> list[str]:
    """Cgroup folders down to ``depth`` levels under /sys/fs/cgroup (v1: controller/group;
    v2: group/child)."""
    found: list[str] = []

    def walk(d: Path, level: int) -> None:
        if level > depth:
            return
        with contextlib.suppress(OSError):
            for e in os.scandir(d):
                if e.is_dir(follow_symlinks=False):
                    found.append(e.path)
                    walk(Path(e.path), level + 1)

    walk(CGROUP_ROOT, 1)
    return sorted(found)


def _links() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/net"))
    except OSError:
        return []


def _paths() -> list[str]:
    out = [p for p in PATHS if os.path.lexists(p)]
    for d in LISTED:
        with contextlib.suppress(OSError):
            out += [os.path.join(d, n) for n in os.listdir(d)]
    return sorted(out)


def _iptables() -> dict[str, list[str]]:
    """``iptables-save`` per family without comments and counters: chain names and rules."""
    out: dict[str, list[str]] = {}
    for ipt in IPTABLES:
        if shutil.which(f"{ipt}-save") is None:
            continue
        try:
            text = subprocess.run([f"{ipt}-save"], capture_output=True, text=True,
                                  timeout=30, check=False).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        lines, table = [], ""
        for line in text.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":"):
                chain = line[1:].split()[0]
                if chain not in BUILTIN_CHAINS:  # listed once a table is first used
                    lines.append(f"{table} :{chain}")
            elif line.startswith("-A "):
                lines.append(f"{table} {line}")
        out[ipt] = sorted(lines)
    return out


def snapshot() -> Snapshot:
    return Snapshot(sysctls=_read_sysctls(), mounts=_mounts(), cgroups=_cgroups(),
                    links=_links(), paths=_paths(), iptables=_iptables())


def diff(before: Snapshot, after: Snapshot | None = None) -> list[str]:
    """What differs from ``before`` now (or in ``after``), one line each; empty when the host
    is as it was."""
    now = after or snapshot()
    out = [f"sysctl {k}: {before.sysctls.get(k)} -> {v}" for k, v in now.sysctls.items()
           if before.sysctls.get(k) != v]
    for what, b, a in (("mount", before.mounts, now.mounts), ("cgroup", before.cgroups,
                       now.cgroups), ("link", before.links, now.links),
                       ("path", before.paths, now.paths)):
        out += [f"{what} added: {x}" for x in sorted(set(a) - set(b))]
        out += [f"{what} removed: {x}" for x in sorted(set(b) - set(a))]
    for fam, rules in now.iptables.items():
        old = set(before.iptables.get(fam, []))
        out += [f"{fam} added: {r}" for r in rules if r not in old]
    return out


def _run(argv: list[str]) -> None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(argv, capture_output=True, timeout=30, check=False)


def _rm_cgroup_tree(path: str) -> None:
    """rmdir the folders of a cgroup tree deepest first (a cgroup's files cannot be deleted;
    an empty cgroup folder can)."""
    dirs = [path]
    for root, subdirs, _ in os.walk(path):
        dirs += [os.path.join(root, d) for d in subdirs]
    for d in sorted(dirs, key=len, reverse=True):
        with contextlib.suppress(OSError):
            os.rmdir(d)


def _undo_iptables(before: Snapshot, now: Snapshot) -> None:
    for fam, lines in now.iptables.items():
        old = set(before.iptables.get(fam, []))
        new = [x for x in lines if x not in old]
        for line in new:  # rules first (a chain in use cannot be deleted)
            table, _, rule = line.partition(" ")
            if rule.startswith("-A "):
                _run([fam, "-w", "-t", table, "-D", *shlex.split(rule)[1:]])
        for line in new:
            table, _, rule = line.partition(" ")
            if rule.startswith(":"):
                _run([fam, "-w", "-t", table, "-F", rule[1:]])
        for line in new:
            table, _, rule = line.partition(" ")
            if rule.startswith(":"):
                _run([fam, "-w", "-t", table, "-X", rule[1:]])


def restore(before: Snapshot, *, keep_paths: Iterable[str] = ()) -> list[str]:
    """Undo what differs from ``before`` (its processes must already be stopped): unmount new
    mounts (deepest first), delete new network namespaces, links, cgroups, iptables rules and
    chains, files and folders of :data:`PATHS`, and set the sysctls back. Returns
    :func:`diff` afterwards (empty when the host is clean)."""
    now = snapshot()
    old_mounts = set(before.mounts)
    for m in sorted(set(now.mounts) - old_mounts, key=len, reverse=True):
        _run(["umount", "-l", m])
    for p in sorted(set(now.paths) - set(before.paths)):
        if p.startswith("/run/netns/"):
            _run(["umount", p])
    for link in sorted(set(now.links) - set(before.links)):
        _run(["ip", "link", "delete", link])
    for cg in sorted(set(now.cgroups) - set(before.cgroups), key=len):
        if os.path.isdir(cg):
            _rm_cgroup_tree(cg)
    _undo_iptables(before, now)
    keep = set(keep_paths)
    for p in sorted(set(now.paths) - set(before.paths), key=len, reverse=True):
        if p in keep:
            continue
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(p)
    for name, value in before.sysctls.items():
        if _read_sysctls().get(name) != value:
            with contextlib.suppress(OSError):
                _sysctl_path(name).write_text(value + "\n")
    return diff(before)
