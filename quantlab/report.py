"""Render a sweep's frontiers and decision for people: PNG, offline HTML, Markdown, terminal rows.

Everything here reads the pure results of `quantlab.frontier` and `quantlab.decision`; no
numbers are computed that those modules do not already define. Writing files is the only
side effect, and only the `render_png` / `render_html` functions do it.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from string import Template

from quantlab.decision import Decision, Status
from quantlab.frontier import (
    FrontierPoint,
    FrontierResult,
    QualityDelta,
    Unit,
    VariantSummary,
    find_baseline,
    format_difference,
    format_metric,
    is_eval_quality_metric,
    metric_info,
    quality_delta,
    quality_deltas,
)

KEY_DAMAGE_METRICS: tuple[str, ...] = ("quality/kld_mean", "quality/top1_agreement", "quality/ppl")
KEY_COST_METRICS: tuple[str, ...] = (
    "cost/weight_bytes",
    "cost/decode_tokens_per_s",
    "cost/peak_memory_bytes",
)
SETUP_TAGS: tuple[tuple[str, str], ...] = (
    ("quantlab.cost.engine", "engine"),
    ("quantlab.cost.kernel_path", "kernel path"),
    ("quantlab.cost.hardware", "hardware"),
)
_UNRECORDED = "unrecorded"


# --------------------------------------------------------------------------------------
# Tables as data (the CLI renders them with rich; Markdown and HTML reuse them)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Table:
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    def to_text(self) -> str:
        """Plain aligned columns for a terminal without rich."""
        widths = [max(len(cell) for cell in column) for column in zip(self.headers, *self.rows)]
        lines = [self.headers, tuple("-" * width for width in widths), *self.rows]
        return "\n".join(
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
            for line in lines
        )

    def to_markdown(self) -> str:
        def line(cells: Iterable[str]) -> str:
            return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

        return "\n".join(
            [line(self.headers), line("---" for _ in self.headers), *map(line, self.rows)]
        )

    def to_html(self) -> str:
        head = "".join(f"<th>{html.escape(cell)}</th>" for cell in self.headers)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>"
            for row in self.rows
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def key_metrics(variants: Sequence[VariantSummary]) -> tuple[str, ...]:
    """The columns worth showing: every task score, then damage, then cost, when logged."""
    logged = {key for variant in variants for key in variant.metrics}
    task_scores = sorted(
        key for key in logged
        if is_eval_quality_metric(key) and metric_info(key).higher_is_better is not None
    )
    fixed = [key for key in (*KEY_DAMAGE_METRICS, *KEY_COST_METRICS) if key in logged]
    return (*task_scores, *fixed)


def _figure(variant: VariantSummary, metric: str, baseline: VariantSummary | None) -> str:
    """A value in human units; task scores also show their change against the baseline."""
    if not variant.succeeded:
        return "-"
    text = format_metric(metric, variant.value(metric))
    if baseline is None or variant.name == baseline.name or not is_eval_quality_metric(metric):
        return text
    delta = quality_delta(variant, baseline, metric) if baseline.succeeded else None
    if delta is None:
        return text
    change = format_difference(metric, delta.difference)
    return f"{text} ({change}, within noise)" if delta.within_noise else f"{text} ({change})"


def _frontier_status(variant: VariantSummary, results: Sequence[FrontierResult]) -> str:
    if not variant.succeeded:
        return "failed"
    placed = [result for result in results if result.point(variant.name) is not None]
    if not placed:
        return "not plotted"
    on_front = sum(variant.name in result.on_front for result in placed)
    return f"yes ({on_front} of {len(results)} plots)" if on_front else "no"


def frontier_table(
    variants: Sequence[VariantSummary],
    frontier_results: Sequence[FrontierResult],
) -> Table:
    """One row per variant, baseline first: key figures and whether it is on a frontier."""
    metrics = key_metrics(variants)
    headers = ("variant", "method", *(metric_info(m).label for m in metrics), "on frontier")
    rows = tuple(row for _, row in _variant_rows(variants, frontier_results, metrics))
    return Table(headers, rows)


def _variant_rows(
    variants: Sequence[VariantSummary],
    frontier_results: Sequence[FrontierResult],
    metrics: Sequence[str],
) -> list[tuple[VariantSummary, tuple[str, ...]]]:
    baseline = find_baseline(variants)
    ordered = sorted(variants, key=lambda variant: not variant.is_baseline)
    return [
        (
            variant,
            (
                variant.name + (" (baseline)" if variant.is_baseline else ""),
                variant.method,
                *(_figure(variant, metric, baseline) for metric in metrics),
                _frontier_status(variant, frontier_results),
            ),
        )
        for variant in ordered
    ]


# --------------------------------------------------------------------------------------
# PNG
# --------------------------------------------------------------------------------------

_FRONT_COLOR = "#1f77b4"
_DOMINATED_COLOR = "#9e9e9e"
_BASELINE_COLOR = "#d62728"


def render_png(
    frontier_results: Sequence[FrontierResult],
    path: str | Path,
    *,
    title: str | None = None,
) -> Path:
    """One subplot per axis pair: the front joined by a line, labels, the baseline starred."""
    # The object-oriented API with the Agg canvas leaves pyplot's global backend untouched.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    columns = 1 if len(frontier_results) <= 1 else 2
    rows = max(1, math.ceil(len(frontier_results) / columns))
    figure = Figure(figsize=(6.4 * columns, 4.8 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    grid = figure.subplots(rows, columns, squeeze=False)
    axes_list = [axes for row in grid for axes in row]
    for axes, result in zip(axes_list, frontier_results):
        _draw_pair(axes, result)
    for axes in axes_list[len(frontier_results):]:
        axes.set_axis_off()
    if not frontier_results:
        axes_list[0].text(0.5, 0.5, "no frontier: no variant logged both a quality and a cost metric",
                          ha="center", va="center", wrap=True, transform=axes_list[0].transAxes)
    if title:
        figure.suptitle(title)
    target = Path(path)
    figure.savefig(target, format="png", dpi=110)
    return target


def _draw_pair(axes, result: FrontierResult) -> None:  # noqa: ANN001 - matplotlib Axes
    from matplotlib.ticker import MaxNLocator

    pair = result.pair
    front = [point for point in result.points if point.on_front]
    dominated = [point for point in result.points if not point.on_front]
    if dominated:
        axes.scatter([p.cost for p in dominated], [p.quality for p in dominated],
                     color=_DOMINATED_COLOR, label="dominated", zorder=2)
    if front:
        axes.plot([p.cost for p in front], [p.quality for p in front], "-o",
                  color=_FRONT_COLOR, label="frontier", zorder=3)
    for point in result.points:
        if point.is_baseline:
            axes.scatter([point.cost], [point.quality], marker="*", s=260, color=_BASELINE_COLOR,
                         label="baseline", zorder=4)
        axes.annotate(point.name, (point.cost, point.quality), xytext=(6, 6),
                      textcoords="offset points", fontsize=8)
    for axis, metric in ((axes.xaxis, pair.cost.metric), (axes.yaxis, pair.quality.metric)):
        axis.set_major_locator(MaxNLocator(nbins=5))
        axis.set_major_formatter(_tick_formatter(metric))
    axes.set_title(pair.title, fontsize=10)
    xlabel = pair.cost.label
    if result.excluded:
        xlabel += "\nnot plotted: " + ", ".join(f"{e.name} ({e.reason})" for e in result.excluded)
    axes.set_xlabel(xlabel, fontsize=9)
    axes.set_ylabel(pair.quality.label, fontsize=9)
    axes.grid(True, alpha=0.3)
    axes.margins(0.15)
    if result.points:
        axes.legend(fontsize=8, loc="best")


def _tick_formatter(metric: str):  # noqa: ANN202 - a matplotlib Formatter
    """Tick labels in the metric's unit, with only as many decimals as the ticks need."""
    from matplotlib.ticker import EngFormatter, FuncFormatter, PercentFormatter

    unit = metric_info(metric).unit
    if unit is Unit.FRACTION:
        return PercentFormatter(xmax=1.0)
    if unit is Unit.BYTES:
        return EngFormatter(unit="B")
    suffix = {Unit.TOKENS_PER_S: " tok/s", Unit.MILLISECONDS: " ms"}.get(unit, "")
    return FuncFormatter(lambda value, _: f"{value:g}{suffix}")


# --------------------------------------------------------------------------------------
# Self-contained interactive HTML (inline SVG + a few lines of JS, nothing fetched)
# --------------------------------------------------------------------------------------

_WIDTH, _HEIGHT = 560, 380
_LEFT, _RIGHT, _TOP, _BOTTOM = 84, 24, 40, 78


def render_html(
    frontier_results: Sequence[FrontierResult],
    path: str | Path,
    *,
    variants: Sequence[VariantSummary] = (),
    title: str = "quantlab frontier",
) -> Path:
    """An HTML file that opens offline (MLflow's artifact viewer): hover a point for figures.

    Each point also carries an SVG <title>, so the figures show as a native tooltip even
    where a sandboxed viewer blocks scripts.
    """
    table = frontier_table(variants, frontier_results) if variants else None
    figures = _figures_by_variant(variants, frontier_results)
    plots = "\n".join(
        _svg_plot(result, figures) for result in frontier_results
    ) or "<p>No frontier: no variant logged both a quality and a cost metric.</p>"
    page = _PAGE.substitute(
        title=html.escape(title),
        plots=plots,
        table=table.to_html() if table else "",
        data=json.dumps({"figures": figures}).replace("</", "<\\/"),
    )
    target = Path(path)
    target.write_text(page, encoding="utf-8")
    return target


def _figures_by_variant(
    variants: Sequence[VariantSummary], frontier_results: Sequence[FrontierResult]
) -> dict[str, list[tuple[str, str]]]:
    """Each variant's table row as (column, figure) pairs, for its tooltip."""
    metrics = key_metrics(variants)
    headers = ("method", *(metric_info(m).label for m in metrics), "on frontier")
    return {
        variant.name: list(zip(headers, row[1:]))
        for variant, row in _variant_rows(variants, frontier_results, metrics)
    }


def _svg_plot(result: FrontierResult, figures: dict[str, list[tuple[str, str]]]) -> str:
    pair = result.pair
    x_scale = _Scale.fit([p.cost for p in result.points], _LEFT, _WIDTH - _RIGHT)
    y_scale = _Scale.fit([p.quality for p in result.points], _HEIGHT - _BOTTOM, _TOP)
    parts = [
        f'<svg class="plot" viewBox="0 0 {_WIDTH} {_HEIGHT}" width="{_WIDTH}" height="{_HEIGHT}" '
        f'role="img" aria-label="{html.escape(pair.title)}">',
        f'<text class="title" x="{_WIDTH / 2}" y="20" text-anchor="middle">'
        f"{html.escape(pair.title)}</text>",
        f'<line class="axis" x1="{_LEFT}" y1="{_HEIGHT - _BOTTOM}" x2="{_WIDTH - _RIGHT}" '
        f'y2="{_HEIGHT - _BOTTOM}"/>',
        f'<line class="axis" x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{_HEIGHT - _BOTTOM}"/>',
    ]
    for tick in x_scale.ticks():
        x = x_scale(tick)
        parts.append(
            f'<line class="grid" x1="{x:.1f}" y1="{_TOP}" x2="{x:.1f}" y2="{_HEIGHT - _BOTTOM}"/>'
            f'<text class="tick" x="{x:.1f}" y="{_HEIGHT - _BOTTOM + 16}" text-anchor="middle">'
            f"{html.escape(format_metric(pair.cost.metric, tick))}</text>"
        )
    for tick in y_scale.ticks():
        y = y_scale(tick)
        parts.append(
            f'<line class="grid" x1="{_LEFT}" y1="{y:.1f}" x2="{_WIDTH - _RIGHT}" y2="{y:.1f}"/>'
            f'<text class="tick" x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
            f"{html.escape(format_metric(pair.quality.metric, tick))}</text>"
        )
    parts.append(
        f'<text class="label" x="{(_LEFT + _WIDTH - _RIGHT) / 2}" y="{_HEIGHT - _BOTTOM + 36}" '
        f'text-anchor="middle">{html.escape(pair.cost.label)}</text>'
        f'<text class="label" transform="translate(16 {(_TOP + _HEIGHT - _BOTTOM) / 2}) rotate(-90)" '
        f'text-anchor="middle">{html.escape(pair.quality.label)}</text>'
    )
    if result.excluded:
        note = "not plotted: " + ", ".join(f"{e.name} ({e.reason})" for e in result.excluded)
        parts.append(
            f'<text class="note" x="{_LEFT}" y="{_HEIGHT - 12}">{html.escape(note)}</text>'
        )
    front = [p for p in result.points if p.on_front]
    if len(front) > 1:
        coordinates = " ".join(f"{x_scale(p.cost):.1f},{y_scale(p.quality):.1f}" for p in front)
        parts.append(f'<polyline class="front" points="{coordinates}"/>')
    for point in result.points:
        parts.append(_svg_point(result, point, x_scale, y_scale, figures.get(point.name, [])))
    parts.append("</svg>")
    return "\n".join(parts)


def _svg_point(
    result: FrontierResult,
    point: FrontierPoint,
    x_scale: _Scale,
    y_scale: _Scale,
    figures: Sequence[tuple[str, str]],
) -> str:
    pair = result.pair
    placement = (
        f"{pair.quality.metric}: {format_metric(pair.quality.metric, point.quality)}; "
        f"{pair.cost.metric}: {format_metric(pair.cost.metric, point.cost)}; "
        + ("on the frontier" if point.on_front else "dominated by " + ", ".join(point.dominated_by))
    )
    tooltip = "\n".join([point.name, placement, *(f"{h}: {c}" for h, c in figures)])
    classes = " ".join(
        ["pt", "on-front" if point.on_front else "dominated", *(["baseline"] if point.is_baseline else [])]
    )
    x, y = x_scale(point.cost), y_scale(point.quality)
    radius = 8 if point.is_baseline else 6
    left_half = x < (_LEFT + _WIDTH - _RIGHT) / 2
    return (
        f'<g class="{classes}" tabindex="0" data-variant="{html.escape(point.name)}" '
        f'data-placement="{html.escape(placement)}">'
        f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{radius}"/>'
        f"<title>{html.escape(tooltip)}</title></g>"
        # Labels of points in the right half go to their left so they stay inside the plot.
        f'<text class="name" x="{x + 9 if left_half else x - 9:.1f}" y="{y - 8:.1f}" '
        f'text-anchor="{"start" if left_half else "end"}">{html.escape(point.name)}'
        f'{" (baseline)" if point.is_baseline else ""}</text>'
    )


@dataclass(frozen=True)
class _Scale:
    """A linear map from data values to SVG pixels, with a little padding around the data."""

    low: float
    high: float
    start: float
    end: float

    @classmethod
    def fit(cls, values: Sequence[float], start: float, end: float) -> _Scale:
        low, high = (min(values), max(values)) if values else (0.0, 1.0)
        padding = (high - low) * 0.1 if high > low else (abs(low) * 0.1 or 1.0)
        return cls(low - padding, high + padding, start, end)

    def __call__(self, value: float) -> float:
        return self.start + (value - self.low) / (self.high - self.low) * (self.end - self.start)

    def ticks(self, target_count: int = 5) -> list[float]:
        raw_step = (self.high - self.low) / target_count
        magnitude = 10 ** math.floor(math.log10(raw_step))
        step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw_step)
        first = math.ceil(self.low / step)
        return [k * step for k in range(first, math.floor(self.high / step) + 1)]


_PAGE = Template("""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>$title</title>
<style>
body { font-family: system-ui, sans-serif; margin: 16px; color: #222; }
.plots { display: flex; flex-wrap: wrap; gap: 12px; }
svg.plot { background: #fff; border: 1px solid #ddd; }
.axis { stroke: #444; }
.grid { stroke: #eee; }
.tick { font-size: 11px; fill: #555; }
.label { font-size: 12px; fill: #333; }
.title { font-size: 13px; font-weight: 600; }
.note { font-size: 11px; fill: #a33; }
.name { font-size: 11px; fill: #333; pointer-events: none; }
.front { fill: none; stroke: #1f77b4; stroke-width: 2; }
.pt circle { fill: #9e9e9e; stroke: #fff; stroke-width: 1.5; cursor: pointer; }
.pt.on-front circle { fill: #1f77b4; }
.pt.baseline circle { stroke: #d62728; stroke-width: 3; }
.pt.highlight circle { stroke: #ff9800; stroke-width: 4; }
#tip { position: fixed; display: none; background: #fffff4; border: 1px solid #999;
       padding: 6px 8px; font-size: 12px; max-width: 420px; pointer-events: none;
       box-shadow: 2px 2px 6px rgba(0,0,0,.2); }
#tip b { display: block; margin-bottom: 4px; }
table { border-collapse: collapse; margin-top: 16px; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; }
th { background: #f4f4f4; }
</style>
</head>
<body>
<h1>$title</h1>
<p>Hover (or focus) a point to see the variant's figures; the same variant lights up in every plot.
Blue points joined by a line are on the frontier: no other variant is at least as good on both
axes and better on one. Grey points are dominated. The ringed point is the baseline.</p>
<div class="plots">
$plots
</div>
$table
<div id="tip"></div>
<script type="application/json" id="quantlab-data">$data</script>
<script>
(function () {
  var figures = JSON.parse(document.getElementById("quantlab-data").textContent).figures;
  var tip = document.getElementById("tip");
  var points = Array.prototype.slice.call(document.querySelectorAll("g.pt"));
  function highlight(name, on) {
    points.forEach(function (g) {
      if (g.getAttribute("data-variant") === name) { g.classList.toggle("highlight", on); }
    });
  }
  function line(text) { var div = document.createElement("div"); div.textContent = text; return div; }
  function show(event) {
    var g = event.currentTarget, name = g.getAttribute("data-variant");
    tip.textContent = "";
    var heading = document.createElement("b"); heading.textContent = name; tip.appendChild(heading);
    tip.appendChild(line(g.getAttribute("data-placement")));
    (figures[name] || []).forEach(function (pair) { tip.appendChild(line(pair[0] + ": " + pair[1])); });
    tip.style.display = "block";
    highlight(name, true);
    move(event);
  }
  function move(event) {
    var box = event.currentTarget.getBoundingClientRect();
    var x = event.clientX || box.right, y = event.clientY || box.bottom;
    tip.style.left = Math.min(x + 14, window.innerWidth - tip.offsetWidth - 8) + "px";
    tip.style.top = Math.min(y + 14, window.innerHeight - tip.offsetHeight - 8) + "px";
  }
  function hide(event) {
    tip.style.display = "none";
    highlight(event.currentTarget.getAttribute("data-variant"), false);
  }
  points.forEach(function (g) {
    g.addEventListener("mouseenter", show);
    g.addEventListener("mousemove", move);
    g.addEventListener("mouseleave", hide);
    g.addEventListener("focus", show);
    g.addEventListener("blur", hide);
  });
})();
</script>
</body>
</html>
""")


# --------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------


def render_markdown(
    variants: Sequence[VariantSummary],
    frontier_results: Sequence[FrontierResult],
    decision: Decision | None,
    notes: Sequence[str] = (),
    *,
    title: str = "Which precision to ship",
) -> str:
    """A report for someone who has never seen quantlab: compared what, found what, ship what."""
    sections = [
        f"# {title}",
        # The answer first: a release manager may read no further.
        _recommendation_section(decision),
        _what_was_compared(variants),
        "## Variants\n\n" + frontier_table(variants, frontier_results).to_markdown()
        + "\n\n_pts_: percentage points against the baseline. _within noise_: the difference is "
        "smaller than its standard error, so it is not evidence of a change.",
        _frontier_section(frontier_results),
        _caveats_section(variants, frontier_results, notes),
        _GLOSSARY,
    ]
    return "\n\n".join(section.strip() for section in sections) + "\n"


def _what_was_compared(variants: Sequence[VariantSummary]) -> str:
    baseline = find_baseline(variants)
    listing = ", ".join(f"**{v.name}** ({v.method})" for v in variants) or "none"
    lines = [
        f"This report compares {len(variants)} variants of one model that differ in numeric "
        f"precision: {listing}."
    ]
    if baseline is not None:
        lines.append(
            f"The reference is **{baseline.name}**: every change in quality below is measured "
            "against it."
        )
    metrics = key_metrics(variants)
    tasks = [metric_info(m).label for m in metrics if is_eval_quality_metric(m)]
    damage = [metric_info(m).label for m in metrics if m in KEY_DAMAGE_METRICS]
    costs = [metric_info(m).label for m in metrics if m in KEY_COST_METRICS]
    if tasks:
        lines.append("Quality is scored on benchmark tasks (" + ", ".join(tasks) + ").")
    if damage:
        lines.append("Damage against the reference model: " + ", ".join(damage) + ".")
    if costs:
        lines.append("Cost: " + ", ".join(costs) + ".")
    return "## What was compared\n\n" + " ".join(lines)


def _frontier_section(results: Sequence[FrontierResult]) -> str:
    lines = [
        "## Frontier",
        "",
        "A variant is on the frontier of a plot when no other variant is at least as good on "
        "both quality and cost and strictly better on one. Dominated variants are never the "
        "best choice on that plot. Plots: `frontier.png`, interactive `frontier.html`.",
    ]
    if not results:
        lines += ["", "No frontier: no variant logged both a quality and a cost metric."]
    for result in results:
        lines += ["", f"### {result.pair.title}", ""]
        front = [
            f"{p.name} ({format_metric(result.pair.quality.metric, p.quality)}, "
            f"{format_metric(result.pair.cost.metric, p.cost)})"
            for p in result.points if p.on_front
        ]
        lines.append("- On the frontier: " + (", ".join(front) or "none"))
        for name, dominators in result.dominated.items():
            lines.append(f"- {name} is dominated by {', '.join(dominators)}")
        for exclusion in result.excluded:
            lines.append(f"- {exclusion.name} is not plotted: {exclusion.reason}")
    return "\n".join(lines)


_STATUS_WORDS = {
    Status.CHOSEN: "chosen",
    Status.COSTS_MORE: "meets the policy, costs more",
    Status.REJECTED: "rejected",
    Status.FAILED: "failed",
}


def _recommendation_section(decision: Decision | None) -> str:
    if decision is None:
        return "## Recommendation\n\nNo recommendation was computed for this sweep."
    direction = "highest" if decision.objective.higher_is_better else "lowest"
    policy = "\n".join(f"- {check}" for check in decision.checks) or "- (no constraints)"
    lines = [
        "## Recommendation",
        "",
        "Under the default policy, every variant must satisfy:",
        "",
        policy,
        "",
        f"and among those, the one with the {direction} "
        f"{metric_info(decision.objective.metric).label} (`{decision.objective.metric}`) wins.",
        "",
    ]
    if decision.chosen is None:
        lines.append("**No variant satisfies the policy**, so nothing is recommended.")
    else:
        chosen = decision.verdict(decision.chosen)
        lines.append(f"**Recommendation: ship `{decision.chosen}`.** {decision.summary}")
        if decision.chosen == decision.baseline:
            lines.append(
                "The reference itself is the recommendation: no other variant met the policy "
                "at a better cost."
            )
        evidence = [f"- {check.detail}" for check in chosen.checks]
        if evidence:
            lines += ["", "Why it qualifies:", "", *evidence]
    others = Table(
        ("variant", "verdict", "reasons"),
        tuple(
            (v.name, _STATUS_WORDS[v.status], "; ".join(v.reasons))
            for v in decision.verdicts if v.status is not Status.CHOSEN
        ),
    )
    if others.rows:
        lines += ["", "Why the others were not chosen:", "", others.to_markdown()]
    return "\n".join(lines)


def _caveats_section(
    variants: Sequence[VariantSummary],
    results: Sequence[FrontierResult],
    notes: Sequence[str],
) -> str:
    caveats = [
        *_setup_caveats(variants),
        *_noise_caveats(variants),
        *_missing_caveats(variants, results),
        *notes,
    ]
    body = "\n".join(f"- {caveat}" for caveat in caveats) if caveats else "- None."
    return "## Caveats\n\n" + body


def _setup_caveats(variants: Sequence[VariantSummary]) -> list[str]:
    """Speed and memory depend on engine, kernel path and hardware: say which produced which."""
    measured = [v for v in variants if v.succeeded]
    setups: dict[tuple[str, ...], list[str]] = {}
    for variant in measured:
        setup = tuple(variant.tags.get(tag, _UNRECORDED) for tag, _ in SETUP_TAGS)
        setups.setdefault(setup, []).append(variant.name)
    if not setups:
        return []
    if all(value == _UNRECORDED for setup in setups for value in setup):
        return ["No variant recorded which engine, kernel path or hardware measured its speed "
                "and memory; treat those figures as indicative only."]

    def describe(setup: tuple[str, ...]) -> str:
        return ", ".join(f"{word} {value}" for (_, word), value in zip(SETUP_TAGS, setup))

    if len(setups) == 1:
        (setup,) = setups
        return [f"All speed and memory figures were measured the same way: {describe(setup)}."]
    lines = ["Speed and memory figures were not all measured the same way; compare them with care:"]
    lines += [f"  - {', '.join(names)}: {describe(setup)}" for setup, names in setups.items()]
    return ["\n".join(lines)]


def _noise_caveats(variants: Sequence[VariantSummary]) -> list[str]:
    eval_metrics = [m for m in key_metrics(variants) if is_eval_quality_metric(m)]
    noisy: list[QualityDelta] = [d for d in quality_deltas(variants, eval_metrics) if d.within_noise]
    if not noisy:
        return []
    lines = ["These differences are smaller than their standard error (not evidence of a change):"]
    lines += [f"  - {d.variant}, {metric_info(d.metric).label}: {d.describe()}" for d in noisy]
    return ["\n".join(lines)]


def _missing_caveats(
    variants: Sequence[VariantSummary], results: Sequence[FrontierResult]
) -> list[str]:
    failed = [v.name for v in variants if not v.succeeded]
    lines = []
    if failed:
        lines.append(
            f"Failed variants, left out of every frontier and never recommended: {', '.join(failed)}."
        )
    absent: dict[tuple[str, str], list[str]] = {}
    for result in results:
        for exclusion in result.excluded:
            if exclusion.reason != "failed":
                absent.setdefault((exclusion.name, exclusion.reason), []).append(result.pair.title)
    missing = [
        f"{name} is {reason}, so it is absent from {len(plots)} plot(s): {', '.join(plots)}."
        for (name, reason), plots in absent.items()
    ]
    return lines + missing


_GLOSSARY = """## How to read this report

- **Percentage points (pts)**: the difference between two scores on a 0-100% scale; 48.0% vs
  50.0% is -2.0 pts.
- **Standard error / within noise**: benchmarks have a limited number of questions, so a score
  is an estimate. A difference smaller than the combined standard error of the two scores
  could be chance.
- **KL divergence**: how far a variant's next-token probabilities drift from the reference
  model's, averaged over a text; 0 means identical.
- **Top-1 agreement**: how often the variant's most likely next token is the reference's.
- **Frontier (Pareto front)**: the variants you cannot improve on in quality without paying
  more, or in cost without losing quality."""
