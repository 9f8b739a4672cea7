"""What a serving engine is to quantlab: where its Python lives, how its server starts on this machine, what a
request must carry, how it scores prompts, which kernel it runs each stored format with, and what its log says it
chose.

One engine is one file beside this one plus one line in the registry (`quantlab.serving.engines.ENGINES`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

HOST = "127.0.0.1"


@dataclass(frozen=True)
class Support:
    """How a serving engine runs checkpoints of one stored format on one kind of device: the kernel it is expected to
    choose (the one it really chose is read from its log) and what a reviewer should know about it."""

    kernel: str
    note: str = ""
    # The format the engine really computes, when not the stored one (a weight-only fallback, an emulation): the
    # "served as" label of the report and `pick`.
    served_as: str | None = None
    # CPU features its kernels need, as /proc/cpuinfo's flags name them: a CPU without them cannot serve the format
    # with this engine (vLLM's CPU FP8 block kernels need AMX tiles, which AMD EPYC and Intel before Sapphire Rapids
    # lack: its engine fails at start-up, "Failed to find a kernel that can implement the ScaledMM linear layer").
    cpu_flags: tuple[str, ...] = ()
    # The groups of input channels its kernels take (a variant's params.group_size); empty: any.
    group_sizes: tuple[int, ...] = ()
    # The compute dtypes its kernels take (the variant's `pick_dtype`, which the server is given); empty: any.
    dtypes: tuple[str, ...] = ()


# compressed-tensors' stored format (None: unquantized) -> device ("cpu", "cuda") -> how the engine runs it. A device
# missing: the engine cannot serve that format there (the recipe is refused before any work), unless the engine has a
# generic path of its own (transformers serve dequantizes whatever it is given).
Formats = Mapping[str | None, Mapping[str, Support]]


@dataclass(frozen=True)
class Launch:
    """How one variant's server starts here: the checkpoint, the port, and the share of the machine it gets."""

    checkpoint: Path
    port: int
    device: str  # "cpu" or "cuda"
    dtype: str  # the engine's compute dtype, e.g. "bfloat16"
    threads: int  # the variant's share of the cores (its OpenMP threads on CPU)
    bind_cpus: tuple[int, ...]  # cores to bind those threads to; empty: let the OS place them
    gpus: int  # GPUs the variant was given (tensor parallel across them when > 1)
    kv_cache_tokens: int  # sized for the load and the evaluation, never a fraction of the host's memory
    kv_bytes_per_token: int  # the model's keys and values of one token, in the compute dtype
    batch_tokens: int  # the most tokens one forward pass takes
    max_model_len: int
    gpu_memory_utilization: float | None  # from the GPU memory free at start; None on CPU
    top_logprobs: int  # the most log-probabilities per token a request may ask for (token damage)
    extra: tuple[str, ...] = ()  # serving.server_args
    # Started to score (lm-eval's requests, prompt log-probabilities): each answer must not depend on what else is
    # in flight or was served before; False: the engine's serving defaults, as users run it (the load's levels).
    scoring: bool = False
    kv_cache_dtype: str = "auto"  # "fp8": the checkpoint's FP8 KV cache with its calibrated scales
    plugins: tuple[str, ...] = ()  # serving.plugins: quantlab's plugins the engine loads (`Engine.plugins`)


@dataclass(frozen=True)
class EnginePlugin:
    """A plugin of quantlab's that an engine loads through its own extension point (vLLM: `vllm.general_plugins`),
    opt-in per recipe (`serving.plugins`). What it runs is not the stock engine: its served figures say so, and
    no cost decision rests on them."""

    name: str  # the recipe's serving.plugins entry
    folder: Path  # on the server's PYTHONPATH: the package, and the dist-info through which the engine finds it
    entry_point: str  # its name in the engine's plugin group
    devices: tuple[str, ...]  # where it applies
    changes: str  # what differs from the stock engine, for people

    def digest(self) -> str:
        """sha256 of its files (paths and contents): the plugin's identity in a run's key and params."""
        hashed = hashlib.sha256()
        for path in sorted(p for p in self.folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            hashed.update(str(path.relative_to(self.folder)).encode() + b"\0" + path.read_bytes() + b"\0")
        return hashed.hexdigest()

    def identity(self) -> str:
        """ "name sha256:<first 12>", as the run key and `served.plugins` record it."""
        return f"{self.name} sha256:{self.digest()[:12]}"


@dataclass(frozen=True)
class ScoringProtocol:
    """How an engine's server scores prompts, part of a served variant's run key: a kept served score came through
    the same requests. `completions`: lm-eval's registered model (`lm_eval.api.registry`) that sends it lm-eval's
    loglikelihood requests (echoed prompt log-probabilities) and generation requests; `prompt_logprobs`: how it
    returns every prompt token's log-probability with the top k beside it (token damage, the engine's floor)."""

    completions: str
    prompt_logprobs: str


@dataclass(frozen=True)
class PositionLogprobs:
    """What the engine reported for one scored position: the actual token's log-probability, its top-ranked token,
    and every token whose log-probability it gave (its top k, and the actual token)."""

    actual: float
    top1: int
    token_ids: np.ndarray  # int64
    logprobs: np.ndarray  # float64


def post_json(url: str, body: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
    """POST `body` as JSON to `url`; its JSON answer."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        return json.loads(answer.read())


@dataclass(frozen=True)
class InstallSpec:
    """An engine's own virtualenv: what pip installs there, then what it removes (wheels that break the engine)."""

    folder: str
    packages: tuple[str, ...]
    remove: tuple[str, ...] = ()
    module: str = ""  # what must import there afterwards


# "Selected CPUWNA16LinearKernel for CompressedTensorsWNA16", "Using MarlinLinearKernel for CompressedTensorsWNA16"
# A layer type is one identifier closing its line ("Using X for mixed-precision linear" names none).
KERNEL_LINE = re.compile(
    r"\b(?:Selected|Using) ([A-Za-z0-9_]+(?:Kernel|Method|Backend)[A-Za-z0-9_]*) for ([A-Za-z0-9_]+)[ \t]*$", re.M
)


def kernels_in_log(text: str) -> dict[str, str]:
    """{layer type: kernel} from an engine log's "Selected X for Y" / "Using X for Y" lines (the last one wins)."""
    return {layer: kernel for kernel, layer in KERNEL_LINE.findall(text)}


class Engine(ABC):
    name: ClassVar[str]  # the recipe's serving.engine
    label: ClassVar[str]  # for people
    distributions: ClassVar[tuple[str, ...]]  # whose installed version is the engine's version
    module: ClassVar[str]  # what must import in its Python
    # How its server scores prompts: lm-eval's tasks and token damage through it. None: it is only served (its load).
    scoring_protocol: ClassVar[ScoringProtocol | None] = None
    weights_metric: ClassVar[str]  # the cost/* figure of the weights it holds in memory
    reports_kernels: ClassVar[bool] = True  # its log names the kernel of each quantized layer type (`kernels`)
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = ()  # KV-cache formats it stores as declared (else: compute dtype)
    builds: ClassVar[dict[str, str]] = {}  # distribution -> who makes it, where that is not the engine's project
    plugins: ClassVar[dict[str, EnginePlugin]] = {}  # quantlab's plugins for it, by serving.plugins name
    formats: ClassVar[Formats] = {}  # the kernels it runs each stored format with, per device

    @abstractmethod
    def command(self, python: Path, launch: Launch) -> list[str]:
        """The server's command line."""

    @property
    def scores_prompts(self) -> bool:
        return self.scoring_protocol is not None

    def prompt_logprobs(
        self, url: str, model_name: str, prompt: list[int], top_k: int, timeout_s: float
    ) -> list[PositionLogprobs | None]:
        """The server's log-probabilities of `prompt`'s own tokens, one entry per token (None where it scores none:
        the first), with the `top_k` most likely tokens at each position (`scoring_protocol.prompt_logprobs`)."""
        raise NotImplementedError(f"{self.label} does not score prompts")

    def environment(self, launch: Launch) -> dict[str, str]:
        """Variables the server needs beyond the sweep's own environment."""
        return {"OMP_NUM_THREADS": str(launch.threads)}

    def compute_dtype(self, variant_dtype: str) -> str:
        """The dtype its server computes in, given the variant's: the reference path's, so that both paths score in
        one dtype ("float32" on a CPU without BF16 matmuls, where a bf16 GEMM is emulated and several times slower)."""
        return variant_dtype

    def scoring_params(self, launch: Launch) -> dict[str, str]:
        """What makes a scoring server's answers independent of its other requests, and what the engine has not got
        (`served.scoring.*` params)."""
        return {"prefix_caching": "the engine's default (quantlab sets nothing)", "batch_invariant": "no"}

    def kv_cache_problem(self, kv_cache_dtype: str, device: str) -> str | None:
        """Why this engine cannot start with the KV cache a checkpoint declares on `device`; None: it can."""
        return None

    def kv_cache_served(self, launch: Launch) -> str:
        """The KV cache as this server stores it (`served.kv_cache_dtype`)."""
        return launch.kv_cache_dtype if launch.kv_cache_dtype in self.kv_cache_dtypes else launch.dtype

    @abstractmethod
    def request_body(self, output_tokens: int) -> dict[str, Any]:
        """Fields every load request carries so that it generates exactly `output_tokens` (None: field removed)."""

    def supports(self, stored_format: str | None, device: str) -> Support | None:
        """How this engine runs a checkpoint stored in `stored_format` (None: unquantized) on `device`, as its
        `formats` declare it; None: it cannot (here: on a CPU, the kernels may need features this one lacks, `why_not`
        says)."""
        declared = self.formats.get(stored_format, {}).get(device)
        return None if declared is not None and device == "cpu" and lacking_cpu_flags(declared) else declared

    def why_not(self, stored_format: str | None, device: str) -> str:
        """Why `supports` says no, where more can be said than that nothing is declared; "" otherwise."""
        declared = self.formats.get(stored_format, {}).get(device)
        lacking = lacking_cpu_flags(declared) if declared is not None and device == "cpu" else []
        return f"its kernels need CPU features this CPU lacks ({', '.join(lacking)})" if lacking else ""

    def group_size_problem(self, stored_format: str | None, device: str, group_size: int) -> str | None:
        """Why this engine's kernels for `stored_format` on `device` cannot take groups of `group_size`; None: they
        can (or it cannot serve the format there at all, which `supports` says)."""
        support = self.supports(stored_format, device)
        if support is None or not support.group_sizes or group_size in support.group_sizes:
            return None
        sizes = ", ".join(map(str, support.group_sizes))
        return f"{self.label}'s {stored_format} kernels on {device} take groups of {sizes} only, not {group_size}"

    def dtype_problem(self, stored_format: str | None, device: str, dtype: Callable[[], str]) -> str | None:
        """Why this engine's kernels for `stored_format` on `device` cannot compute in the variant's `dtype` (asked
        only of a format whose kernels name their dtypes: finding it may import torch); None: they can."""
        support = self.supports(stored_format, device)
        if support is None or not support.dtypes or (chosen := dtype()) in support.dtypes:
            return None
        return (
            f"{self.label}'s {stored_format} kernels on {device} compute in {' or '.join(support.dtypes)}, not {chosen}"
        )

    def kernels(self, log_text: str, stored_format: str | None, device: str) -> dict[str, str]:
        """{layer type: kernel} the engine ran this checkpoint's quantized layers with."""
        return kernels_in_log(log_text)

    def install_spec(self, cpu: bool) -> InstallSpec | None:
        """The environment `quantlab engine install` makes for it; None: it lives in quantlab's own."""
        return None


def lacking_cpu_flags(support: Support) -> list[str]:
    """The CPU features `support`'s kernels need that this machine's CPU lacks."""
    return [flag for flag in support.cpu_flags if flag not in host_cpu_flags()]


@functools.cache
def host_cpu_flags() -> frozenset[str]:
    """This CPU's feature flags, as /proc/cpuinfo lists them (empty where there is none to read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    found = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return frozenset(found.group(1).split()) if found else frozenset()


def python_path_with(folders: Sequence[Path]) -> str:
    """PYTHONPATH with `folders` first: what they hold is importable (and its distributions found) in every Python
    process of the server."""
    return os.pathsep.join(filter(None, [*map(str, folders), os.environ.get("PYTHONPATH")]))


def shown_command(command: Sequence[str], environment: Mapping[str, str]) -> str:
    """The command line with the variables the engine was started with, as a shell would read them."""
    import shlex

    return " ".join(
        [*(f"{name}={shlex.quote(value)}" for name, value in sorted(environment.items())), shlex.join(command)]
    )
