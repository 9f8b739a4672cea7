"""`python -m quantlab.serving.guard PARENT_PID -- COMMAND...`: run COMMAND and take its whole process group down
when PARENT_PID dies.

A server or guidellm started by a variant forks processes of its own (guidellm's workers, vLLM's engine core), and
the kernel's parent-death signal reaches only a direct child: when the variant dies outright (SIGKILL, the OOM
killer, its sweep killed), those grandchildren would live on. This guard leads the group they all share (the
launcher starts it in a new session), watches its parent, and kills the group when the parent is gone.
Standard library only: it starts in milliseconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.2


def main(argv: list[str]) -> int:
    parent, separator, *command = argv
    if separator != "--" or not command:
        print("usage: python -m quantlab.serving.guard PARENT_PID -- COMMAND...", file=sys.stderr)
        return 2
    child = subprocess.Popen(command)
    # A SIGTERM to the guard alone (not its group) still reaches the command.
    signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signal.SIGTERM))
    while (code := child.poll()) is None:
        if os.getppid() != int(parent):  # reparented: the process that started us is gone
            os.killpg(0, signal.SIGKILL)
        time.sleep(POLL_S)
    if code < 0:  # die of the same signal, so the launcher can tell how the command ended
        if -code != signal.SIGKILL:  # SIGKILL's handler cannot be set, nor needs to be
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
