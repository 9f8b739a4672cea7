"""`python -m quantlab.serving.guidellm_runner READY SCENARIO`: guidellm's `run`, imported before its scenario exists.

Most of guidellm's start is its import (about 9 s of CPU on 2 cores: its tokenizer module brings torch and
transformers). Started early, beside the variant's other stages and its server's own start, this process does that
import first, says so (creates the file READY), then waits for the file SCENARIO and runs `guidellm run --scenario` on
it, in this process, as `python -m guidellm run` would. quantlab.serving.load.LoadGenerator drives it.

The top level imports only what guidellm's own __main__ does: guidellm's fork server (GUIDELLM__MP_CONTEXT_TYPE)
re-imports the main module before forking each load level's workers, which should stay as light as guidellm's.
Standard library otherwise: run as a script there, this file cannot import quantlab.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from guidellm.cli import cli

POLL_S = 0.05


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m quantlab.serving.guidellm_runner READY SCENARIO", file=sys.stderr)
        return 2
    ready, scenario = (Path(arg) for arg in argv)
    # What `guidellm run` imports once it starts (its benchmark entry point, the data loaders and the tokenizer).
    import guidellm.benchmark.entrypoints  # noqa: F401

    ready.touch()
    while not scenario.exists():  # written whole (renamed into place) once the server is ready and warmed up
        time.sleep(POLL_S)
    # Exits the process with guidellm's own exit code (click's standalone mode).
    cli.main(["run", "--scenario", str(scenario), "--disable-console-interactive"], prog_name="guidellm")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
