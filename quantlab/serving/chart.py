"""Throughput against latency, one curve per variant through its load levels: one variant's (its run's
artifact) or every variant's on one chart (the sweep's report)."""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence

from quantlab.serving.levels import LoadLevel
from quantlab.serving.settings import ServiceLevels

# (latency, axis label, the per-request limit it is held to): each level's p99, or its maximum below 100 requests
_PANELS = (
    ("ttft_ms", "TTFT p99, or max under 100 requests (ms)", "ttft_ms"),
    ("itl_ms", "ITL p99, or max under 100 requests (ms)", "itl_ms"),
)


def throughput_latency_chart(
    curves: Mapping[str, Sequence[LoadLevel]], title: str, slo: ServiceLevels | None = None
) -> bytes:
    """A PNG: output tokens/s (x) against TTFT and ITL tails (y: `LoadLevel.tail`), each level labelled; the
    per-request SLO limits as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    fig, panels = pyplot.subplots(1, len(_PANELS), figsize=(11, 4.2))
    for axes, (figure, label, limit) in zip(panels, _PANELS):
        for variant, levels in curves.items():
            points = sorted(
                (level.output_tokens_per_s, level.tail(figure), level.label)
                for level in levels
                if math.isfinite(level.tail(figure))
            )
            if not points:
                continue
            xs, ys, labels = zip(*points)
            (line,) = axes.plot(xs, ys, marker="o", label=variant)
            for x, y, text in points:
                axes.annotate(
                    text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=line.get_color()
                )
        if slo is not None:
            axes.axhline(getattr(slo, limit), color="grey", linestyle="--", linewidth=1, label="SLO (each request)")
        axes.set_xlabel("output tokens/s (all streams)")
        axes.set_ylabel(label)
        axes.grid(alpha=0.3)
    panels[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    pyplot.close(fig)
    return buffer.getvalue()
