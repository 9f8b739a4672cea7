"""The runner's serve stage: the variant's checkpoint behind a real server, under guidellm's load, as `cost/serving/*`
metrics, `served.*` params (what served it: engine, version, command line, hardware, price; the recipe's section is
`serving.*`), tags for what is absent, and artifacts (guidellm's report, the throughput-latency chart).

It runs after the measure stage, whose measured copy bandwidth and loaded weight size give the modeled ceiling
the measured peak is set against. The server's and guidellm's logs go beside the variant's own log, so they are
kept as artifacts whether the stage succeeds or fails.
"""

from __future__ import annotations

import gc
import json
import os
import shlex
import tempfile
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

from quantlab.host_share import visible_cores
from quantlab.jobs import side_log
from quantlab.measure.modeled import ModelShape, config_dict
from quantlab.measure.provenance import cpu_model_name
from quantlab.serving.chart import throughput_latency_chart
from quantlab.serving.goodput import UNAVAILABLE_TAG, ServingSummary, summarize
from quantlab.serving.launcher import chosen_engine, engine_problem, running_server, server_command
from quantlab.serving.levels import LoadLevel, load_levels
from quantlab.serving.load import run_load, scenario, warm_up
from quantlab.serving.pricing import modeled_decode_tokens_per_s, serving_price
from quantlab.serving.settings import ServingSettings

if TYPE_CHECKING:
    import torch

    from quantlab.measure.settings import MeasureSettings

REPORT_ARTIFACT = "serving/guidellm.json"
CHART_ARTIFACT = "serving/throughput_latency.png"


@dataclass(frozen=True)
class ServingOutcome:
    metrics: dict[str, float] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    artifacts: dict[str, str | bytes] = field(default_factory=dict)


def serve(
    checkpoint: Path,
    variant: str,
    settings: ServingSettings,
    measure: MeasureSettings,
    recipe_dir: Path,
    device: str,
    dtype: torch.dtype,
    cost_metrics: dict[str, float],
    log_dir: Path | None,
) -> ServingOutcome:
    if not settings.enabled:
        return ServingOutcome(tags={UNAVAILABLE_TAG + "serving": "serving.enabled is false in the recipe"})
    import torch

    gc.collect()  # the caller dropped its model: free its memory before the server loads its own copy
    if device == "cuda":
        torch.cuda.empty_cache()
    gpu_name = torch.cuda.get_device_name(0) if device == "cuda" else None
    engine = chosen_engine(settings.engine, gpu_visible=gpu_name is not None)
    if (problem := engine_problem(engine, gpu_visible=gpu_name is not None)) is not None:
        raise RuntimeError(f"serving.engine: {problem}")
    threads = torch.get_num_threads()
    dtype_name = str(dtype).removeprefix("torch.")
    prompts = (recipe_dir / settings.prompts).resolve() if settings.prompts else None

    with tempfile.TemporaryDirectory(prefix=f"quantlab-serve-{variant}-") as scratch:
        logs = log_dir or Path(scratch)
        env = _server_environment(threads)

        def command_for(port: int) -> list[str]:
            extra = [*_cpu_cache_args(engine, device, settings), *settings.server_args]
            return server_command(engine, checkpoint, port, device, dtype_name, extra)

        server_log = side_log(logs, variant, "server")
        with running_server(command_for, engine, server_log, env, settings.startup_timeout_s, settings.port) as server:
            report_path = Path(scratch) / "guidellm.json"
            spec = scenario(settings, engine, server.url, checkpoint, prompts, report_path)
            levels = max(len(settings.concurrency), settings.levels)
            budget = levels * settings.requests_per_level * settings.request_timeout_s + 300
            load_log = side_log(logs, variant, "guidellm")
            # The runner holds the host's timing lock around this stage: the host's other variants pause meanwhile.
            warm_up(server, checkpoint, settings)
            report = run_load(spec, Path(scratch), load_log, server, budget, _workers(device))
            command = shlex.join(server.command)
        artifacts: dict[str, str | bytes] = {REPORT_ARTIFACT: report_path.read_text()}
        if log_dir is None:  # no sweep log directory to keep them: they travel with the result
            artifacts |= {"logs/server.log": server_log.read_text(errors="replace")}

    levels = load_levels(report)
    _check_output_lengths(levels, settings)
    shape = ModelShape.from_config(config_dict(checkpoint / "config.json"))
    peak = max(levels, key=lambda level: level.output_tokens_per_s)
    summary = summarize(
        levels,
        settings.slo,
        serving_price(settings, measure, gpu_name, threads),
        _modeled(shape, engine, cost_metrics, dtype, settings, peak),
    )
    title = f"{variant}: {engine} serve, {settings.prompt_tokens} prompt + {settings.output_tokens} output tokens"
    artifacts[CHART_ARTIFACT] = throughput_latency_chart({variant: levels}, title, settings.slo)
    return ServingOutcome(
        metrics=summary.to_metrics(),
        params=_params(engine, command, summary, gpu_name, threads),
        tags=summary.to_tags(engine),
        artifacts=artifacts,
    )


CACHE_BLOCK_TOKENS = 32


def _cpu_cache_args(engine: str, device: str, settings: ServingSettings) -> list[str]:
    """transformers serve sizes its continuous-batching KV cache from the host's whole RAM on CPU (most of it, touched:
    20 GB of a 23 GB VM for a tiny model); sized instead for the most streams the load can have in flight."""
    if engine != "transformers" or device != "cpu":
        return []
    streams = max(max(settings.concurrency), settings.requests_per_level if settings.profile == "sweep" else 0)
    per_stream = -(-(settings.prompt_tokens + settings.output_tokens) // CACHE_BLOCK_TOKENS) + 1
    blocks = streams * per_stream + 16
    batch_tokens = max(512, settings.prompt_tokens + streams)
    return [
        "--cb-block-size",
        str(CACHE_BLOCK_TOKENS),
        "--cb-num-blocks",
        str(blocks),
        "--cb-max-batch-tokens",
        str(batch_tokens),
    ]


def _server_environment(threads: int) -> dict[str, str]:
    # The variant's share of the cores (measure.contention) for the server's torch pool; the checkpoint is local.
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def _workers(device: str) -> int | None:
    return 1 if device == "cpu" else None


def _check_output_lengths(levels: list[LoadLevel], settings: ServingSettings) -> None:
    """Variants are compared at the same output length: a server that stopped early would look faster."""
    short = [level for level in levels if level.succeeded and level.output_tokens_min < settings.output_tokens]
    if short:
        found = ", ".join(f"{level.label}: {level.output_tokens_min:.0f}" for level in short)
        raise RuntimeError(
            f"the server returned outputs shorter than serving.output_tokens ({settings.output_tokens}) - shortest "
            f"per level: {found}; throughputs would not compare across variants"
        )


def _modeled(
    shape: ModelShape,
    engine: str,
    cost_metrics: dict[str, float],
    dtype: torch.dtype,
    settings: ServingSettings,
    peak: LoadLevel,
) -> float | None:
    """The decode ceiling of the peak level on this hardware: the measure stage's copy bandwidth, and the weights
    as the engine holds them (transformers: as loaded here, dequantized on CPU; vLLM: the stored payload)."""
    import torch

    bandwidth = cost_metrics.get("cost/measured_bandwidth_bytes_per_s")
    weights_key = "cost/weight_bytes_in_memory" if engine == "vllm" else "cost/loaded_weight_bytes"
    weights = cost_metrics.get(weights_key)
    if not bandwidth or not weights:
        return None
    element = torch.empty((), dtype=dtype).element_size()
    context = settings.prompt_tokens + settings.output_tokens / 2
    return modeled_decode_tokens_per_s(shape, weights, element, bandwidth, context, peak.concurrency)


def _params(engine: str, command: str, summary: ServingSummary, gpu_name: str | None, threads: int) -> dict[str, str]:
    package = "vllm" if engine == "vllm" else "transformers"
    hardware = gpu_name or f"CPU: {cpu_model_name()}, {threads} of {visible_cores()} cores"
    found = {
        "served.engine": engine,
        "served.engine_version": _version(package),
        "served.command": command,
        "served.hardware": hardware,
        "served.guidellm_version": _version("guidellm"),
        "served.levels": json.dumps([level.label for level in summary.levels]),
    }
    if summary.price is not None:
        found |= {
            "served.price_per_hour": f"{summary.price.usd_per_hour:.6g}",
            "served.price_source": summary.price.source,
        }
    return found


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"
