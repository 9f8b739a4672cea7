"""Damage by generated position and by context length in the report (issue 47 item 4): the series and the table read
from logged figures (pure, on tables), the chart drawn only where a sweep measured them, and the published artifacts
and report naming it."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from quantlab.frontier import FrontierSettings, VariantSummary, no_noise
from quantlab.metrics import paired_key
from quantlab.publish import SweepView, render_artifacts
from quantlab.report import DAMAGE_CHART, DamageSeries, context_table, damage_series, render_damage_chart


def _figure(key: str, value: float, half_width: float | None) -> dict[str, float]:
    """A logged KL-like figure whose baseline value is 0 (diff = value), with its paired interval if given."""
    found = {key: value}
    if half_width is not None:
        found |= {paired_key(key, "diff"): value, paired_key(key, "ci95_low"): value - half_width}
        found |= {paired_key(key, "ci95_high"): value + half_width}
    return found


def _variant(name: str, figures: dict[str, tuple[float, float | None]], **flags) -> VariantSummary:
    metrics: dict[str, float] = {}
    for key, (value, half_width) in figures.items():
        metrics |= _figure(key, value, half_width)
    return VariantSummary(name, name, flags.pop("succeeded", True), metrics, **flags)


BASELINE = _variant("bf16", {"quality/on_policy/gen1-32/kld_mean": (0.0, 0.0)}, is_baseline=True)
FP8 = _variant(
    "fp8",
    {  # logged in no particular order, with the prompt and all-generated parts beside the buckets
        "quality/on_policy/gen33-128/kld_mean": (0.03, 0.01),
        "quality/on_policy/prompt/kld_mean": (0.01, 0.002),
        "quality/on_policy/gen1-32/kld_mean": (0.02, 0.005),
        "quality/on_policy/generated/kld_mean": (0.025, 0.004),
        "quality/kld_mean/ctx4096": (0.05, None),  # no paired interval logged: drawn without one
        "quality/kld_mean/ctx256": (0.02, 0.003),
        "quality/top1_agreement/ctx256": (0.9, None),
    },
)
INT4 = _variant("int4", {"quality/kld_mean/ctx1024": (0.2, 0.02)})
FAILED = _variant("broken", {"quality/kld_mean/ctx256": (9.0, 1.0)}, succeeded=False)


@pytest.mark.parametrize(
    ("variants", "by_position", "by_context"),
    [
        ([BASELINE], [], []),
        (
            [BASELINE, FP8, INT4, FAILED],
            [DamageSeries("fp8", ("1-32", "33-128"), (0.02, 0.03), ((0.015, 0.025), (0.02, 0.04)))],
            [
                DamageSeries("fp8", ("256", "4096"), (0.02, 0.05), ((0.017, 0.023), None)),
                DamageSeries("int4", ("1024",), (0.2,), ((0.18, 0.22),)),
            ],
        ),
    ],
)
def test_damage_series_read_each_quantized_variants_buckets_in_order(variants, by_position, by_context):
    found_position, found_context = damage_series(variants)
    for found, expected in ((found_position, by_position), (found_context, by_context)):
        assert [(s.variant, s.labels, s.intervals is not None) for s in found] == [
            (s.variant, s.labels, True) for s in expected
        ]
        for got, want in zip(found, expected):
            assert got.values == pytest.approx(want.values)
            for got_interval, want_interval in zip(got.intervals, want.intervals):
                assert (got_interval is None) == (want_interval is None)
                if want_interval is not None:
                    assert got_interval == pytest.approx(want_interval)


def test_the_context_table_has_a_row_per_length_with_its_paired_interval():
    table = context_table([BASELINE, FP8, INT4, FAILED])
    assert table.headers[:2] == ("variant", "tokens of context")
    assert [row[:2] for row in table.rows] == [("fp8", "up to 256"), ("", "up to 4096"), ("int4", "up to 1024")]
    kld = table.headers.index("mean KL divergence")
    assert "[0.017" in table.rows[0][kld] and "0.023" in table.rows[0][kld]
    assert "[" not in table.rows[1][kld]  # no interval logged, none shown
    assert context_table([BASELINE]) is None


def _png_width(path: Path) -> int:
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG")
    return struct.unpack(">I", data[16:20])[0]


def test_the_chart_has_a_panel_per_axis_measured_and_none_without_data(tmp_path):
    assert render_damage_chart([BASELINE], tmp_path / "none.png", "tiny") is None
    assert not (tmp_path / "none.png").exists()
    both = render_damage_chart([BASELINE, FP8, INT4], tmp_path / "both.png", "tiny")
    one = render_damage_chart([BASELINE, INT4], tmp_path / "one.png", "tiny")
    assert _png_width(both) == 2 * _png_width(one)  # two panels side by side, one where only contexts were measured


def _view(variants: list[VariantSummary]) -> SweepView:
    return SweepView("parent", "tiny", variants, FrontierSettings(), "bf16", (), "tiny-llama", no_noise)


def test_published_artifacts_and_report_carry_the_chart_only_where_measured(tmp_path):
    baseline = VariantSummary("bf16", "bf16", True, {"cost/weight_bytes": 2e6}, is_baseline=True)
    measured = _variant("fp8", {"quality/kld_mean/ctx256": (0.02, 0.003)})
    measured.metrics["cost/weight_bytes"] = 1e6
    written = render_artifacts(_view([baseline, measured]), tmp_path / "with")
    assert tmp_path / "with" / DAMAGE_CHART in written
    report = (tmp_path / "with" / "report.md").read_text()
    assert "## By context length" in report and f"`{DAMAGE_CHART}`" in report
    assert "damage chart" in (tmp_path / "with" / "frontier.html").read_text()

    plain = VariantSummary("fp8", "fp8", True, {"cost/weight_bytes": 1e6})
    written = render_artifacts(_view([baseline, plain]), tmp_path / "without")
    assert not any(path.name == DAMAGE_CHART for path in written)
    report = (tmp_path / "without" / "report.md").read_text()
    assert "## By context length" not in report and DAMAGE_CHART not in report
