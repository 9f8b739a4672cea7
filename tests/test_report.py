"""Rendering: a valid PNG, an HTML page that needs no network, a Markdown report that reads."""

from __future__ import annotations

import json
import re

import pytest

from quantlab.decision import Constraints, pick
from quantlab.frontier import Axis, VariantSummary, compute_frontiers
from quantlab.report import frontier_table, render_html, render_markdown, render_png

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SETUP = {
    "quantlab.cost.engine": "transformers",
    "quantlab.cost.kernel_path": "decompressed-bf16",
    "quantlab.cost.hardware": "cpu-2-cores",
}


def sweep() -> list[VariantSummary]:
    def metrics(acc: float, cloze: float, kld: float, top1: float, size: float, speed: float) -> dict[str, float]:
        return {
            "eval/mmlu_dev/acc": acc, "eval/mmlu_dev/acc_stderr": 0.055,
            "eval/cloze/acc": cloze, "eval/cloze/acc_stderr": 0.02,
            "quality/kld_mean": kld, "quality/top1_agreement": top1, "quality/ppl": 11.5 + kld * 10,
            "cost/weight_bytes": size, "cost/decode_tokens_per_s": speed, "cost/peak_memory_bytes": size * 4,
        }

    return [
        VariantSummary("bf16", "bf16", True, metrics(0.24, 0.61, 0.0, 1.0, 270e6, 41.0), SETUP, is_baseline=True),
        VariantSummary("fp8-dynamic", "fp8", True, metrics(0.233, 0.60, 0.03, 0.905, 170e6, 38.0),
                       {**SETUP, "quantlab.cost.kernel_path": "fp8-matmul"}),
        VariantSummary("awq-int4-g64", "awq_int4", True, metrics(0.25, 0.52, 0.18, 0.79, 110e6, 35.0), SETUP),
        VariantSummary("gptq-int4", "gptq", False, {}),
    ]


@pytest.fixture
def variants() -> list[VariantSummary]:
    return sweep()


@pytest.fixture
def results(variants):
    return compute_frontiers(variants)


@pytest.fixture
def decision(variants):
    return pick(variants, "bf16", Constraints(max_drop_points_any_task=1.0), Axis.of("cost/weight_bytes"))


# --------------------------------------------------------------------------------------
# PNG
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("pair_count", [0, 1, 3, 6])
def test_render_png_writes_a_png(tmp_path, results, pair_count):
    path = render_png(results[:pair_count], tmp_path / "frontier.png", title="sweep")

    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 5_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 600 and height >= 400


# --------------------------------------------------------------------------------------
# HTML
# --------------------------------------------------------------------------------------


def test_render_html_is_self_contained_and_names_every_variant(tmp_path, variants, results):
    page = render_html(results, tmp_path / "frontier.html", variants=variants).read_text(encoding="utf-8")

    assert "http" not in page  # no CDN, no external link, no XML namespace URL either
    assert not re.search(r"""\b(src|href)\s*=""", page)
    assert "<svg" in page and "<script>" in page
    for variant in variants:
        assert variant.name in page


def test_render_html_hover_data_holds_each_variants_figures(tmp_path, variants, results):
    page = render_html(results, tmp_path / "frontier.html", variants=variants).read_text(encoding="utf-8")

    embedded = re.search(r'<script type="application/json" id="quantlab-data">(.*?)</script>', page, re.S)
    figures = json.loads(embedded.group(1))["figures"]
    assert set(figures) == {variant.name for variant in variants}
    assert ["weight size", "170.0 MB"] in figures["fp8-dynamic"]
    # The same figures are in each point's <title>, for viewers that block scripts.
    assert page.count('<g class="pt') == sum(len(result.points) for result in results)


def test_render_html_escapes_names(tmp_path):
    hostile = VariantSummary('<script>alert("x")</script>', "m", True,
                             {"eval/mmlu_dev/acc": 0.5, "cost/weight_bytes": 1e6}, is_baseline=True)

    page = render_html(compute_frontiers([hostile]), tmp_path / "f.html", variants=[hostile]).read_text()

    assert '<script>alert("x")' not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)" in page


def test_render_html_without_any_frontier(tmp_path):
    page = render_html([], tmp_path / "f.html").read_text()

    assert "No frontier" in page and "http" not in page


# --------------------------------------------------------------------------------------
# Markdown and terminal table
# --------------------------------------------------------------------------------------


def test_markdown_report_covers_variants_frontier_recommendation_and_caveats(variants, results, decision):
    note = "The BF16 baseline is the dequantized Q4_1 GGUF model."

    report = render_markdown(variants, results, decision, [note])

    for variant in variants:
        assert variant.name in report
    for heading in ("## What was compared", "## Variants", "## Frontier", "## Recommendation", "## Caveats"):
        assert heading in report
    assert "**Recommendation: ship `fp8-dynamic`.**" in report
    assert "eval/cloze/acc dropped 9.00 pts, over the 1 pts limit" in report  # why awq was rejected
    assert "270.0 MB" in report and "41.0 tok/s" in report and "90.5%" in report  # human units
    assert "within noise" in report
    assert "kernel path fp8-matmul" in report  # the speed figures' provenance differs
    assert "Failed variants" in report and "gptq-int4" in report
    assert note in report


def test_markdown_without_decision_or_without_winner(variants, results):
    assert "No recommendation was computed" in render_markdown(variants, results, None)

    impossible = pick(variants, "bf16", Constraints(max_peak_memory_bytes=1.0), Axis.of("cost/weight_bytes"))
    assert "**No variant satisfies the policy**" in render_markdown(variants, results, impossible)


def test_markdown_says_when_no_setup_was_recorded(results):
    bare = [VariantSummary("a", "bf16", True, {"eval/mmlu_dev/acc": 0.5, "cost/weight_bytes": 1e6}, is_baseline=True)]

    report = render_markdown(bare, compute_frontiers(bare), None)

    assert "No variant recorded which engine" in report


def test_frontier_table_rows_as_data(variants, results):
    table = frontier_table(variants, results)

    assert table.headers[:2] == ("variant", "method")
    assert table.headers[-1] == "on frontier"
    assert [row[0] for row in table.rows] == ["bf16 (baseline)", "fp8-dynamic", "awq-int4-g64", "gptq-int4"]
    assert all(len(row) == len(table.headers) for row in table.rows)
    assert table.rows[-1][-1] == "failed"
    lines = table.to_text().splitlines()
    assert len(lines) == 2 + len(variants)
    assert lines[0].startswith("variant")
