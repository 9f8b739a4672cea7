"""What passes between the sweep, the executors, the runner and its stages (plain data): a variant's
job and result, and the baseline's outputs that later variants compare against."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from quantlab.paired import DocumentScores, Group, documents_from_json, documents_to_json
from quantlab.recipe import LoadedRecipe

if TYPE_CHECKING:
    from quantlab.evaluate.lm_eval_runner import TaskDataset
    from quantlab.models import ModelSource

StageReporter = Callable[[str], None]
V = TypeVar("V")
# Processes a variant runs beside itself, whose logs go next to its own (`<variant>.<process>.log`) and are kept
# as its run's artifacts, whether it succeeds or fails.
SIDE_PROCESSES = ("server", "scoring-server", "guidellm")
SAMPLES_FORMAT = 5  # version of the per-document records a variant run keeps (samples.json, answers/<task>.jsonl)


@dataclass(frozen=True)
class BaselineOutputs:
    """What later variants compare themselves against. Every variant run keeps its own as samples.json
    (a reused baseline run is read back from it); score keys are `eval/<task>/<metric>[:<filter>]`::

        {"version": SAMPLES_FORMAT,
         # lm-eval; quality/* per token; a sampled task's per-item means, each repeat's scores in "repeats"
         "documents": paired.documents_to_json({score key: DocumentScores}),
         "groups": {group score key: {"leaves": [leaf score key, ...], "weights": [w, ...]}},  # paired.combine
         "scores": {score key: value},          # every lm-eval score logged (recovery's input)
         "primary": {task: score key}}          # each task's primary score (flips' input)
    """

    reference_dir: str | None
    documents: dict[str, DocumentScores] = field(default_factory=dict)
    groups: dict[str, Group] = field(default_factory=dict)
    scores: dict[str, float] = field(default_factory=dict)
    primary: dict[str, str] = field(default_factory=dict)

    def to_samples(self) -> dict:
        return {
            "version": SAMPLES_FORMAT,
            "documents": documents_to_json(self.documents),
            "groups": {key: asdict(group) for key, group in self.groups.items()},
            "scores": self.scores,
            "primary": self.primary,
        }

    @classmethod
    def from_samples(cls, data: dict, reference_dir: str | None) -> BaselineOutputs:
        if data.get("version") != SAMPLES_FORMAT:
            raise ValueError(
                f"samples.json of version {data.get('version', 1)}; this quantlab reads version {SAMPLES_FORMAT}"
            )
        return cls(
            reference_dir,
            documents_from_json(data["documents"]),
            {key: Group(tuple(g["leaves"]), tuple(map(float, g["weights"]))) for key, g in data["groups"].items()},
            {key: float(value) for key, value in data["scores"].items()},
            dict(data["primary"]),
        )


@dataclass(frozen=True)
class VariantJob:
    loaded: LoadedRecipe
    variant: str
    cache_root: Path
    baseline: BaselineOutputs | None  # None for the baseline itself
    force: bool = False  # rebuild the checkpoint and the baseline's reference pass even when cached
    log_dir: Path | None = None  # where the variant's log is written: its server's and load generator's go beside it
    # The recipe's model as the sweep's plan resolved it (a GGUF file is hashed once per sweep); None: the runner does.
    source: ModelSource | None = None
    # The cluster node that runs it, named for people ("host (Ray node id)"); there, its serving engine is installed
    # where missing. None: the sweep's own machine, where a missing engine is the user's to install.
    node: str | None = None

    @property
    def is_baseline(self) -> bool:
        return self.variant == self.loaded.recipe.baseline


class ServingTurns(Protocol):
    """What an executor that interleaves its variants' serving gives the runner (quantlab.executors.LocalExecutor):
    every variant's load runs go round by round, after every variant's quality stages."""

    def scored(self, outputs: BaselineOutputs) -> None:
        """The variant's quality stages are done: what later variants compare against, before its load runs."""

    def wait(self) -> None:
        """Until the executor gives this variant its next turn to serve (its server up and idle meanwhile)."""

    def served(self) -> None:
        """The variant's timed load runs are done: until every variant's are. What it does next (its figures and
        charts, its server's stop, the sweep logging its result) would compete with another variant's timed round."""


def disjoint_union(kind: str, parts: Mapping[str, Mapping[str, V]]) -> dict[str, V]:
    """Every stage's `kind` (metrics, params, ...) in one dict, by stage name; RuntimeError naming both stages where two
    give the same key, which a plain merge would let the later one overwrite unseen."""
    merged: dict[str, V] = {}
    owner: dict[str, str] = {}
    for stage, entries in parts.items():
        for key, value in entries.items():
            if key in owner:
                raise RuntimeError(f"{kind} {key!r} comes from both the {owner[key]} and the {stage} stage")
            merged[key], owner[key] = value, stage
    return merged


def side_log(log_dir: Path, variant: str, process: str) -> Path:
    """Where the log of a process the variant started (one of SIDE_PROCESSES) goes."""
    return log_dir / f"{variant}.{process}.log"


@dataclass(frozen=True)
class VariantResult:
    checkpoint: str
    content_key: str
    reused_checkpoint: bool
    stage_seconds: dict[str, float]
    metrics: dict[str, float]
    params: dict[str, str]
    tags: dict[str, str]
    baseline_outputs: BaselineOutputs
    artifacts: dict[str, str | bytes] = field(default_factory=dict)
    datasets: tuple[TaskDataset, ...] = ()  # the lm-eval tasks scored, as MLflow dataset inputs
