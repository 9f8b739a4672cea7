"""The recipe's `measure` section: defaults, field errors for absurd values, the accelerator table."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from quantlab.measure.settings import BUILTIN_ACCELERATORS, MeasureSettings, accelerator_table, find_accelerator


def error_locations(**settings) -> list[tuple]:
    with pytest.raises(ValidationError) as caught:
        MeasureSettings.model_validate(settings)
    return [error["loc"] for error in caught.value.errors()]


def test_defaults_are_small_and_valid():
    settings = MeasureSettings()
    assert settings.batch_sizes == [1]
    assert (settings.prompt_tokens, settings.output_tokens, settings.warmup, settings.repeats) == (128, 32, 1, 3)
    assert settings.enabled
    assert settings.target_accelerator()[0] == "H100-SXM"


@pytest.mark.parametrize(
    ("settings", "location"),
    [
        ({"batch_sizes": [0]}, ("batch_sizes", 0)),
        ({"batch_sizes": [1, -4]}, ("batch_sizes", 1)),
        ({"batch_sizes": []}, ("batch_sizes",)),
        ({"batch_sizes": [2, 2]}, ("batch_sizes",)),
        ({"prompt_tokens": 0}, ("prompt_tokens",)),
        ({"output_tokens": 1}, ("output_tokens",)),
        ({"repeats": 0}, ("repeats",)),
        ({"warmup": -1}, ("warmup",)),
        ({"cpu_threads": 0}, ("cpu_threads",)),
        ({"bandwidth_probe_bytes": 0}, ("bandwidth_probe_bytes",)),
        ({"target": {"price_per_hour": -2}}, ("target", "price_per_hour")),
        ({"target": {"context_length": 0}}, ("target", "context_length")),
        ({"target": {"memory_utilization": 1.5}}, ("target", "memory_utilization")),
        ({"target": {"bandwidth_bytes_per_s": 0}}, ("target", "bandwidth_bytes_per_s")),
        (
            {"accelerators": {"mine": {"memory_bytes": -1, "bandwidth_bytes_per_s": 1e12}}},
            ("accelerators", "mine", "memory_bytes"),
        ),
        ({"repeat": 3}, ("repeat",)),
        ({"target": {"gpu": "H100"}}, ("target", "gpu")),
    ],
)
def test_absurd_values_and_unknown_keys_are_field_errors(settings, location):
    assert location in error_locations(**settings)


def test_an_unknown_accelerator_is_named_with_a_suggestion():
    with pytest.raises(ValidationError) as caught:
        MeasureSettings(target={"accelerator": "H100-SMX"})
    (error,) = caught.value.errors()
    assert error["loc"] == ("target",)
    assert "unknown accelerator 'H100-SMX'" in error["msg"]
    assert "did you mean 'H100-SXM'" in error["msg"]


def test_a_recipe_adds_and_overrides_accelerators():
    settings = MeasureSettings(
        accelerators={
            "my-npu": {"memory_bytes": 32_000_000_000, "bandwidth_bytes_per_s": 1.2e12, "source": "vendor sheet"},
            "h100 sxm": {"memory_bytes": 85_520_809_984, "bandwidth_bytes_per_s": 3.35e12, "source": "nvidia-smi"},
        },
        target={"accelerator": "MY-NPU"},
    )
    assert settings.target_accelerator() == ("my-npu", settings.accelerators["my-npu"])
    table = accelerator_table(settings.accelerators)
    assert "H100-SXM" not in table and table["h100 sxm"].source == "nvidia-smi"


def test_target_overrides_memory_and_bandwidth_and_says_so():
    settings = MeasureSettings(target={"accelerator": "L4", "memory_bytes": 20_000_000_000})
    name, spec = settings.target_accelerator()
    assert (name, spec.memory_bytes, spec.bandwidth_bytes_per_s) == ("L4", 20_000_000_000, 300e9)
    assert "overridden" in spec.source


@pytest.mark.parametrize(
    "name", ["H100-SXM", "H100-PCIe", "H200", "A100-80GB", "A100-40GB", "L40S", "L4", "A10G", "RTX-4090", "MI300X"]
)
def test_the_builtin_table_has_the_common_accelerators_with_sources(name):
    found, spec = find_accelerator(name)
    assert found == name
    assert spec.memory_bytes > 10**10 and spec.bandwidth_bytes_per_s > 10**11
    assert spec.source


def test_builtin_figures_match_their_datasheets():
    assert BUILTIN_ACCELERATORS["H100-SXM"].bandwidth_bytes_per_s == 3.35e12
    assert BUILTIN_ACCELERATORS["H200"].memory_bytes == 141_000_000_000
    assert BUILTIN_ACCELERATORS["A100-40GB"].bandwidth_bytes_per_s == pytest.approx(1.555e12)
    assert BUILTIN_ACCELERATORS["MI300X"].memory_bytes == 192_000_000_000
