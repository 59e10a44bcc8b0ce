"""What every helper process the router starts does first: end when the router ends, and leave Ctrl-C to it.

Standard library only (the acceptor process imports nothing else)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal the kernel sends this process when its parent ends (Linux)."""


def follow_router(router_pid: int) -> None:
    """In a process the router started: ended by the kernel when the router's process ends, however it
    ends (SIGKILL, the OOM killer: it cannot end its helpers then). The death signal follows the thread
    that started the process: the router's event loop thread, which lives as long as the router. SIGINT
    is ignored: a terminal's Ctrl-C goes to its whole process group, and the router, which drains its
    requests first (helped by these processes), ends them itself; the signal used to end them mid-drain
    with a KeyboardInterrupt traceback on the console."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != router_pid:  # the router ended before the request was in place
            os._exit(1)
