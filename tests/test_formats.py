"""The formats of issue 29 (FP8 block, MXFP8, NVFP4, NVFP4A16, MXFP4, W4A8-FP8) on the tiny Llama: each checkpoint
stores its compressed-tensors preset, reloads in transformers, and moves the logits off BF16 by an amount ordered as
the formats' precision; the bytes the disk check models are the bytes compressed-tensors wrote; what each engine runs
a format with comes from the method's own declaration, and the "served as" label reaches the report and `pick`.
Then real vLLM (its CPU build, as tests/test_engines.py installs it) serving FP8 blocks with the kernel declared."""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from test_engines import SHARP, launch, vllm_python  # noqa: F401 - vllm_python: a fixture
from test_fake_quant import count_roundings
from test_quantize import CALIBRATION, _variant
from test_recipe import _problems
from tiny import save_tiny_llama

from quantlab.checks import serving_problems, validate
from quantlab.decision import pick
from quantlab.fake_quant import INSTALLED_NOTICE
from quantlab.frontier import Axis, VariantSummary, compute_frontiers
from quantlab.measure.checkpoint import CheckpointFacts
from quantlab.measure.modeled import ModelShape, config_dict, weight_counts
from quantlab.models import load_checkpoint, resolve_source, rowwise_fp8
from quantlab.policy import Policy
from quantlab.quantize import METHODS
from quantlab.recipe import ModelSpec, Recipe
from quantlab.report import render_markdown, variants_table
from quantlab.serving.engines import ENGINES
from quantlab.serving.engines.base import host_cpu_flags, kernels_in_log
from quantlab.serving.goodput import SERVING_TAG
from quantlab.serving.launcher import running_server
from quantlab.stages.quantize import quantize_variant
from recipes import REPO, tiny_recipe, write

# The tiny Llama's input widths are 64 and 128: the preset's blocks and groups of 128 are narrowed to 64.
PARAMS = {
    "bf16": {},
    "fp8": {},
    "fp8_block": {"block_size": 64},
    "mxfp8": {},
    "nvfp4": {},
    "nvfp4a16": {},
    "mxfp4": {},
    "w4a8_fp8": {"group_size": 64},
}
# method: the checkpoint's storage format, and its scheme as compressed-tensors 0.19's preset defines it (read from
# its quant_scheme.py, written out here rather than imported), with the params above
FP4_GROUPS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}
MX = {"type": "float", "strategy": "group", "group_size": 32, "symmetric": True}
EXPECTED = {
    "fp8_block": (
        "float-quantized",
        {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [64, 64], "dynamic": False},
        {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 64, "dynamic": True},
    ),
    "mxfp8": ("mxfp8-quantized", MX | {"num_bits": 8, "dynamic": False}, MX | {"num_bits": 8, "dynamic": True}),
    "nvfp4": ("nvfp4-pack-quantized", FP4_GROUPS | {"dynamic": False}, FP4_GROUPS | {"dynamic": "local"}),
    "nvfp4a16": ("nvfp4-pack-quantized", FP4_GROUPS | {"dynamic": False}, None),
    "mxfp4": ("mxfp4-pack-quantized", MX | {"num_bits": 4, "dynamic": False}, MX | {"num_bits": 4, "dynamic": True}),
    "w4a8_fp8": (
        "pack-quantized",
        {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64, "symmetric": True, "dynamic": False},
        {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
    ),
}
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


@pytest.fixture(scope="module")
def formats(tmp_path_factory, tiny_llama):
    """Each method's checkpoint of the tiny Llama (about 1.5 s each) and its logits in float32 on CPU."""
    cache_root = tmp_path_factory.mktemp("cache")
    source = resolve_source(ModelSpec(source=str(tiny_llama.path)), Path.cwd())
    made, logits = {}, {}
    for method, params in PARAMS.items():
        variant = _variant(name=method, method=method, params=params)
        made[method] = quantize_variant(source, variant, CALIBRATION, Path.cwd(), cache_root, "cpu").path
        model, tokenizer = load_checkpoint(made[method], torch.float32, "cpu")
        with torch.inference_mode():
            logits[method] = model(tokenizer(PROMPT, return_tensors="pt")["input_ids"]).logits.float()[0]
    return made, logits


def _kl_from_bf16(logits: dict[str, torch.Tensor], method: str) -> float:
    """Mean over positions of KL(BF16 || method), nats."""
    base, variant = logits["bf16"].log_softmax(-1), logits[method].log_softmax(-1)
    return (base.exp() * (base - variant)).sum(-1).mean().item()


@pytest.mark.parametrize("method", sorted(EXPECTED))
def test_each_checkpoint_stores_its_preset(formats, method):
    made, _ = formats
    quantization = json.loads((made[method] / "config.json").read_text())["quantization_config"]
    storage, weights, activations = EXPECTED[method]
    (group,) = quantization["config_groups"].values()
    assert quantization["quant_method"] == "compressed-tensors" and quantization["format"] == storage
    assert {key: group["weights"][key] for key in weights} == weights
    assert (group["input_activations"] and {key: group["input_activations"][key] for key in activations}) == activations
    assert group["targets"] == ["Linear"] and quantization["ignore"] == ["lm_head"]


@pytest.mark.parametrize("method", sorted(EXPECTED))
def test_each_format_moves_the_logits_by_a_plausible_amount(formats, method):
    """Loaded in transformers (float32 on CPU, where compressed-tensors rounds activations on every pass): off
    BF16, and not by much. Random weights give flat distributions, so KL is small; the relative change in the logits
    (0.03-0.18 here) says more."""
    _, logits = formats
    relative = ((logits[method] - logits["bf16"]).norm() / logits["bf16"].norm()).item()
    assert 0.01 < relative < 0.5, relative
    assert 0 < _kl_from_bf16(logits, method) < 0.01
    assert (logits[method].argmax(-1) == logits["bf16"].argmax(-1)).float().mean() > 0.5


def test_damage_is_ordered_by_precision(formats):
    """Same weights, fewer bits, more damage: MXFP8 < NVFP4 < MXFP4 (NVFP4's groups of 16 with FP8 scales beat
    MXFP4's groups of 32 with power-of-two scales); NVFP4 above NVFP4A16, its activations rounded too; FP8 blocks
    and MXFP8 both below every 4-bit format."""
    _, logits = formats
    kl = {method: _kl_from_bf16(logits, method) for method in EXPECTED}
    assert kl["mxfp8"] < kl["nvfp4"] < kl["mxfp4"], kl
    assert kl["nvfp4a16"] < kl["nvfp4"], kl
    assert max(kl["mxfp8"], kl["fp8_block"]) < min(kl["nvfp4a16"], kl["w4a8_fp8"], kl["mxfp4"]), kl


@pytest.mark.parametrize("method", sorted(PARAMS))
def test_modeled_linear_bytes_are_the_bytes_written(formats, tiny_llama, method):
    """What the disk check counts (`Method.linear_bytes`) against the decoder blocks' linear tensors in the
    checkpoint (quantlab.measure.checkpoint reads the safetensors headers), to the byte."""
    made, _ = formats
    weights = weight_counts(ModelShape.from_config(config_dict(tiny_llama.path / "config.json")))
    modeled = METHODS[method].linear_bytes(weights, METHODS[method].Params(**PARAMS[method]).model_dump())
    assert modeled == CheckpointFacts.from_dir(made[method]).linear_weight_bytes()


def test_only_per_channel_fp8_goes_to_transformers_fp8_kernel_on_a_gpu(formats):
    """Its row-wise kernel would misread MXFP8's group scales and FP8_BLOCK's block scales (a GPU loads those through
    compressed-tensors instead); a checkpoint without FP8 weights has nothing to send there."""
    made, _ = formats
    taken = {
        m
        for m in PARAMS
        if rowwise_fp8(json.loads((made[m] / "config.json").read_text()).get("quantization_config", {}))
    }
    assert taken == {"fp8"}


@pytest.mark.parametrize(
    ("method", "params", "widths", "field"),
    [
        ("nvfp4", {}, {"a": 64, "b": 24}, "ignore"),  # groups of 16
        ("mxfp4", {}, {"a": 64, "b": 48}, "ignore"),  # groups of 32
        ("mxfp8", {}, {"a": 576}, None),
        ("fp8_block", {}, {"a": 576}, "block_size"),  # SmolLM2-135M's width, the preset's 128
        ("fp8_block", {"block_size": 64}, {"a": 576, "b": 1536}, None),
        ("w4a8_fp8", {}, {"a": 576}, "group_size"),
    ],
)
def test_group_sizes_are_checked_against_the_widths(method, params, widths, field):
    found = METHODS[method].check_model(METHODS[method].Params(**params), widths)
    assert [problem_field for problem_field, _ in found] == ([field] if field else [])


def test_the_formats_recipe_is_valid_and_its_narrowed_sizes_are_needed(tmp_path):
    """SmolLM2-135M's 576-wide layers take blocks and groups of 64, not the presets' 128 (checked against the
    embedded model's config before any work)."""
    recipe = REPO / "recipes" / "smollm2-135m-formats.yaml"
    methods = [variant.method for variant in validate(recipe).recipe.variants]
    assert methods[:8] == ["bf16", "fp8", "fp8_block", "mxfp8", "nvfp4", "nvfp4a16", "mxfp4", "w4a8_fp8"]
    assert methods[8:] == ["fp8", "mixed", "mixed"]  # fp8 with an FP8 KV cache; the budget mixes (issue 29 part B)
    text = recipe.read_text().replace("_size: 64 ", "_size: 128").replace("../evals", str(REPO / "evals"))
    first, second = _problems(write(tmp_path / "recipe.yaml", text))
    assert "variants[2] (fp8-block-64).params.block_size: 128 does not divide" in first
    assert "variants[7] (w4a8-fp8-g64).params.group_size: 128 does not divide" in second


def test_engine_support_is_each_methods_own_declaration():
    """vLLM's CPU build has no FP4, MXFP8 or W4A8-FP8 kernel: refused there; transformers serve dequantizes what no
    method declares for it. Methods that store one format declare it alike."""
    vllm, transformers = ENGINES["vllm"], ENGINES["transformers"]
    single = {name: method for name, method in METHODS.items() if name != "mixed"}  # mixed: a format per group
    refused_on_cpu = {m for m, method in single.items() if vllm.supports(method.stored_format, "cpu") is None}
    amx = "amx_tile" in host_cpu_flags()  # vLLM's CPU FP8 block kernels need AMX tiles
    avx512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= host_cpu_flags()  # and its W4A16 kernel AVX-512
    assert refused_on_cpu == {"nvfp4", "nvfp4a16", "mxfp4", "mxfp8", "w4a8_fp8"} | (set() if amx else {"fp8_block"}) | (
        set() if avx512 else {"awq_int4", "gptq_int4"}
    )
    assert all(vllm.supports(method.stored_format, "cuda") for method in single.values())
    assert vllm.supports("NVFP4", "cuda").served_as.startswith("NVFP4A16")
    declared = vllm.formats["FP8_BLOCK"]["cpu"]
    assert declared.cpu_flags == ("amx_tile",) and vllm.supports("FP8_BLOCK", "cpu") is (declared if amx else None)
    assert transformers.supports("MXFP4", "cpu").served_as == "dequantized"
    assert transformers.supports("FP8_DYNAMIC", "cuda") is transformers.formats["FP8_DYNAMIC"]["cuda"]
    # Every engine's table speaks compressed-tensors' stored formats, the ones the methods store
    stored = {method.stored_format for method in METHODS.values()}
    assert all(set(engine.formats) <= stored for engine in ENGINES.values())
    assert vllm.supports("NVFP4_UNKNOWN", "cuda") is None


def _summary(name: str, served_as: str | None, baseline: bool = False) -> VariantSummary:
    tags = {SERVING_TAG + "engine": "vllm"} | ({SERVING_TAG + "served_as": served_as} if served_as else {})
    return VariantSummary(name, name, True, {"cost/weight_bytes": 2.0 if baseline else 1.0}, tags, is_baseline=baseline)


def test_served_as_is_shown_in_the_report_table_and_by_pick():
    variants = [_summary("bf16", None, baseline=True), _summary("nvfp4", "NVFP4A16 (weight-only) below Blackwell")]
    rows = {row[0]: row for row in variants_table(variants, compute_frontiers(variants)).rows}
    assert rows["nvfp4"][1] == "nvfp4 (served as NVFP4A16 (weight-only) below Blackwell)"
    assert rows["bf16 (baseline)"][1] == "bf16"
    decision = pick(variants, "bf16", Policy(max_drop_any_task=None), Axis.of("cost/weight_bytes"))
    assert decision.warnings == (
        "nvfp4: served as NVFP4A16 (weight-only) below Blackwell by vllm on this hardware; its serving figures "
        "describe that format, not nvfp4 as stored",
    )
    # In the report, under a heading of its own: not a speed measured under contention.
    report = render_markdown(variants, compute_frontiers(variants), decision)
    assert "Served as another format" in report and "under contention" not in report


AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"}
AMX = AVX512 | {"amx_tile", "amx_bf16"}


@pytest.mark.parametrize(
    ("cpu", "flags", "refused"),
    [
        ("Sapphire Rapids", AMX, []),
        (
            "EPYC with AVX-512",
            AVX512,
            ["variant blocks: vLLM cannot serve FP8_BLOCK checkpoints on cpu: its kernels need CPU features this CPU "
             "lacks (amx_tile)"],
        ),
        (
            "EPYC with AVX2 alone",
            AVX2,
            ["variant awq: vLLM cannot serve W4A16 checkpoints on cpu: its kernels need CPU features this CPU lacks "
             "(avx512f, avx512bw, avx512dq, avx512vl)",
             "variant blocks: vLLM cannot serve FP8_BLOCK checkpoints on cpu: its kernels need CPU features this CPU "
             "lacks (amx_tile)"],
        ),
    ],
)  # fmt: skip
def test_validate_refuses_what_vllm_has_no_kernel_for_on_this_cpu(
    tmp_path, tiny_llama, monkeypatch, cpu, flags, refused
):
    """The other kinds of CPU are ones this machine cannot become: their flags are set here (a fake, for that alone).
    vLLM 0.32's CPU FP8 block kernels need AMX tiles; on an AMD EPYC its engine failed at start-up ("Failed to find
    a kernel that can implement the ScaledMM linear layer ... requires AMX tile support"). Its W4A16 kernel is in its
    AVX-512 library alone: on an EPYC with AVX2 alone a W4A16 server died at its first request ("'_C' object has no
    attribute 'cpu_gemm_wna16'")."""
    from quantlab.serving.engines import base

    monkeypatch.setattr(base, "host_cpu_flags", lambda: flags)
    serving = {"engine": "vllm", "python": sys.executable}
    variants = [
        {"name": "bf16", "method": "bf16"},
        {"name": "fp8", "method": "fp8"},
        {"name": "int8", "method": "int8"},
        {"name": "awq", "method": "awq_int4", "params": {"group_size": 32}},
        {"name": "blocks", "method": "fp8_block"},
    ]
    recipe = tiny_recipe(tiny_llama, variants=variants)
    problems = serving_problems(Recipe.model_validate(recipe | {"serving": serving}), tmp_path, "r.yaml", tmp_path)
    assert [problem.message for problem in problems if problem.field == "serving.engine"] == refused


@pytest.mark.parametrize(
    ("flags", "refused"),
    [
        (AVX512, []),
        (AVX2, ["vLLM's fp8 KV cache on CPU needs AVX-512 or AMX; this CPU lacks avx512f, avx512bw, avx512dq, avx512vl"]),
    ],
)  # fmt: skip
def test_validate_refuses_an_fp8_kv_cache_vllm_cannot_store_on_this_cpu(
    tmp_path, tiny_llama, monkeypatch, flags, refused
):
    """vLLM 0.32's CPU attention stores an FP8 KV cache with AVX-512 or AMX alone: on an EPYC with AVX2 its engine
    failed at start-up ("FP8 KV cache on CPU requires x86 with AVX-512 or AMX"). The other CPU is faked (its flags)."""
    from quantlab.serving.engines import base

    monkeypatch.setattr(base, "host_cpu_flags", lambda: flags)
    variants = [{"name": "bf16", "method": "bf16"}, {"name": "fp8", "method": "fp8", "kv_cache": "fp8"}]
    recipe = tiny_recipe(tiny_llama, variants=variants) | {"serving": {"engine": "vllm", "python": sys.executable}}
    problems = serving_problems(Recipe.model_validate(recipe), tmp_path, "r.yaml", tmp_path)
    assert [p.message for p in problems if p.field == "variants[1] (fp8).kv_cache"] == refused


def test_vllm_serves_fp8_blocks_on_this_cpu_with_the_kernel_declared(tmp_path, vllm_python):  # noqa: F811
    """The preset's 128x128 blocks need widths that 128 divides, the fused q/k/v outputs too: the tiny Llama with
    head size 32 and as many KV heads as heads (128 wide everywhere). vLLM 0.32's CPU build chooses an AMX kernel:
    CPUFp8W8A8BlockScaledMMKernel with AMX-FP8, else the weight-only CPUFp8BlockScaledMMKernel (about 25 s here).
    Without AMX tiles it has none (the engine fails at start-up): validate refuses it, the test above."""
    if "amx_tile" not in host_cpu_flags():
        pytest.skip("this CPU has no AMX tiles: vLLM has no FP8 block kernel for it, and quantlab refuses it")
    model = save_tiny_llama(tmp_path / "model", **(SHARP | {"num_key_value_heads": 4}))
    source = resolve_source(ModelSpec(source=str(model)), Path.cwd())
    checkpoint = quantize_variant(source, _variant(name="b", method="fp8_block"), None, Path.cwd(), tmp_path, "cpu")
    vllm = ENGINES["vllm"]
    served = launch(checkpoint.path, dtype="bfloat16", max_model_len=256)
    environment = {**os.environ, **vllm.environment(served), "HF_HUB_OFFLINE": "1"}
    log = tmp_path / "server.log"

    def command_for(port: int) -> list[str]:
        return vllm.command(vllm_python, launch(checkpoint.path, port, dtype="bfloat16", max_model_len=256))

    with running_server(command_for, "vllm", log, environment, 300) as server:
        body = json.dumps({"model": str(checkpoint.path), "prompt": "The quick brown fox", "max_tokens": 4}).encode()
        request = urllib.request.Request(server.url + "/v1/completions", body, {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
    assert answer["choices"][0]["finish_reason"] == "length"
    (kernel,) = kernels_in_log(log.read_text()).values()
    declared = vllm.supports("FP8_BLOCK", "cpu")
    assert kernel in {"CPUFp8W8A8BlockScaledMMKernel", "CPUFp8BlockScaledMMKernel"} and kernel in declared.kernel
    if kernel == "CPUFp8BlockScaledMMKernel":  # weight-only: what the declaration's label says
        assert "weight-only" in declared.served_as


@pytest.mark.parametrize(
    ("method", "as_quantlab_loads_it"), [("mxfp8", True), ("nvfp4", True), ("mxfp4", True), ("fp8", False)]
)
def test_transformers_serves_mx_and_nvfp4_checkpoints_on_cpu_as_quantlab_loads_them(
    formats, tmp_path, method, as_quantlab_loads_it
):
    """compressed-tensors decompresses MX and NVFP4 weights to BF16: at float32 the server failed every request
    ("expected m1 and m2 to have the same dtype") until it loaded them as quantlab does (decompressed once, upcast).
    The server answers, and its log says how it loaded the checkpoint; FP8 keeps the server's own (faster) loading."""
    made, _ = formats
    transformers = ENGINES["transformers"]
    served = launch(made[method])
    environment = {**os.environ, **transformers.environment(served), "HF_HUB_OFFLINE": "1"}
    log = tmp_path / "server.log"

    def command_for(port: int) -> list[str]:
        return transformers.command(Path(sys.executable), launch(made[method], port))

    with running_server(command_for, "transformers", log, environment, 120) as server:
        fields = {key: value for key, value in transformers.request_body(4).items() if value is not None}
        body = {"model": str(made[method]), "prompt": PROMPT} | fields  # None: a field guidellm must not send
        request = urllib.request.Request(
            server.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
    assert answer["usage"]["completion_tokens"] == 4, answer
    assert (
        f"quantlab: {made[method]} decompressed at load to torch.float32" in log.read_text()
    ) is as_quantlab_loads_it
    assert INSTALLED_NOTICE in log.read_text()  # the server rounds activations as quantlab's scoring does


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("method", ["fp8", "fp8_block", "mxfp8", "w4a8_fp8", "nvfp4"])
def test_fake_quantization_on_cpu_gives_compressed_tensors_own_logits(formats, monkeypatch, method, dtype):
    """`load_checkpoint` on a CPU runs the activations' fake quantization through quantlab.fake_quant: the whole
    model's logits are bit for bit those of compressed-tensors' own functions; per-token FP8 inputs (FP8_DYNAMIC,
    W4A8) went through quantlab's per-token FP8, other FP8 ones through its FP8 rounding, and a dynamic input shared
    by q/k/v and gate/up was rounded once (NVFP4's have a global scale each: rounded per layer, as before)."""
    from compressed_tensors.quantization.lifecycle import forward, forward_helpers

    from quantlab import fake_quant

    made, _ = formats
    model, tokenizer = load_checkpoint(made[method], dtype, "cpu")
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    ours = {"round": forward_helpers.round_to_quantized_type_args, "forward": forward.forward_quantize}
    theirs = {name: function.original for name, function in ours.items()}
    fp8_roundings = []
    fast = fake_quant.round_to_fp8_e4m3
    monkeypatch.setattr(fake_quant, "round_to_fp8_e4m3", lambda values: fp8_roundings.append(1) or fast(values))
    computed = count_roundings(monkeypatch)
    logits, counted = {}, {}
    for way, functions in (("ours", ours), ("theirs", theirs)):
        monkeypatch.setattr(forward_helpers, "round_to_quantized_type_args", functions["round"])
        monkeypatch.setattr(forward, "forward_quantize", functions["forward"])
        with torch.no_grad():  # as lm-eval and generate() run: inference-mode tensors are never reused
            logits[way] = model(ids).logits
        counted[way] = (len(fp8_roundings), computed["quantlab"], computed["compressed-tensors"])
        fp8_roundings.clear()
        computed.update(dict.fromkeys(computed, 0))
    assert torch.equal(logits["ours"], logits["theirs"])
    (our_fp8, our_per_token, our_others), (their_fp8, their_per_token, their_roundings) = counted.values()
    assert their_fp8 == their_per_token == 0, counted
    assert (our_fp8 > 0) is (method != "nvfp4"), counted
    assert (our_per_token > 0) is (method in ("fp8", "w4a8_fp8")), counted
    if method == "nvfp4":
        assert our_others == their_roundings > 0, counted
    else:  # 7 quantized layers per block, 3 distinct inputs reused: q/k/v take one, gate/up another
        assert our_per_token + our_others == their_roundings * 4 // 7 > 0, counted
