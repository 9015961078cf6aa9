"""A stand-in for ``nvidia-cuda-mps-control`` where the real one is absent (the demo on a
machine without the NVIDIA driver, and the tests): it behaves as the real one was measured to
(shared/reference/protocols.md 3.1: exit status 0 even on errors). ``-d`` starts a "daemon" (a
control file in ``CUDA_MPS_PIPE_DIRECTORY``; no process stays behind), commands arrive on stdin,
``quit`` removes it. Tests may set ``FAKE_MPS_LOG`` (a file that gets one line per call: the
arguments and ``CUDA_VISIBLE_DEVICES``) and ``FAKE_MPS_HANG`` (a file whose presence makes
``-d`` hang, touching ``<file>.reached`` first)."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

SCRIPT = r'''#!PYTHON
import json, os, sys
pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
state = os.path.join(pipe, "fake-state.json")
if os.environ.get("FAKE_MPS_LOG"):  # tests: which GPU each daemon was started for
    with open(os.environ["FAKE_MPS_LOG"], "a") as log:
        log.write(" ".join(sys.argv[1:]) + " " + os.environ.get("CUDA_VISIBLE_DEVICES", "-") + "\n")
if sys.argv[1:] == ["-d"] and os.environ.get("FAKE_MPS_HANG") \
        and os.path.exists(os.environ["FAKE_MPS_HANG"]):  # tests: a start that never returns
    import time
    open(os.environ["FAKE_MPS_HANG"] + ".reached", "w").close()
    time.sleep(3600)
if sys.argv[1:] == ["-d"]:
    os.makedirs(pipe, exist_ok=True)
    json.dump({"pct": 100.0, "mem": None}, open(state, "w"))
    open(os.path.join(pipe, "control"), "w").close()
    sys.exit(0)
cmd = sys.stdin.read().split()
if not os.path.exists(os.path.join(pipe, "control")):
    print("Cannot find MPS control daemon process"); sys.exit(0)
s = json.load(open(state))
if cmd[:1] == ["get_default_active_thread_percentage"]: print(s["pct"])
elif cmd[:1] == ["set_default_active_thread_percentage"]:
    s["pct"] = float(cmd[1]); json.dump(s, open(state, "w")); print(s["pct"])
elif cmd[:1] == ["set_default_device_pinned_mem_limit"]:
    s["mem"] = cmd[2]; json.dump(s, open(state, "w"))
elif cmd[:1] == ["get_server_list"]: print(" ".join(s.get("servers", [])))
elif cmd[:1] == ["set_active_thread_percentage"]:  # tests list servers in the state file
    s["server_pct"] = {**s.get("server_pct", {}), cmd[1]: float(cmd[2])}
    json.dump(s, open(state, "w")); print(float(cmd[2]))
elif cmd[:1] == ["set_device_pinned_mem_limit"]:
    s["server_mem"] = {**s.get("server_mem", {}), cmd[1]: cmd[3]}; json.dump(s, open(state, "w"))
elif cmd[:1] == ["quit"]: os.remove(os.path.join(pipe, "control"))
else: print('Unknown command "%s"' % " ".join(cmd))
sys.exit(0)
'''


def write_fake_control(path: Path) -> Path:
    """Write the stand-in as an executable script at ``path`` (run by this Python)."""
    path.write_text(SCRIPT.replace("PYTHON", sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path
