"""One copy-bandwidth probe per sweep, host and device, shared by the sweep's variants.

Every modeled ceiling divides by the measured bandwidth, and one probe differs from the next by tens of percent on
a busy machine: a ceiling per variant from
its own probe would make a ratio against it differ between variants for no reason of theirs. So the first variant
of a sweep to measure on a host takes the probe, under the host's timing lock (alone), and leaves it in the sweep's
own folder (its log folder: shared by its variants, on every host of a Ray cluster, and gone with the sweep); the
others read it. Two variants taking it at once (where no timing lock is held) keep the first one written.
"""

from __future__ import annotations

import json
import os
import socket
from contextlib import suppress
from dataclasses import asdict
from pathlib import Path

import torch

from quantlab.measure.timing import BandwidthReading, measure_copy_bandwidth


def probe_path(directory: Path, device: torch.device) -> Path:
    return directory / f"bandwidth.{socket.gethostname()}.{str(device).replace(':', '')}.json"


def sweep_bandwidth(directory: Path | None, device: torch.device, nbytes: int, repeats: int) -> BandwidthReading:
    """The sweep's probe of this host and `device`, read from `directory` where one of its variants took it; else
    taken now and left there. None for `directory` (no sweep: a stage run on its own): taken now, kept nowhere."""
    if directory is None:
        return measure_copy_bandwidth(device, nbytes, repeats)
    path = probe_path(directory, device)
    if (found := _read(path)) is not None:
        return found
    taken = measure_copy_bandwidth(device, nbytes, repeats)
    shared = BandwidthReading(taken.bytes_per_s, f"{taken.method}; taken once for the sweep on this host")
    directory.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    scratch.write_text(json.dumps(asdict(shared)))
    try:
        os.link(scratch, path)  # never replaces: the first probe written is the sweep's
    except FileExistsError:
        pass
    except OSError:  # a file system without hard links: the last written wins, read back below
        os.replace(scratch, path)
    finally:
        scratch.unlink(missing_ok=True)
    return _read(path) or shared


def _read(path: Path) -> BandwidthReading | None:
    with suppress(OSError, ValueError, TypeError):
        return BandwidthReading(**json.loads(path.read_text()))
    return None
