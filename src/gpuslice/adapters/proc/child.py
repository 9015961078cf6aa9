"""Start a command that dies with its parent: ``python -m gpuslice.adapters.proc.child PID CMD...``.

On Linux the process asks for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``, kept across
``exec``), checks that the parent is still the one that started it, then replaces itself with
the command. So even a demo or local mode killed with SIGKILL leaves no replica behind. (Setting
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
    if os.getppid() != parent:  # the parent is already gone
        sys.exit(1)
    try:
        os.execvp(cmd[0], cmd)
    except OSError as exc:
        sys.exit(f"cannot run {cmd[0]!r}: {exc}")


if __name__ == "__main__":
    main()
