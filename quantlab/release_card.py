"""The release card on a registered model version: what ships, why, and how to get it again, in Markdown (the version's
description, which the registry's page shows) and JSON (beside it, for tools).

Pure: built from the decision, the chosen variant's logged run and the sweep's recipe; tracking and publish write it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from quantlab.decision import Decision
from quantlab.engine_noise import TOKEN_FIGURES
from quantlab.metrics import ENGINE_FLOOR_PREFIX, SERVING_TAG_PREFIX, spec
from quantlab.policy import format_value
from quantlab.tracking import CHECKPOINT, CONTENT_KEY, METHOD, RunRecord

ENGINE_FLOOR = ENGINE_FLOOR_PREFIX
ENGINE_FLOOR_TAG = "quantlab.quality.engine_floor"  # the serve stage's words for how it measured the floor
SERVING = "cost/serving/"
WORKLOAD = f"{SERVING}workload/"
DEFAULT_WORKLOAD = "the recipe's one shape"  # serving.workloads unset
LOW, HIGH = "/ci95_low", "/ci95_high"
# The engine's identity, as the serve stage logs it (params of the variant run).
ENGINE_PARAMS = ("served.engine", "served.engine_version", "served.engine_build", "served.hardware", "served.plugins")


@dataclass(frozen=True)
class Check:
    constraint: str
    status: str
    detail: str


@dataclass(frozen=True)
class VerdictLine:
    variant: str
    status: str
    basis: str  # "3 checks: 2 drop limits, 1 bound"
    reasons: tuple[str, ...]
    checks: tuple[Check, ...]


@dataclass(frozen=True)
class Figure:
    """A logged figure with its 95% interval where one was logged beside it."""

    key: str
    value: float
    low: float | None = None
    high: float | None = None

    def words(self) -> str:
        shown = format_value(spec(self.key), self.value)
        if self.low is None or self.high is None:
            return shown
        return f"{shown} [{format_value(spec(self.key), self.low)}, {format_value(spec(self.key), self.high)}]"


@dataclass(frozen=True)
class ReleaseCard:
    model: str  # the registered model
    version: str
    alias: str
    variant: str
    method: str
    run_id: str
    checkpoint: str
    checkpoint_hash: str  # the checkpoint's content key
    summary: str  # the decision in a sentence
    error_rate: str  # the error rate of the choice in words
    selection: str  # what passing did to the chosen variant's drops ("" if nothing to say)
    verdicts: tuple[VerdictLine, ...]
    engine_floor: tuple[Figure, ...]
    engine_floor_how: str  # how the engine was run against itself
    workloads: dict[str, tuple[Figure, ...]]  # workload -> its cost figures
    engine: dict[str, str]  # ENGINE_PARAMS logged
    kernels: dict[str, str]  # layer (or "declared") -> kernel
    served_as: str
    recipe_path: str
    recipe_hash: str  # sha256 of the recipe's text as the sweep logged it
    datasets: dict[str, str]  # name -> digest
    commands: tuple[str, ...] = field(default=())  # what reproduces it, in order

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False, default=str)


def build_card(
    decision: Decision,
    run: RunRecord,
    *,
    model: str,
    version: str,
    alias: str,
    recipe_path: str,
    recipe_text: str,
    floor: RunRecord,
    commands: Sequence[str],
) -> ReleaseCard:
    """The card of `run`, the chosen variant's run; `floor`: the run that logged the engine's floor
    (quality/engine_floor/*: the baseline served a second time, the engine against itself)."""
    params, tags = run.params, run.tags
    kernels = {
        name.removeprefix("served.kernel."): kernel
        for name, kernel in params.items()
        if name.startswith("served.kernel.")
    }
    if not kernels and (declared := tags.get(SERVING_TAG_PREFIX + "kernel")):
        kernels = {"all layers": declared}
    control = decision.control
    return ReleaseCard(
        model=model,
        version=version,
        alias=alias,
        variant=run.variant,
        method=tags.get(METHOD, "?"),
        run_id=run.run_id,
        checkpoint=tags.get(CHECKPOINT, ""),
        checkpoint_hash=tags.get(CONTENT_KEY, ""),
        summary=decision.summary,
        error_rate=control.words if control else "",
        selection=decision.selection_words,
        verdicts=tuple(
            VerdictLine(
                v.name,
                v.status.words,
                v.basis,
                v.reasons,
                tuple(Check(c.constraint, c.status.value, c.detail) for c in v.checks),
            )
            for v in decision.verdicts
        ),
        engine_floor=floor_figures(floor.metrics),
        engine_floor_how=floor.tags.get(ENGINE_FLOOR_TAG, ""),
        workloads=workload_figures(run.metrics),
        engine={name: params[name] for name in ENGINE_PARAMS if params.get(name)},
        kernels=kernels,
        served_as=tags.get(SERVING_TAG_PREFIX + "served_as", ""),
        recipe_path=recipe_path,
        recipe_hash=hashlib.sha256(recipe_text.encode("utf-8")).hexdigest() if recipe_text else "",
        datasets={item.name: item.digest for item in run.datasets},
        commands=tuple(commands),
    )


def floor_figures(metrics: Mapping[str, float]) -> tuple[Figure, ...]:
    """The engine's floor: each paired score's difference between the two served passes with its 95% interval, then
    the served token figures a variant's are read against (engine_noise's)."""
    scores = sorted(
        key.removesuffix("/diff") for key in metrics if key.startswith(ENGINE_FLOOR) and key.endswith("/diff")
    )
    found = [
        Figure(base, metrics[base + "/diff"], metrics.get(base + LOW), metrics.get(base + HIGH)) for base in scores
    ]
    tokens = [f"{ENGINE_FLOOR}served/{figure}" for figure in TOKEN_FIGURES]
    return (*found, *(Figure(key, metrics[key]) for key in tokens if key in metrics))


def figures(metrics: Mapping[str, float], prefix: str) -> tuple[Figure, ...]:
    """The figures one level under `prefix`, each with its logged 95% interval (key/ci95_low, key/ci95_high)."""
    keys = sorted(
        key
        for key in metrics
        if key.startswith(prefix) and "/" not in key.removeprefix(prefix) and not key.endswith((LOW, HIGH))
    )
    return tuple(Figure(key, metrics[key], metrics.get(key + LOW), metrics.get(key + HIGH)) for key in keys)


def workload_figures(metrics: Mapping[str, float]) -> dict[str, tuple[Figure, ...]]:
    """Workload -> its serving cost figures (cost/serving/workload/<name>/<figure>, not per load level); a sweep whose
    recipe names no workloads served one shape, under the plain cost/serving/<figure> keys (DEFAULT_WORKLOAD)."""
    names = sorted({key.removeprefix(WORKLOAD).split("/")[0] for key in metrics if key.startswith(WORKLOAD)})
    if not names:
        plain = figures(metrics, SERVING)
        return {DEFAULT_WORKLOAD: plain} if plain else {}
    # The plain keys repeat the first workload's figures: listed once, under its name.
    return {name: shown for name in names if (shown := figures(metrics, f"{WORKLOAD}{name}/"))}


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    cells = [[str(cell).replace("|", "\\|").replace("\n", " ") for cell in row] for row in rows]
    return [f"| {' | '.join(header)} |", f"|{'---|' * len(header)}", *(f"| {' | '.join(row)} |" for row in cells)]


def render_markdown(card: ReleaseCard) -> str:
    """The card as the version's description: the decision first, then what to look up."""
    lines = [
        f"# {card.model} v{card.version} (@{card.alias}): {card.variant}",
        "",
        card.summary,
        "",
        f"**Error rate of the choice.** {card.error_rate or 'not stated (no error control recorded)'}",
    ]
    if card.selection:
        lines += ["", card.selection]
    lines += ["", "## Identity", ""]
    lines += _table(
        ("", ""),
        [
            ("variant", card.variant),
            ("method", card.method),
            ("checkpoint", f"`{card.checkpoint}`"),
            ("checkpoint hash (content key)", f"`{card.checkpoint_hash}`"),
            ("run", f"`{card.run_id}`"),
            ("recipe", f"`{card.recipe_path or '(its path not logged)'}` sha256 `{card.recipe_hash or '-'}`"),
        ],
    )
    lines += ["", "## Verdicts", ""]
    rows = []
    for verdict in card.verdicts:
        checks = "; ".join(f"{c.constraint}: {c.status}, {c.detail}" for c in verdict.checks) or "-"
        reasons = "; ".join(reason for reason in verdict.reasons if reason not in checks)  # not said twice
        rows.append(
            (f"**{verdict.variant}**", verdict.status, verdict.basis, checks + (f" ({reasons})" if reasons else ""))
        )
    lines += _table(("variant", "verdict", "basis", "checks"), rows)
    lines += ["", "## Engine floor", ""]
    if card.engine_floor:
        lines += [card.engine_floor_how, ""] if card.engine_floor_how else []
        rows = [(f.key.removeprefix(ENGINE_FLOOR), f.words()) for f in card.engine_floor]
        lines += _table(("figure", "second pass against the first [95%]"), rows)
    else:
        lines.append("Not measured (no second served pass of the baseline).")
    lines += ["", "## Cost per workload", ""]
    if card.workloads:
        rows = [(name, f.key.rsplit("/", 1)[1], f.words()) for name, shown in card.workloads.items() for f in shown]
        lines += _table(("workload", "figure", "value [95%]"), rows)
    else:
        lines.append("No serving workloads measured.")
    lines += ["", "## Served", ""]
    served = [*card.engine.items(), ("served as", card.served_as or "-")]
    served += [(f"kernel: {layer}", kernel) for layer, kernel in card.kernels.items()]
    lines += _table(("", ""), served) if card.engine or card.kernels else ["Not served by an engine in this sweep."]
    lines += ["", "## Data sets", ""]
    lines += _table(("data set", "digest"), [(name, f"`{digest}`") for name, digest in card.datasets.items()])
    lines += ["", "## Reproduce", "", "```", *card.commands, "```"]
    return "\n".join(lines) + "\n"
