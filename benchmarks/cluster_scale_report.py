"""The lines ``cluster_scale.py`` prints and writes besides its tables: the extender's py-spy
profile, its CPU split, kube-apiserver's time for the Binding writes, the idle cluster's cores,
the burst's window, kube-scheduler's profile."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from first_seen import SHARES
from go_profile import table_lines


def profile_rows(path: Path, top: int = 15) -> tuple[int, list[tuple[str, float, float]]]:
    """The functions the extender spent its CPU in (py-spy's collapsed stacks): (function
    (file), own %, total %), own time being the sample's innermost frame and total anywhere on
    the stack, in % of all samples; and the number of samples."""
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    samples = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        samples += count
        frames = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0].rsplit("/", 1)[-1]
                  + ")" if " (" in f else f for f in stack.split(";")]
        own[frames[-1]] = own.get(frames[-1], 0) + count
        for f in set(frames):
            total[f] = total.get(f, 0) + count
    rows = [(f, 100 * n / max(1, samples), 100 * total[f] / max(1, samples))
            for f, n in sorted(own.items(), key=lambda kv: -kv[1])[:top]]
    return samples, rows


PROFILE_TITLE = ("extender profile: {} samples holding the GIL (py-spy --gil, 200/s: the "
                 "extender in Python and the C it calls without releasing the GIL, idle waits "
                 "left out; a thread that holds the GIL while it waits for one of the busy "
                 "cores is sampled too)")


def sys_line(ours: dict[str, Any]) -> str:
    cpu = ours["cpu_ms"]["gpuslice extender"]
    return (f"the extender's {cpu:.1f} ms of CPU per pod: {cpu - ours['ext_sys_ms']:.1f} "
            f"user, {ours['ext_sys_ms']:.1f} system (the kernel: its sockets, TCP over "
            "loopback to and from kube-scheduler and the API server, the watch)")


def api_bind_line(ours: dict[str, Any], base: dict[str, Any]) -> str:
    line = ("kube-apiserver's own time for a Binding write, p50 / p99 ms "
            "(apiserver_request_duration_seconds): with the extender "
            f"{ours['api_bind_p50_ms']:.1f} / {ours['api_bind_p99_ms']:.1f}, scheduler alone "
            f"{base['api_bind_p50_ms']:.1f} / {base['api_bind_p99_ms']:.1f}")
    if "ext_write_p50_ms" in ours:
        line += ("; the extender's Binding writes as it saw them (its connections to the API "
                 "server, the TLS, its event loop around the call; "
                 f"gpuslice_extender_bind_write_seconds) {ours['ext_write_p50_ms']:.1f} / "
                 f"{ours['ext_write_p99_ms']:.1f}, of its binds' {ours['ext_bind_p50_ms']:.1f}"
                 f" / {ours['ext_bind_p99_ms']:.1f}")
    return line


def requests_line(ours: dict[str, Any], base: dict[str, Any]) -> str:
    def kinds(r: dict[str, Any]) -> str:
        n, size = r["pod_events"]
        return (", ".join(f"{k} {v:.2f}" for k, v in r["api_requests"].items()) +
                f"; {n:.1f} pod watch events sent ({size / 1024:.1f} KiB)")

    return ("kube-apiserver's work in the timed window per pod bound, its requests by kind "
            "(apiserver_request_total, the most frequent) and the pod watch events it sent "
            f"to its watchers: with the extender {kinds(ours)}; scheduler alone {kinds(base)}")


def idle_line(idle: float, ours: dict[str, Any], base: dict[str, Any]) -> str:
    return (f"With no pod to schedule the cluster keeps {idle:.2f} cores busy (kwok's node "
            "leases and status, the API server and etcd serving them, the controllers): "
            f"{1e3 * idle / ours['pods_per_s']:.1f} ms of the CPU per pod at the extender "
            f"run's rate, {1e3 * idle / base['pods_per_s']:.1f} at the scheduler alone's")


def window_line(ours: dict[str, Any], base: dict[str, Any]) -> str:
    return ("pods/s is each burst's rate from its first bind to its last, as a watch of the pods "
            "saw them; over the whole window (the scheduler's start to the 1 s poll that found "
            f"every pod bound, {ours['seconds']:.1f} and {base['seconds']:.1f} s): "
            f"{ours['window_pods_per_s']:.1f} and {base['window_pods_per_s']:.1f} pods/s, "
            f"ratio {ours['window_pods_per_s'] / base['window_pods_per_s']:.2f}")


def timeline_line(ours: dict[str, Any], base: dict[str, Any]) -> str:
    def spread(r: dict[str, Any]) -> str:
        return " / ".join(f"{t:.2f}" for t in r["bind_quantiles"]) or "-"

    return ("how each burst spread, seconds from its first bind until "
            f"{' / '.join(f'{q:.0%}' for q in SHARES)} / all of its pods were bound: with the "
            f"extender {spread(ours)}, scheduler alone {spread(base)}")


def packing_line(ours: dict[str, Any]) -> str:
    return (f"packing through the extender: {ours['gpus_used']} GPUs hold a share (the milli "
            f"asked fills at least {ours['gpus_needed']}), on {ours['nodes_used']} nodes")


def go_lines(ours: dict[str, Any], base: dict[str, Any], seconds: int,
             delay: float) -> list[str]:
    if ours["go_profile_off"]:  # no --go-profile
        return []
    out = []
    for who, key in (("kube-scheduler", "go_profile"), ("kube-apiserver", "api_profile")):
        errors = "; ".join(r[f"{key}_error"] for r in (ours, base) if r[f"{key}_error"])
        if out:
            out.append("")
        out += table_lines(ours[key], base[key], ours["cpu_ms"][who], base["cpu_ms"][who],
                           seconds, delay, errors, who)
    return out


def threads_line(ours: dict[str, Any]) -> str:
    return "by thread: " + ", ".join(f"{n} {ms:.2f}" for n, ms in ours["ext_threads"].items()
                                     if ms >= 0.005)


def profile_table(path: Path) -> Table:
    samples, rows = profile_rows(path)
    table = Table(title=PROFILE_TITLE.format(samples))
    for col in ("function (file)", "own %", "total %"):
        table.add_column(col)
    for f, own, tot in rows:
        table.add_row(f, f"{own:.1f}", f"{tot:.1f}")
    return table
