"""Lay out a sweep for people: a matplotlib figure per frontier (PNG and SVG), the HTML page and Markdown
report from the Jinja2 templates, the variants table as data. Every number comes from frontier and decision."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import jinja2

from quantlab.decision import Decision, Status, Verdict, confidence, cost_warnings, served_as_notes
from quantlab.engine_noise import engine_noise
from quantlab.frontier import (
    DAMAGE_METRICS,
    FrontierResult,
    Frontiers,
    VariantSummary,
    cost_rounds,
    describe_comparison,
    find_baseline,
    format_diff,
    logged_keys,
    merged_declared,
    quality_metrics,
)
from quantlab.metrics import (
    CONTENDED_LEVELS_TAG,
    WORKLOAD_PREFIX,
    Scale,
    Shown,
    paired_key,
    rests_on_contention,
    shown_in,
)
from quantlab.metrics import spec as metric_spec
from quantlab.policy import format_change, format_value
from quantlab.repeats import paired_ratio
from quantlab.serving.chart import throughput_latency_chart
from quantlab.serving.goodput import NOT_STOCK_TAG, SERVING_TAG, UNAVAILABLE_TAG, WORKLOADS_TAG
from quantlab.serving.intervals import Interval, ratio_interval
from quantlab.serving.levels import levels_from_metrics
from quantlab.serving.settings import Workload

KEY_COST_METRICS = shown_in(Shown.REPORT_COST)
# The serving section of the report: each variant's figures under load, beside what they were measured on.
SERVING_FIGURES = shown_in(Shown.SERVING_TABLE)
SERVING_CHART = "serving.png"
DAMAGE_CHART = "damage.png"  # KL by generated position and by context length, where the sweep measured them
SETUP_TAGS = (
    ("quantlab.cost.engine", "engine"),
    ("quantlab.cost.kernel_path", "kernel path"),
    ("quantlab.cost.hardware", "hardware"),
)
# Smallest y span of a plot of 0-1 scores: a one-point difference must not fill the whole height.
MIN_FRACTION_SPAN = 0.04
# Elsewhere: a share of the largest value (perplexity 11.5 vs 11.8 keeps its proportion).
MIN_RELATIVE_SPAN = 0.05

_templates = jinja2.Environment(
    loader=jinja2.PackageLoader("quantlab", "templates"),
    autoescape=jinja2.select_autoescape(["html.j2"]),
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
    undefined=jinja2.StrictUndefined,
)
_templates.filters["md"] = lambda text: str(text).replace("|", "\\|")
_templates.filters["label"] = lambda key: metric_spec(key).label


@dataclass(frozen=True)
class Table:
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


def key_metrics(variants: Sequence[VariantSummary], frontiers: Frontiers) -> tuple[str, ...]:
    """The columns worth showing: the quality metrics, then cost."""
    logged = logged_keys(variants)
    return (*quality_metrics(variants, frontiers.declared), *(key for key in KEY_COST_METRICS if key in logged))


def _cell(variant: VariantSummary, metric: str, frontiers: Frontiers, baseline: VariantSummary | None) -> str:
    """A value in its units; a quality figure also shows its paired change against the baseline."""
    if not variant.succeeded:
        return "-"
    found = metric_spec(metric, frontiers.declared)
    text = format_value(found, variant.value(metric))
    if baseline is None or variant is baseline or metric.startswith("cost/") or variant.value(metric) is None:
        return text
    comparison = frontiers.vs_baseline.get(variant.name, {}).get(metric)
    if comparison is not None:
        return f"{text} ({format_diff(found, comparison)})"
    base = baseline.value(metric)
    return text if base is None else f"{text} ({format_change(found, variant.value(metric) - base)}, no paired noise)"


def _frontier_status(variant: VariantSummary, results: Sequence[FrontierResult]) -> str:
    if not variant.succeeded:
        return "failed"
    placed = [result for result in results if result.point(variant.name) is not None]
    on_front = sum(variant.name in result.on_front for result in placed)
    if not placed:
        return "not plotted"
    return f"yes ({on_front} of {len(results)} plots)" if on_front else "no"


def variants_table(variants: Sequence[VariantSummary], frontiers: Frontiers, decision: Decision | None = None) -> Table:
    """One row per variant, baseline first: its verdict (with a decision), key figures, whether it is on a frontier."""
    metrics = key_metrics(variants, frontiers)
    baseline = find_baseline(variants)
    judged = {verdict.name: verdict.status.words for verdict in decision.verdicts} if decision else {}
    rows = tuple(
        (
            variant.name + (" (baseline)" if variant.is_baseline else ""),
            *([judged.get(variant.name, "not judged")] if decision else []),
            variant.method
            + (f" (served as {label})" if (label := variant.tags.get(SERVING_TAG + "served_as")) else ""),
            *(_cell(variant, metric, frontiers, baseline) for metric in metrics),
            _frontier_status(variant, frontiers.results),
        )
        for variant in sorted(variants, key=lambda v: not v.is_baseline)
    )
    headers = ("variant", *(["verdict"] if decision else []), "method", *(metric_spec(m).label for m in metrics))
    return Table((*headers, "on frontier"), rows)


@dataclass(frozen=True)
class DecisionText:
    """What every page about a sweep opens with, one sentence each: what ships (at what cost), and why."""

    ship: str
    why: str


def _names(verdicts: Sequence[Verdict]) -> str:
    """'awq, fp8: not enough evidence; w8: rejected' (the verdicts grouped by status, in the decision's order)."""
    by_status: dict[str, list[str]] = {}
    for verdict in verdicts:
        by_status.setdefault(verdict.status.words, []).append(verdict.name)
    return "; ".join(f"{', '.join(names)}: {words}" for words, names in by_status.items())


def _limits(decision: Decision) -> str:
    """The policy in a few words: its limits when there are one or two, else how many (the table lists them)."""
    if not decision.checks:
        return "the policy, which sets no limits"
    # A confidence belongs to the paired drop limits; a bound on a logged figure is a plain comparison.
    drops = any(check.is_drop for verdict in decision.verdicts for check in verdict.checks)
    shown = f"at {confidence(decision.policy.one_sided_alpha)} one-sided confidence" if drops else ""
    if len(decision.checks) <= 2:
        return f"every limit of the policy ({'; '.join(decision.checks)}{', ' * bool(shown)}{shown})"
    return f"all {len(decision.checks)} limits of the policy" + (f" ({shown})" if shown else "")


def policy_words(decision: Decision | None) -> str:
    """The policy as applied: its limits, the objective and the confidence level (the parent run's POLICY tag)."""
    if decision is None:
        return "the recipe's policy could not be applied to this sweep"
    best = "highest" if decision.objective.higher_is_better else "lowest"
    limits = "; ".join(decision.checks) or "no limits"
    level = confidence(decision.policy.one_sided_alpha)
    return f"{limits}; then the {best} {decision.objective.metric}; limits shown at {level} one-sided confidence"


def decision_text(decision: Decision | None, variants: Sequence[VariantSummary]) -> DecisionText:
    """The decision in two sentences, from `decision` alone (and the variants' figures for the cost)."""
    if decision is None:
        return DecisionText(
            "Nothing is recommended for this sweep.",
            "The recipe's policy could not be applied to its runs; `quantlab pick` says why.",
        )
    others = [verdict for verdict in decision.verdicts if verdict.name != decision.chosen]
    if decision.chosen is None:
        return DecisionText(
            "Ship nothing: no variant passes every limit of the policy.",
            f"Checked against {_limits(decision)}: {_names(others)}.",
        )
    objective = decision.objective
    found = metric_spec(objective.metric)
    figures = {variant.name: variant.value(objective.metric) for variant in variants}
    value, base = figures.get(decision.chosen), figures.get(decision.baseline)
    cost = f"{found.label} {format_value(found, value)}"
    rest = f"; {_names(others)}" if others else ""
    if decision.chosen == decision.baseline:
        return DecisionText(
            f"Ship {decision.chosen}, the baseline ({cost}).",
            f"No other variant passes {_limits(decision)}{rest}.",
        )
    if value is not None and base:
        cost += f", {value / base:.0%} of the baseline {decision.baseline}'s {format_value(found, base)}"
    best = "highest" if objective.higher_is_better else "lowest"
    passing = sum(verdict.status in (Status.CHOSEN, Status.COSTS_MORE) for verdict in decision.verdicts)
    rate = decision.control.brief if decision.control else ""
    return DecisionText(
        f"Ship {decision.chosen}: {cost}.",
        f"It has the {best} {found.label} of the {passing} of {len(decision.verdicts)} variants that pass "
        f"{_limits(decision)}{rest}." + (f" The chance that the choice is over a limit: {rate}." if rate else ""),
    )


def decision_figures(decision: Decision | None, variants: Sequence[VariantSummary]) -> dict[str, float]:
    """The chosen variant's figures a reviewer weighs, under their own keys: the objective and key costs, each
    checked metric and its paired difference to the baseline (with its 95% interval). Empty when none is chosen."""
    chosen = next((v for v in variants if decision is not None and v.name == decision.chosen), None)
    if chosen is None or decision is None:
        return {}
    checked = [check.metric for check in decision.verdict(chosen.name).checks]
    paired = [paired_key(metric, statistic) for metric in checked for statistic in ("diff", "ci95_low", "ci95_high")]
    keys = [decision.objective.metric, *KEY_COST_METRICS, *checked, *paired]
    return {key: chosen.metrics[key] for key in dict.fromkeys(keys) if key in chosen.metrics}


def reviewer_metrics(decision: Decision | None, variants: Sequence[VariantSummary]) -> list[str]:
    """The metrics a reviewer compares across the runs table, where logged: the policy's metrics with their paired
    differences, the objective, weight bytes, served throughput and price."""
    logged = logged_keys(variants)
    checked = {check.metric for verdict in (decision.verdicts if decision else ()) for check in verdict.checks}
    paired = [paired_key(metric, "diff") for metric in sorted(checked)]
    objective = [decision.objective.metric] if decision else []
    costs = shown_in(Shown.RUNS_TABLE)
    keys = [key for key in dict.fromkeys([*sorted(checked), *paired, *objective, *costs]) if key in logged]
    return keys


_FRONT, _DOMINATED, _BASELINE, _TIE = "#1f77b4", "#9e9e9e", "#d62728", "#ff9800"


def _legend(axes) -> None:
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], color=_FRONT, marker="o", label="on the frontier"),
        Line2D([], [], color=_DOMINATED, marker="o", ls="", label="dominated"),
        Line2D([], [], color=_BASELINE, marker="*", ms=10, ls="", label="baseline"),
        Line2D([], [], color=_TIE, ls=":", lw=2, label="tie within noise"),
        Line2D([], [], color="#555", marker="|", ms=12, ls="", label="paired 95% interval vs baseline"),
    ]
    axes.legend(handles=handles, fontsize=7, loc="best")


@dataclass(frozen=True)
class Plot:
    png: Path
    svg: Path


def y_limits(result: FrontierResult) -> tuple[float, float]:
    """Spans every point and paired interval, and a floor (`MIN_*_SPAN`): sub-noise differences stay small."""
    values = [end for p in result.points for end in (p.quality, *(p.interval or ()))]
    if not values:
        return 0.0, 1.0
    low, high = min(values), max(values)
    scale = result.pair.quality.unit
    floor = MIN_FRACTION_SPAN if scale is Scale.FRACTION else MIN_RELATIVE_SPAN * max(abs(v) for v in values) or 1.0
    half = max(high - low, floor) * 0.6  # 10% margin on each side
    return (low + high) / 2 - half, (low + high) / 2 + half


def _formatter(scale: Scale):
    from matplotlib.ticker import EngFormatter, FuncFormatter, PercentFormatter

    if scale is Scale.FRACTION:
        return PercentFormatter(xmax=1.0)
    if scale is Scale.BYTES:
        return EngFormatter(unit="B")
    suffix = {Scale.TOKENS_PER_S: " tok/s", Scale.REQUESTS_PER_S: " req/s", Scale.MILLISECONDS: " ms"}.get(scale, "")
    return FuncFormatter(lambda value, _: f"{value:g}{suffix}")


def draw(axes, result: FrontierResult, title: str, gid_prefix: str = "pt") -> None:
    """Points with their paired 95% interval to the baseline, the front joined, ties dotted, the baseline starred."""
    pair = result.pair
    front = [p for p in result.points if p.on_front]
    if len(front) > 1:
        axes.plot([p.cost for p in front], [p.quality for p in front], "-", color=_FRONT, zorder=2, label="frontier")
    for point in result.points:
        for other in (result.point(name) for name in point.tied_with if name > point.name):
            axes.plot([point.cost, other.cost], [point.quality, other.quality], ":", color=_TIE, lw=2, zorder=2.5)  # type: ignore[union-attr]
    for index, point in enumerate(result.points):
        color = _BASELINE if point.is_baseline else _FRONT if point.on_front else _DOMINATED
        low, high = point.interval or (point.quality, point.quality)
        yerr = [[point.quality - low], [high - point.quality]] if point.interval else None
        marker = {"fmt": "*", "markersize": 14} if point.is_baseline else {"fmt": "o", "markersize": 7}
        drawn = axes.errorbar([point.cost], [point.quality], yerr=yerr, color=color, capsize=4, zorder=3, **marker)
        drawn.lines[0].set_gid(f"{gid_prefix}-{index}")
        axes.annotate(point.name, (point.cost, point.quality), xytext=(6, 6), textcoords="offset points", fontsize=8)
    axes.set_ylim(*y_limits(result))
    axes.margins(x=0.15)
    axes.xaxis.set_major_formatter(_formatter(pair.cost.unit))
    axes.yaxis.set_major_formatter(_formatter(pair.quality.unit))
    axes.set_title(title, fontsize=10)
    excluded = ", ".join(f"{e.name} ({e.reason})" for e in result.excluded)
    axes.set_xlabel(pair.cost.label + (f"\nnot plotted: {excluded}" if excluded else ""), fontsize=9)
    axes.set_ylabel(pair.quality.label, fontsize=9)
    axes.grid(True, alpha=0.3)
    _legend(axes)


def _blank(columns: int = 1, rows: int = 1):
    """A figure of the object API (savefig picks the canvas per format): pyplot's global state is left alone."""
    from matplotlib.figure import Figure

    return Figure(figsize=(6.4 * columns, 4.8 * rows), layout="constrained")


def figure(result: FrontierResult, model: str, gid_prefix: str = "pt"):
    fig = _blank()
    draw(fig.add_subplot(), result, f"{model}\n{result.pair.title}", gid_prefix)
    return fig


def _save(fig, path: Path) -> Path:
    import matplotlib

    # Text stays text (searchable, no fonts embedded as paths); fixed ids and no date keep it reproducible.
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "quantlab"}):
        fig.savefig(path, dpi=110, metadata={"Date": None} if path.suffix == ".svg" else None)
    return path


def _laid_out(fig):
    """`fig` with its constrained layout computed once and then kept: saved in two formats, each savefig would lay it
    out again in a whole draw of its own (which it skips only for a figure without a layout engine: not "none")."""
    fig.draw_without_rendering()
    fig.set_layout_engine(None)
    return fig


def render_plots(frontiers: Frontiers, out_dir: Path, model: str) -> list[Plot]:
    """plots/<pair>.png and .svg; frontier.png has every pair in one image for MLflow's one-picture view."""
    (out_dir / "plots").mkdir(parents=True, exist_ok=True)
    plots = []
    for index, result in enumerate(frontiers.results):
        fig = _laid_out(figure(result, model, f"pt{index}"))
        stem = out_dir / "plots" / re.sub(r"[^a-z0-9]+", "-", result.pair.name.lower()).strip("-")
        plots.append(Plot(_save(fig, stem.with_suffix(".png")), _save(fig, stem.with_suffix(".svg"))))
    render_overview(frontiers, out_dir / "frontier.png", model)
    return plots


def render_overview(frontiers: Frontiers, path: Path, model: str) -> Path:
    results = frontiers.results
    columns = 1 if len(results) <= 1 else 2
    rows = max(1, -(-len(results) // columns))
    fig = _blank(columns, rows)
    grid = fig.subplots(rows, columns, squeeze=False).ravel()
    for axes, result in zip(grid, results):
        draw(axes, result, result.pair.title)
    for axes in grid[len(results) :]:
        axes.set_axis_off()
    if not results:
        grid[0].text(0.5, 0.5, "no frontier: no variant logged both a quality and a cost metric", ha="center")
    fig.suptitle(f"{model}: quality vs cost")
    return _save(fig, path)


def inline_svg(text: str) -> str:
    """An SVG file as an element of an HTML page: no XML prolog, metadata or namespace URLs."""
    text = text[text.index("<svg") :]
    text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.DOTALL)
    return re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", text)


def render_html(
    frontiers: Frontiers,
    plots: Sequence[Plot],
    path: Path,
    *,
    variants: Sequence[VariantSummary],
    model: str,
    decision: Decision | None = None,
    serving_chart: Path | None = None,
    damage_chart: Path | None = None,
) -> Path:
    """An offline page (MLflow's artifact viewer): the decision and the table first, then the SVGs, the serving
    chart and the damage chart (inlined: the viewer shows the page alone); a hovered point's variant lights up
    everywhere."""
    table = variants_table(variants, frontiers, decision)
    rows = {row[0].removesuffix(" (baseline)"): list(zip(table.headers[1:], row[1:])) for row in table.rows}
    points = {
        f"pt{index}-{k}": {
            "name": point.name,
            "lines": [
                f"{result.pair.quality.label}: {format_value(metric_spec(result.pair.quality.metric, frontiers.declared), point.quality)}",
                "on the frontier" if point.on_front else "dominated by " + ", ".join(point.dominated_by),
                *([f"tie within noise with {', '.join(point.tied_with)}"] if point.tied_with else []),
                *(f"{header}: {cell}" for header, cell in rows.get(point.name, [])),
            ],
        }
        for index, result in enumerate(frontiers.results)
        for k, point in enumerate(result.points)
    }
    page = _templates.get_template("frontier.html.j2").render(
        title=f"{model}: quantlab frontier",
        svgs=[inline_svg(plot.svg.read_text()) for plot in plots],
        table=table,
        text=decision_text(decision, variants),
        serving=_base64(serving_chart),
        damage=_base64(damage_chart),
        direction_unknown=frontiers.direction_unknown,
        points=points,
    )
    path.write_text(page, encoding="utf-8")
    return path


def _base64(picture: Path | None) -> str | None:
    """A PNG's bytes for an inline data: URL."""
    import base64

    return base64.b64encode(picture.read_bytes()).decode("ascii") if picture else None


# A terminal table: a column's widest cell beyond this wraps; each column adds a border and two spaces (Rich's
# default box), and the table one closing border.
CELL_WIDTH = 24
ROWS_AS_COLUMNS = 6  # more columns than this: one row per figure and one column per variant


def column_pages(widths: Sequence[int], width: int, keep: int = 1) -> list[tuple[int, ...]]:
    """Which columns each printed table shows so that none is wider than `width`: the first `keep` columns on every
    one, then as many of the others, in order, as fit (at least one). `widths`: each column's widest cell.

    A column takes min(cell, CELL_WIDTH) + 3 characters and a table 1 more: at 80 columns, a 20-wide label and
    cells of 30 make pages of two (1 + 23 + 27 + 27 = 78)."""
    span = [min(cell, CELL_WIDTH) + 3 for cell in widths]
    fixed, pages, page, used = tuple(range(keep)), [], [], 1 + sum(span[:keep])
    for index in range(keep, len(widths)):
        if page and used + span[index] > width:
            pages.append(fixed + tuple(page))
            page, used = [], 1 + sum(span[:keep])
        page.append(index)
        used += span[index]
    return [*pages, fixed + tuple(page)] if page or not pages else pages


def text_tables(table: Table, width: int) -> list[Table]:
    """The variants table for a terminal `width` characters wide: as it is when it has at most ROWS_AS_COLUMNS
    columns and fits; else a row per figure and a column per variant (dozens of lm-eval scores would not fit side
    by side), cut into tables of as many variants as fit, each repeating the figure names. Long cells wrap."""

    def widths(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[int]:
        return [max(len(cell) for cell in column) for column in zip(headers, *rows)]

    if len(table.headers) <= ROWS_AS_COLUMNS and len(column_pages(widths(table.headers, table.rows), width)) == 1:
        return [table]
    headers = ("", *(row[0] for row in table.rows))
    rows = [(header, *(row[i] for row in table.rows)) for i, header in enumerate(table.headers) if i]
    return [
        Table(tuple(headers[i] for i in page), tuple(tuple(row[i] for i in page) for row in rows))
        for page in column_pages(widths(headers, rows), width)
    ]


def frontier_lines(frontiers: Frontiers) -> list[str]:
    """`quantlab frontier`'s lines under the table (Rich markup): each front, what it dominates, ties, left out."""
    return _templates.get_template("frontier.txt.j2").render(frontiers=frontiers).splitlines()


def _setup(tags: Mapping[str, str]) -> str:
    """What speed and memory depend on: "engine vllm, kernel path fp8-matmul, hardware ..."."""
    return ", ".join(f"{word} {tags.get(tag, 'unrecorded')}" for tag, word in SETUP_TAGS)


def render_markdown(
    variants: Sequence[VariantSummary],
    frontiers: Frontiers,
    decision: Decision | None,
    notes: Sequence[str] = (),
    *,
    model: str = "the model",
) -> str:
    """A report for someone who has never seen quantlab: compared what, found what, ship what."""
    metrics = key_metrics(variants, frontiers)
    served_as = served_as_notes(variants)
    setups: dict[str, list[str]] = {}  # which succeeded variants were measured alike
    for variant in (v for v in variants if v.succeeded):
        setups.setdefault(_setup(variant.tags), []).append(variant.name)
    unpaired = [
        f"{name} {metric}"
        for name, found in frontiers.vs_baseline.items()
        for metric in metrics
        if not metric.startswith("cost/") and metric not in found
    ]
    return _templates.get_template("report.md.j2").render(
        model=model,
        variants=variants,
        baseline=find_baseline(variants),
        table=variants_table(variants, frontiers, decision),
        text=decision_text(decision, variants),
        tasks=[metric_spec(m).label for m in metrics if m.startswith("eval/")],
        damage=[metric_spec(m).label for m in metrics if m in DAMAGE_METRICS],
        costs=[metric_spec(m).label for m in metrics if m in KEY_COST_METRICS],
        unpaired=unpaired,
        frontiers=frontiers,
        show=lambda metric, value: format_value(metric_spec(metric, frontiers.declared), value),
        describe=lambda comparison, metric: describe_comparison(comparison, metric_spec(metric, frontiers.declared)),
        decision=decision,
        confidence=confidence(decision.policy.one_sided_alpha) if decision is not None else "",
        # Speed timed while other work competed for the cores: the decision's (which knows its objective), or each variant's.
        cost_warnings=[
            line
            for line in (decision.warnings if decision is not None else cost_warnings(variants))
            if line not in served_as
        ],
        served_as=served_as,
        setups=setups,
        unrecorded=_setup({}),
        notes=notes,
        failed=[v.name for v in variants if not v.succeeded],
        serving=serving_table(variants),
        workloads=workload_table(variants),
        serving_chart=SERVING_CHART,
        engine_floor=engine_floor_table(variants),
        on_policy=on_policy_table(variants),
        contexts=context_table(variants),
        damage_chart=DAMAGE_CHART if any(damage_series(variants)) else None,
    )


# On-policy damage (quality.generate): the figures shown per part, each with its paired 95% interval.
ON_POLICY_FIGURES = ("kld_mean", "ear", "top1_agreement", "delta_nll")
_ON_POLICY_PART = re.compile(r"^quality/on_policy/(?P<part>[^/]+)/tokens$")


def on_policy_table(variants: Sequence[VariantSummary]) -> Table | None:
    """Each variant's damage over the baseline's own greedy continuations, by part: the prompt, the generated tokens,
    then each bucket of generated positions in order; each figure with its 95% interval (paired with the baseline,
    the sequences as clusters). None when no variant logged it."""
    rows = []
    for variant in (v for v in variants if v.succeeded and not v.is_baseline):
        found = [m["part"] for key in variant.metrics if (m := _ON_POLICY_PART.match(key))]
        parts = sorted(found, key=lambda part: (part != "prompt", part != "generated", _first_position(part)))
        for index, part in enumerate(parts):
            cells = [_paired_cell(variant, f"quality/on_policy/{part}/{figure}") for figure in ON_POLICY_FIGURES]
            tokens = f"{variant.value(f'quality/on_policy/{part}/tokens') or 0:.0f}"
            rows.append((variant.name if index == 0 else "", _part_label(part), tokens, *cells))
    if not rows:
        return None
    labels = tuple(metric_spec(f"quality/on_policy/generated/{figure}").label for figure in ON_POLICY_FIGURES)
    return Table(
        ("variant", "positions", "tokens", *(label.removesuffix(" (generated)") for label in labels)), tuple(rows)
    )


def _first_position(part: str) -> int:
    first = part.removeprefix("gen").partition("-")[0]
    return int(first) if first.isdigit() else 0


def _part_label(part: str) -> str:
    """gen1-32 -> "generated 1-32"; prompt and generated as they are."""
    return f"generated {part.removeprefix('gen')}" if _first_position(part) else part


def _paired_interval(variant: VariantSummary, key: str) -> tuple[float | None, tuple[float, float] | None]:
    """The figure and the 95% interval of its paired difference from the baseline, moved onto the figure (the
    baseline's own value is the same on every token: 0 for KL, 1 for EAR and top-1); no interval where not logged."""
    value, diff = variant.value(key), variant.value(paired_key(key, "diff"))
    low, high = (variant.value(paired_key(key, end)) for end in ("ci95_low", "ci95_high"))
    if value is None or diff is None or low is None or high is None:
        return value, None
    return value, (value - diff + low, value - diff + high)


def _paired_cell(variant: VariantSummary, key: str) -> str:
    """ "0.012 nats [0.008, 0.016]": the figure and its paired 95% interval (_paired_interval)."""
    found = metric_spec(key)
    value, interval = _paired_interval(variant, key)
    text = format_value(found, value)
    if interval is None:
        return text
    return f"{text} [{format_value(found, interval[0])}, {format_value(found, interval[1])}]"


# Damage by context length (quality.contexts): the figures shown per length, each with its paired 95% interval.
CONTEXT_FIGURES = ("kld_mean", "top1_agreement")
_CONTEXT_KEY = re.compile(r"^quality/kld_mean/ctx(?P<length>\d+)$")
_ON_POLICY_KLD = re.compile(r"^quality/on_policy/(?P<part>[^/]+)/kld_mean$")


def _context_lengths(variant: VariantSummary) -> list[int]:
    return sorted(int(m["length"]) for key in variant.metrics if (m := _CONTEXT_KEY.match(key)))


def context_table(variants: Sequence[VariantSummary]) -> Table | None:
    """Each variant's damage by how many tokens of context came before the scored token (quality.contexts), each
    figure with its 95% interval paired with the baseline over the same tokens; None when no variant logged it."""
    rows = []
    for variant in (v for v in variants if v.succeeded and not v.is_baseline):
        for index, length in enumerate(_context_lengths(variant)):
            cells = [_paired_cell(variant, f"quality/{figure}/ctx{length}") for figure in CONTEXT_FIGURES]
            rows.append((variant.name if index == 0 else "", f"up to {length}", *cells))
    if not rows:
        return None
    labels = tuple(metric_spec(f"quality/{figure}").label for figure in CONTEXT_FIGURES)
    return Table(("variant", "tokens of context", *labels), tuple(rows))


@dataclass(frozen=True)
class DamageSeries:
    """One variant's KL along one axis: each point's label, value and paired 95% interval (None: not logged)."""

    variant: str
    labels: tuple[str, ...]
    values: tuple[float, ...]
    intervals: tuple[tuple[float, float] | None, ...]


def _series(variant: VariantSummary, points: Sequence[tuple[str, str]]) -> DamageSeries | None:
    """(label, metric key) per point, in order: the points the variant logged, or None if it logged none."""
    kept = [(label, *found) for label, key in points if (found := _paired_interval(variant, key))[0] is not None]
    if not kept:
        return None
    labels, values, intervals = zip(*kept)
    return DamageSeries(variant.name, labels, values, intervals)


def damage_series(variants: Sequence[VariantSummary]) -> tuple[list[DamageSeries], list[DamageSeries]]:
    """KL by generated position (the on-policy buckets, quality.generate) and by context length (quality.contexts),
    one series per quantized variant that logged them. Pure."""
    by_position: list[DamageSeries] = []
    by_context: list[DamageSeries] = []
    for variant in (v for v in variants if v.succeeded and not v.is_baseline):
        parts = [m["part"] for key in variant.metrics if (m := _ON_POLICY_KLD.match(key))]
        buckets = sorted((part for part in parts if _first_position(part)), key=_first_position)
        position = [(part.removeprefix("gen"), f"quality/on_policy/{part}/kld_mean") for part in buckets]
        context = [(str(length), f"quality/kld_mean/ctx{length}") for length in _context_lengths(variant)]
        by_position += [found] if (found := _series(variant, position)) else []
        by_context += [found] if (found := _series(variant, context)) else []
    return by_position, by_context


def render_damage_chart(variants: Sequence[VariantSummary], path: Path, model: str) -> Path | None:
    """KL from the baseline by generated position and by context length, a panel each, every variant a line with its
    paired 95% intervals; None when the sweep measured neither."""
    axes_words = (
        ("On the baseline's own generations", "generated positions (bucket)"),
        ("By context length", "tokens of context before the scored token (up to)"),
    )
    panels = [(series, *words) for series, words in zip(damage_series(variants), axes_words) if series]
    if not panels:
        return None
    fig = _blank(columns=len(panels))
    for axes, (series, title, axis) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        # Every variant's buckets on one axis, in order of their first position or length
        labels = sorted({label for each in series for label in each.labels}, key=lambda label: int(label.split("-")[0]))
        for each in series:
            ends = [interval or (value, value) for value, interval in zip(each.values, each.intervals)]
            below = [value - low for value, (low, _) in zip(each.values, ends)]
            above = [high - value for value, (_, high) in zip(each.values, ends)]
            steps = [labels.index(label) for label in each.labels]
            axes.errorbar(steps, each.values, yerr=[below, above], fmt="o-", capsize=4, label=each.variant)
        axes.set_xticks(range(len(labels)), labels)
        axes.set_xlabel(axis, fontsize=9)
        axes.set_ylabel(metric_spec("quality/kld_mean").label, fontsize=9)
        axes.set_title(title, fontsize=10)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
    fig.suptitle(f"{model}\ndamage as generation and context grow (paired 95% intervals)", fontsize=10)
    return _save(fig, path)


WITHIN, BEYOND = "within the engine's own noise", "beyond the engine's own noise"


def engine_floor_table(variants: Sequence[VariantSummary]) -> Table | None:
    """Each served difference beside the engine's floor (the baseline served twice) and whether it is within it;
    None when the baseline logged no floor."""
    found = engine_noise(variants)
    if found is None:
        return None
    declared = merged_declared(variants)
    rows = []
    for score in found.scores:
        spec = metric_spec(score.score, declared)
        floor = describe_comparison(score.floor, spec)
        for index, judged in enumerate(score.judged or (None,)):
            first = (spec.label, floor) if index == 0 else ("", "")
            if judged is None:
                rows.append((*first, "", "", ""))
                continue
            shown = f"{judged.what}: {describe_comparison(judged.comparison, spec)}"
            rows.append((*first, judged.variant, shown, WITHIN if judged.within else BEYOND))
    for token in found.tokens:
        spec = metric_spec(f"quality/served/{token.figure}")
        floor = format_value(spec, token.floor)
        for index, (name, value, within) in enumerate(token.variants or ((None, None, None),)):
            first = (spec.label, floor) if index == 0 else ("", "")
            if name is None:
                rows.append((*first, "", "", ""))
                continue
            rows.append((*first, name, format_value(spec, value), WITHIN if within else BEYOND))
    headers = ("score", "the baseline served twice", "variant", "served difference", "against the floor")
    return Table(headers, tuple(rows))


def serving_table(variants: Sequence[VariantSummary]) -> Table | None:
    """Each variant's serving figures, its goodput level and engine, or why it has none; None if none was served."""
    served = [v for v in variants if v.succeeded and any(key.startswith("cost/serving/") for key in v.metrics)]
    if not served:
        return None
    rows = []
    for variant in served:
        cells = [_with_interval(variant, key) for key in SERVING_FIGURES]
        tags = variant.tags
        level = tags.get(SERVING_TAG + "goodput_level") or "none: " + tags.get(UNAVAILABLE_TAG + "goodput", "?")
        if contended := tags.get(CONTENDED_LEVELS_TAG):
            level += f" (contended: {contended}; no decision rests on these figures)"
        kernel = tags.get(SERVING_TAG + "kernel", "?")
        if served_as := tags.get(SERVING_TAG + "served_as"):
            kernel += f" (served as {served_as})"
        engine = tags.get(SERVING_TAG + "engine", "?")
        if plugins := tags.get(NOT_STOCK_TAG):
            engine += f" with quantlab's plugin {plugins} (not stock)"
        rows.append((variant.name, engine, kernel, level, *cells))
    labels = tuple(metric_spec(key).label for key in SERVING_FIGURES)
    return Table(("variant", "engine", "kernel", "goodput level", *labels), tuple(rows))


def _with_interval(variant: VariantSummary, key: str) -> str:
    """ "12.3 tok/s [10.1, 14.5]": a served figure and its 95% interval over the level's runs, where it has one."""
    found = metric_spec(key)
    text = format_value(found, variant.value(key))
    low, high = (variant.value(f"{key}/{end}") for end in ("ci95_low", "ci95_high"))
    if low is None and high is None:
        return text
    ends = [format_value(found, end) if end is not None else "unbounded" for end in (low, high)]
    return f"{text} [{ends[0]}, {ends[1]}]"


WORKLOAD_FIGURE = "goodput_tokens_per_s"  # what the serving table centres on, compared per workload


def served_workloads(variants: Sequence[VariantSummary]) -> list[Workload]:
    """The named workloads (serving.workloads) as the first variant that served any recorded them; [] if none."""
    for variant in variants:
        if shapes := variant.tags.get(WORKLOADS_TAG):
            return [Workload.model_validate(shape) for shape in json.loads(shapes)]
    return []


def logged_interval(variant: VariantSummary, key: str, runs_key: str) -> Interval | None:
    """A logged figure's t interval over its runs, as the serve stage logged it; None without one."""
    mean, low, high = (variant.value(name) for name in (key, f"{key}/ci95_low", f"{key}/ci95_high"))
    runs = variant.value(runs_key)
    if mean is None or low is None or high is None or runs is None:
        return None
    return Interval(mean, low, high, int(runs))


def workload_table(variants: Sequence[VariantSummary]) -> Table | None:
    """Per named workload, each variant's goodput (output tokens/s) and its ratio to the baseline's with a 95%
    interval from both variants' runs (quantlab.serving.intervals.ratio_interval), or paired round by round where both
    were served in the same rounds (quantlab.repeats.paired_ratio); None without named workloads."""
    served = [variant for variant in variants if variant.succeeded]
    shapes = served_workloads(served)
    baseline = find_baseline(served)
    if not shapes:
        return None
    rows = []
    for shape in shapes:
        key = f"{WORKLOAD_PREFIX}{shape.name}/{WORKLOAD_FIGURE}"
        for index, variant in enumerate(served):
            named = f"{shape.name} ({shape.prompt_tokens} + {shape.output_tokens})" if index == 0 else ""
            if variant.value(key) is None:
                rows.append((named, variant.name, _no_goodput(variant, shape.name), ""))
                continue
            shown = _with_interval(variant, key)
            if contended := rests_on_contention(key, variant.tags):
                shown += f" (contended: {contended.partition(' rests on ')[2]})"
            rows.append((named, variant.name, shown, _ratio_cell(variant, baseline, shape.name)))
    headers = ("workload (prompt + output tokens)", "variant", metric_spec("cost/serving/" + WORKLOAD_FIGURE).label)
    return Table((*headers, "against the baseline (95% interval)"), tuple(rows))


def _no_goodput(variant: VariantSummary, workload: str) -> str:
    tags = variant.tags
    why = tags.get(f"{UNAVAILABLE_TAG}workload/{workload}") or tags.get(f"{UNAVAILABLE_TAG}workload/{workload}/goodput")
    return f"none: {why or 'not served'}"


def _workload_interval(variant: VariantSummary, workload: str) -> Interval | None:
    """The workload's goodput with its interval over the runs of its goodput level."""
    scope = f"{WORKLOAD_PREFIX}{workload}/"
    level = variant.tags.get(f"{SERVING_TAG}workload/{workload}/goodput_level", "")
    return logged_interval(variant, scope + WORKLOAD_FIGURE, f"{scope}{level}/runs")


def _ratio_cell(variant: VariantSummary, baseline: VariantSummary | None, workload: str) -> str:
    key = f"{WORKLOAD_PREFIX}{workload}/{WORKLOAD_FIGURE}"
    if baseline is None:
        return "no baseline"
    if variant is baseline:
        return "1 (the baseline)"
    base = baseline.value(key)
    if base is None or base <= 0:
        return "no ratio: the baseline has no goodput here"
    ratio = variant.value(key) / base
    if rests_on_contention(key, baseline.tags):
        return f"{ratio:.3g}x (the baseline's level was contended)"
    # Served in the same rounds (serving.interleave): the ratio paired round by round, as the frontier judges it
    if (by_round := paired_ratio(cost_rounds(variant, key), cost_rounds(baseline, key))) is not None:
        return f"{by_round.mean:.3g}x [{by_round.low:.3g}, {by_round.high:.3g}] (paired by round)"
    found, other = _workload_interval(variant, workload), _workload_interval(baseline, workload)
    paired = None if found is None or other is None else ratio_interval(found, other)
    if paired is None:
        return f"{ratio:.3g}x (no interval: one run of a level)"
    return f"{paired.mean:.3g}x [{paired.low:.3g}, {paired.high:.3g}]"


def render_serving_chart(variants: Sequence[VariantSummary], path: Path, model: str) -> Path | None:
    """Every served variant's throughput-latency curve on one chart; None when no variant was served."""
    curves = {v.name: levels for v in variants if v.succeeded and (levels := levels_from_metrics(v.metrics))}
    if not curves:
        return None
    path.write_bytes(throughput_latency_chart(curves, f"{model}: served under load, every variant"))
    return path


def sensitivity_chart(names: Sequence[str], kld: Sequence[float], whole: float, title: str) -> bytes:
    """Horizontal bars of each group's KL from the baseline, most damaging on top; the whole variant's KL, often
    ten times any one group's, is said in the title rather than drawn (it would flatten the bars)."""
    import io
    import textwrap

    fig = _blank()
    fig.set_size_inches(6.4, max(3.0, 0.22 * len(names) + 1.8))
    axes = fig.add_subplot()
    positions = list(range(len(names)))[::-1]
    axes.barh(positions, list(kld), color="#4c72b0")
    axes.set_yticks(positions, list(names), fontsize=7)
    axes.set_xlabel("KL divergence from the baseline, mean per token (nats)")
    heading = f"{title} (every group at once: {whole:.4g})"
    axes.set_title("\n".join(textwrap.wrap(heading, 80)), fontsize=8)
    axes.grid(True, axis="x", alpha=0.3)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()
