"""Start a command that dies with the demo: ``python -m gpuslice.demo.child PARENT_PID CMD...``.

On Linux the process asks for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``, kept across
``exec``), checks that the parent is still the one that started it, then replaces itself with
the command. So even a demo killed with SIGKILL leaves no replica or router behind. (Setting
this in ``preexec_fn`` instead would fork a process that runs gRPC threads, which gRPC forbids.)
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys


def main() -> None:
    parent, cmd = int(sys.argv[1]), sys.argv[2:]
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PDEATHSIG
    if os.getppid() != parent:  # the demo is already gone
        sys.exit(1)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
