"""`transformers serve` with continuous batching, from quantlab's own environment. On CPU it decompresses every
compressed-tensors checkpoint to the compute dtype: what it serves is the format's rounding, not its kernels; there it
starts through quantlab's entry module (`transformers_entry`), which loads those checkpoints as quantlab scores them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

from quantlab.serving.engines.base import HOST, Engine, Formats, Launch, Support

# What `transformers serve` needs instead of ignore_eos; a JSON string, as its request schema types it.
FIXED_LENGTH = json.dumps({"eos_token_id": -1})
CACHE_BLOCK_TOKENS = 32
STOCK_ENTRY = "transformers.cli.transformers"
CPU_ENTRY = "quantlab.serving.engines.transformers_entry"  # the same command line, quantlab's loading on CPU


class TransformersServe(Engine):
    name: ClassVar[str] = "transformers"
    label: ClassVar[str] = "transformers serve"
    distributions: ClassVar[tuple[str, ...]] = ("transformers",)
    module: ClassVar[str] = "transformers"
    # Its /v1/completions returns no prompt log-probabilities (no echo): lm-eval cannot score through it (no
    # scoring_protocol).
    weights_metric: ClassVar[str] = "cost/loaded_weight_bytes"  # as loaded here: dequantized on CPU
    reports_kernels: ClassVar[bool] = False  # it logs no kernel choice: `kernels` gives the declared path
    formats: ClassVar[Formats] = {
        "FP8_DYNAMIC": {
            "cuda": Support("compressed-tensors FP8 matmul where the GPU has FP8 (SM >= 89), else dequantized"),
        },
    }

    def command(self, python: Path, launch: Launch) -> list[str]:
        # The checkpoint is loaded before /health answers; concurrent requests are decoded together.
        entry = CPU_ENTRY if launch.device == "cpu" else STOCK_ENTRY
        command = [str(python), "-m", entry, "serve", str(launch.checkpoint)]
        command += ["--continuous-batching", "--host", HOST, "--port", str(launch.port), "--device", launch.device]
        command += ["--dtype", launch.dtype, "--log-level", "warning"]
        if launch.device == "cpu":
            # Unbounded, it sizes its KV cache from most of the host's RAM on CPU, whatever the model: sized instead
            # for the tokens the load can have in flight.
            blocks = -(-launch.kv_cache_tokens // CACHE_BLOCK_TOKENS) + 16
            command += ["--cb-block-size", str(CACHE_BLOCK_TOKENS), "--cb-num-blocks", str(blocks)]
            command += ["--cb-max-batch-tokens", str(launch.batch_tokens)]
        return [*command, *launch.extra]

    def request_body(self, output_tokens: int) -> dict[str, Any]:
        # guidellm adds vLLM's ignore_eos, which transformers serve rejects (HTTP 422): null removes it.
        fixed = {"ignore_eos": None, "stream_options": None, "generation_config": FIXED_LENGTH}
        return {"max_tokens": output_tokens, **fixed}

    def supports(self, stored_format: str | None, device: str) -> Support | None:
        # What `formats` declares (FP8 matmuls on a GPU), else its generic path: every compressed-tensors format
        # decompressed to the compute dtype.
        if (declared := super().supports(stored_format, device)) is not None:
            return declared
        if stored_format is None:
            return Support("torch linear (unquantized)")
        if device == "cpu":
            return Support(
                "decompressed to the compute dtype (torch linear)",
                f"{stored_format} weights are dequantized at load: speed is the compute dtype's",
                served_as="dequantized",
            )
        return Support(
            "decompressed to the compute dtype (no quantized kernel in plain transformers)", served_as="dequantized"
        )

    def kernels(self, log_text: str, stored_format: str | None, device: str) -> dict[str, str]:
        # transformers logs no kernel choice: the quantized layers run as `supports` says.
        support = self.supports(stored_format, device)
        return {} if stored_format is None or support is None else {"Linear": support.kernel}
