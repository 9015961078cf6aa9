"""A stand-in for NVIDIA MPS where the real one is absent (the demo, the tests, the real node
tier on stand-in GPUs): a control daemon that lives like the real one, and a client that
depends on it as a CUDA process does.

What it mirrors (shared/reference/protocols.md 3.1-3.3, docs/gpu-results.md):

* ``nvidia-cuda-mps-control -d`` leaves one long-lived daemon process per pipe directory
  (``CUDA_MPS_PIPE_DIRECTORY``) that listens on the unix socket ``control`` there and writes
  ``nvidia-cuda-mps-control.pid``; started again while one answers, it says so and exits.
* Commands arrive on the control tool's stdin and are answered on its stdout, exit status 0
  even on errors (``Unknown command``, ``Cannot find MPS control daemon process``).
* A client connects to its daemon and is held to the lower of its own
  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` / ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` and its
  server's limits (the server takes the daemon's defaults when it starts, and
  ``set_active_thread_percentage`` / ``set_device_pinned_mem_limit`` change them for new
  clients). The daemon learns the client's PID from the socket (``SO_PEERCRED``, in the
  daemon's PID namespace, as the real daemon needs hostPID to see its clients).
* When the daemon goes (killed with its container, say), every client loses its connection
  and exits with the error a real client gets on its next CUDA call
  (``cudaErrorMpsRpcFailure``): the measured behaviour that makes daemon lifetimes matter.
* ``quit`` stops taking clients at once and ends the daemon when its last client is gone.

The daemon's state is a JSON file in the pipe directory (``fake-state.json``: the default
thread percentage ``pct`` and memory limit ``mem``, the running ``servers`` with their
limits, the connected ``clients``), rewritten on every change, so that tests can read what
a client would get and may list servers themselves. The daemon also ends when its socket
path is removed or replaced (a test's "the daemon died") and, when ``FAKE_MPS_IDLE_EXIT_S``
is set, after that many seconds without a command or client (tests that leave one behind).
Tests may set ``FAKE_MPS_LOG`` (one line per call: the arguments and
``CUDA_VISIBLE_DEVICES``) and ``FAKE_MPS_HANG`` (a file whose presence makes ``-d`` hang
while it is there, touching ``<file>.reached`` first).

Standard library only: the control program is this module run by a Python interpreter, and
the client runs in any container that has the gpuslice package (``python -m
gpuslice.adapters.mps.standin client``).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import socketserver
import struct
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONTROL = "control"
STATE = "fake-state.json"
PID_FILE = "nvidia-cuda-mps-control.pid"
RPC_FAILURE = ("cudaErrorMpsRpcFailure (805): the MPS client failed to communicate with the "
               "MPS control daemon or server")
NOT_FOUND = "Cannot find MPS control daemon process"
OUT_OF_MEMORY = "cudaErrorMemoryAllocation (2): out of memory"


def pipe_dir() -> Path:
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))


def parse_mib(text: str | None) -> int | None:
    """MiB of an MPS memory value (``8192M``, ``2G``, ``0=4096M``); None for none."""
    if not text:
        return None
    value = text.split("=", 1)[-1].strip().upper().rstrip("B")
    try:
        if value.endswith("G"):
            return int(float(value[:-1]) * 1024)
        if value.endswith("M"):
            return int(float(value[:-1]))
        return int(value) // (1 << 20)
    except ValueError:
        return None


def _connect(path: Path, timeout_s: float | None = 5.0) -> socket.socket | None:
    """A connection to the daemon's socket; None when no daemon listens there. The connect
    itself blocks (a unix socket's connect waits while the listener's backlog is full, where
    a non-blocking one fails at once), the reads and writes time out."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
    except OSError:
        s.close()
        return None
    s.settimeout(timeout_s)
    return s


# -- the daemon -------------------------------------------------------------------------------


class Daemon:
    """The daemon's state and commands; one per pipe directory."""

    def __init__(self, pipe: Path) -> None:
        self.pipe = pipe
        self.lock = threading.Lock()
        self.quitting = False
        self.last_activity = time.monotonic()
        self.clients: dict[int, dict[str, Any]] = {}  # connection id -> client record
        self._next = 0
        self.server: socketserver.BaseServer | None = None
        self.inode = 0

    # the state file holds what tests may read and write
    def load(self) -> dict[str, Any]:
        try:
            return dict(json.loads((self.pipe / STATE).read_text()))
        except (OSError, ValueError):
            return {"pct": 100.0, "mem": None}

    def save(self, s: dict[str, Any]) -> None:
        tmp = self.pipe / f".{STATE}.tmp"
        tmp.write_text(json.dumps(s))
        os.replace(tmp, self.pipe / STATE)

    def command(self, text: str) -> str:
        """The reply to one command line (what the real tool prints)."""
        cmd = text.split()
        self.last_activity = time.monotonic()
        with self.lock:
            s = self.load()
            head = cmd[:1]
            reply = ""
            if head == ["get_default_active_thread_percentage"]:
                reply = str(float(s["pct"]))
            elif head == ["set_default_active_thread_percentage"] and len(cmd) == 2:
                s["pct"] = float(cmd[1])
                reply = str(s["pct"])
            elif head == ["get_default_device_pinned_mem_limit"]:
                reply = s.get("mem") or ""
            elif head == ["set_default_device_pinned_mem_limit"] and len(cmd) == 3:
                s["mem"] = cmd[2]
            elif head == ["get_server_list"]:
                reply = "\n".join(s.get("servers", []))
            elif head == ["get_client_list"] and len(cmd) == 2:
                reply = "\n".join(str(c["pid"]) for c in s.get("clients", [])
                                  if c.get("server") == cmd[1])
            elif head == ["set_active_thread_percentage"] and len(cmd) == 3:
                s["server_pct"] = {**s.get("server_pct", {}), cmd[1]: float(cmd[2])}
                reply = str(float(cmd[2]))
            elif head == ["set_device_pinned_mem_limit"] and len(cmd) == 4:
                s["server_mem"] = {**s.get("server_mem", {}), cmd[1]: cmd[3]}
            elif head == ["quit"]:
                self.quitting = True
            else:
                return f'Unknown command "{" ".join(cmd)}"'
            self.save(s)
        if self.quitting:
            self.stop_listening()
        return reply

    def join(self, pid: int, hello: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """A client connects: its server (started with the daemon's defaults when none runs)
        and the limits it is held to."""
        self.last_activity = time.monotonic()
        with self.lock:
            s = self.load()
            if not s.get("servers"):
                s["servers"] = [str(os.getpid())]
                s["server_start"] = {str(os.getpid()): {"pct": s["pct"], "mem": s.get("mem")}}
            sid = s["servers"][0]
            start = s.get("server_start", {}).get(sid, {"pct": s["pct"], "mem": s.get("mem")})
            server_pct = float(s.get("server_pct", {}).get(sid, start["pct"]))
            server_mem = parse_mib(s.get("server_mem", {}).get(sid, start.get("mem")))
            pct = min(server_pct, float(hello.get("pct") or 100.0))
            mems = [m for m in (server_mem, parse_mib(hello.get("mem"))) if m is not None]
            rec = {"pid": pid, "server": sid, "pct": pct,
                   "mem_mib": min(mems) if mems else None, "name": hello.get("name", ""),
                   # what the stand-in "CUDA process" says it uses: memory (at most its
                   # cap: a client asking more fails as cudaMalloc would) and SMs (at most
                   # its thread percentage)
                   "use_mib": int(hello.get("use_mib") or 0),
                   "sm_pct": min(pct, float(hello.get("sm_pct") or 0))}
            cap = rec["mem_mib"]
            if cap is not None and rec["use_mib"] > cap:
                return -1, rec
            self._next += 1
            conn = self._next
            self.clients[conn] = rec
            s["clients"] = list(self.clients.values())
            self.save(s)
        return conn, rec

    def leave(self, conn: int) -> None:
        self.last_activity = time.monotonic()
        with self.lock:
            self.clients.pop(conn, None)
            s = self.load()
            s["clients"] = list(self.clients.values())
            if not self.clients:  # the server ends with its last client
                for key in ("servers", "server_start", "server_pct", "server_mem",
                            "clients"):
                    s.pop(key, None)
            self.save(s)
        if self.quitting and not self.clients:
            self.end()

    def stop_listening(self) -> None:
        """``quit``: no new client or command from now on; ends once no client is left."""
        with contextlib.suppress(OSError):
            (self.pipe / CONTROL).unlink()
        if not self.clients:
            self.end()

    def end(self) -> None:
        for name in (PID_FILE, "control_lock", "control_privileged"):
            with contextlib.suppress(OSError):
                (self.pipe / name).unlink()
        if self.quitting:  # a quit leaves no state behind: the next daemon starts afresh
            with contextlib.suppress(OSError):
                (self.pipe / CONTROL).unlink()
        os._exit(0)

    def watchdog(self) -> None:
        """End when the socket path is gone or replaced (not by a quit: the daemon died),
        or after ``FAKE_MPS_IDLE_EXIT_S`` idle seconds without clients."""
        idle = float(os.environ.get("FAKE_MPS_IDLE_EXIT_S") or 0)
        while True:
            time.sleep(0.2)
            if not self.pipe.is_dir():
                os._exit(0)  # its pipe directory is gone (a test's tmp_path): nothing to serve
            if self.quitting:
                continue
            try:
                inode = os.stat(self.pipe / CONTROL).st_ino
            except OSError:
                inode = -1
            if inode != self.inode:
                os._exit(0)  # as if killed: clients see their connections drop
            if idle and not self.clients and time.monotonic() - self.last_activity > idle:
                with contextlib.suppress(OSError):
                    (self.pipe / CONTROL).unlink()
                os._exit(0)


def _peer_pid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, _uid, _gid = struct.unpack("3i", creds)
    return int(pid)


def _handler(daemon: Daemon) -> type[socketserver.StreamRequestHandler]:
    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            line = self.rfile.readline().decode(errors="replace").strip()
            kind, _, rest = line.partition(" ")
            if kind == "CMD":
                self.wfile.write((daemon.command(rest) + "\n").encode())
                return
            if kind != "CLIENT" or daemon.quitting:
                self.wfile.write(b"REFUSED\n")
                return
            try:
                hello = dict(json.loads(rest or "{}"))
            except ValueError:
                hello = {}
            conn, rec = daemon.join(_peer_pid(self.connection), hello)
            if conn < 0:  # more memory than its cap
                self.wfile.write(("OOM " + json.dumps(rec) + "\n").encode())
                return
            try:
                self.wfile.write(("OK " + json.dumps(rec) + "\n").encode())
                self.wfile.flush()
                while self.rfile.read(1):  # held until the client goes
                    pass
            except OSError:
                pass
            finally:
                daemon.leave(conn)

    return Handler


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    request_queue_size = 128  # many clients and commands at once (the default is 5)


def start_daemon(pipe: Path) -> int:
    """``-d``: fork the daemon, wait until it listens, exit 0 (as the real tool does)."""
    pipe.mkdir(parents=True, exist_ok=True)
    sock_path = pipe / CONTROL
    probe = _connect(sock_path, 1.0)
    if probe is not None:
        probe.close()
        print("An instance of this daemon is already running")
        return 1
    with contextlib.suppress(OSError):
        sock_path.unlink()
    r, w = os.pipe()
    if os.fork() > 0:
        os.close(w)
        with os.fdopen(r, "rb") as ready:
            said = ready.read()
        return 0 if said.startswith(b"ready") else 1
    os.close(r)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    _run_daemon(pipe, w)
    os._exit(0)


def _run_daemon(pipe: Path, ready_fd: int) -> None:
    log_dir = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY") or pipe)
    with contextlib.suppress(OSError):
        log_dir.mkdir(parents=True, exist_ok=True)
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        out = os.open(log_dir / "control.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        out = devnull
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    daemon = Daemon(pipe)
    daemon.save({"pct": 100.0, "mem": None})
    server = _Server(str(pipe / CONTROL), _handler(daemon))
    daemon.server = server
    # any user's process may be a client (a pod's container rarely runs as root)
    os.chmod(pipe / CONTROL, 0o666)
    daemon.inode = os.stat(pipe / CONTROL).st_ino
    (pipe / "control_lock").touch()
    (pipe / PID_FILE).write_text(f"{os.getpid()}\n")
    print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] stand-in MPS control daemon {os.getpid()} "
          f"started for {os.environ.get('CUDA_VISIBLE_DEVICES', '-')}", flush=True)
    os.write(ready_fd, b"ready")
    os.close(ready_fd)
    threading.Thread(target=daemon.watchdog, daemon=True).start()
    server.serve_forever(poll_interval=0.2)


def run_command(pipe: Path, text: str) -> str:
    """One command through the daemon's socket; the reply, or what the real tool prints
    without a daemon."""
    sock = _connect(pipe / CONTROL)
    if sock is None:
        return NOT_FOUND
    with sock:
        try:
            sock.sendall(f"CMD {text.strip()}\n".encode())
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except OSError:
            return NOT_FOUND
    reply = b"".join(chunks).decode(errors="replace").strip()
    return NOT_FOUND if reply == "REFUSED" else reply


# -- the client -------------------------------------------------------------------------------


class Client:
    """A connected stand-in MPS client: ``limits`` are what it is held to; :meth:`wait`
    returns when its daemon is gone."""

    def __init__(self, name: str = "", pipe: Path | None = None, use_mib: int = 0,
                 sm_pct: float = 0.0) -> None:
        where = pipe or pipe_dir()
        sock = _connect(where / CONTROL, None)
        if sock is None:
            raise ConnectionError(f"{RPC_FAILURE}: no MPS control daemon at {where}")
        hello = {"pct": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
                 "mem": os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"), "name": name,
                 "use_mib": use_mib, "sm_pct": sm_pct}
        sock.sendall(("CLIENT " + json.dumps(hello) + "\n").encode())
        self.sock = sock
        line = self._readline()
        if line.startswith("OOM "):
            sock.close()
            got = json.loads(line[4:])
            raise MemoryError(f"{OUT_OF_MEMORY}: {use_mib} MiB asked, {got['mem_mib']} MiB "
                              "is this client's pinned memory limit")
        if not line.startswith("OK "):
            sock.close()
            raise ConnectionError(f"{RPC_FAILURE}: the daemon at {where} refused the client")
        self.limits: dict[str, Any] = dict(json.loads(line[3:]))

    def _readline(self) -> str:
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = self.sock.recv(1)
            if not chunk:
                break
            buf += chunk
        return buf.decode(errors="replace").strip()

    def wait(self) -> None:
        """Block until the daemon goes (or :meth:`close`)."""
        with contextlib.suppress(OSError):
            while self.sock.recv(4096):
                pass

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def client_main(argv: Sequence[str]) -> int:
    """``client [--processes N] [--name NAME]``: N stand-in CUDA processes (this one and
    N-1 children), each connected to the daemon of ``CUDA_MPS_PIPE_DIRECTORY``; each prints
    the limits it is held to and waits; when the daemon goes, each fails as a real client
    does (exit 1)."""
    import argparse

    ap = argparse.ArgumentParser(prog="standin client")
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--name", default=os.environ.get("HOSTNAME", ""))
    ap.add_argument("--use-mib", type=int, default=0,
                    help="device memory each process says it uses (more than its cap fails)")
    ap.add_argument("--sm", type=float, default=0.0,
                    help="percent of the GPU's SMs each process says it keeps busy")
    args = ap.parse_args(list(argv))
    import signal

    # one process group: a stop signal to this process ends its children too (as a container's
    # processes end together)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    children = []
    for i in range(1, max(1, args.processes)):
        pid = os.fork()
        if pid == 0:
            return _one_client(f"{args.name}/{i}", args.use_mib, args.sm)
        children.append(pid)

    def stop(signum: int, _frame: object) -> None:
        for child in children:
            with contextlib.suppress(OSError):
                os.kill(child, signal.SIGTERM)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = _one_client(f"{args.name}/0", args.use_mib, args.sm)
    for pid in children:
        _, status = os.waitpid(pid, 0)
        code = code or (os.waitstatus_to_exitcode(status) if status else 0)
    return code


def _one_client(name: str, use_mib: int = 0, sm_pct: float = 0.0) -> int:
    try:
        c = Client(name, use_mib=use_mib, sm_pct=sm_pct)
    except (ConnectionError, MemoryError) as exc:
        print(str(exc), file=sys.stderr, flush=True)
        return 1
    print(json.dumps({"client": name, "pid": os.getpid(), **c.limits}), flush=True)
    c.wait()
    print(RPC_FAILURE, file=sys.stderr, flush=True)
    return 1


# -- the control program ----------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["client"]:
        return client_main(args[1:])
    pipe = pipe_dir()
    if os.environ.get("FAKE_MPS_LOG"):  # tests: which GPU each daemon was started for
        with open(os.environ["FAKE_MPS_LOG"], "a") as log:
            log.write(" ".join(args) + " " + os.environ.get("CUDA_VISIBLE_DEVICES", "-") + "\n")
    if args == ["-d"]:
        hang = os.environ.get("FAKE_MPS_HANG")
        if hang and os.path.exists(hang):  # tests: a start that never returns
            Path(hang + ".reached").touch()
            end = time.monotonic() + 3600
            while os.path.exists(hang) and time.monotonic() < end:  # until the test is done
                time.sleep(0.5)
            return 1
        return start_daemon(pipe)
    reply = run_command(pipe, sys.stdin.read())
    if reply:
        print(reply)
    return 0


if __name__ == "__main__":
    sys.exit(main())
