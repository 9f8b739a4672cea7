"""Score an already loaded model on lm-eval tasks: every reported score, per document where that
reproduces lm-eval's figure, and each group's leaf weights. The model is wrapped, not reloaded
(`HFLM(pretrained=<model>)`), so a variant is scored exactly as it was quantized and loaded."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import numbers
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from quantlab import cache
from quantlab.evaluate.flips import AnswerKey, DocumentAnswer, document_answer, keyed
from quantlab.metrics import NO_FILTER, EvalKey, Scale
from quantlab.paired import Aggregation, DocumentScores

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

    from quantlab.serving.engines.base import Engine

# lm-eval's default seeds today, spelled out so that a change of default upstream cannot silently move our numbers.
SEEDS = {"random_seed": 0, "numpy_random_seed": 1234, "torch_random_seed": 1234, "fewshot_random_seed": 1234}
# The seeds a repeat of a sampled task sets (`repeat_seeds`): the RNGs sampling draws from. The few-shot one stays
# SEEDS': every repeat of a document asks the same prompt, so that its repeats are draws of one item.
SAMPLING_SEEDS = ("random_seed", "numpy_random_seed", "torch_random_seed")

# How much of a document's prompt to keep as its label in flip reports.
DOCUMENT_LABEL_CHARS = 200

# lm-eval aggregations (paired.Aggregation values among them) whose unit is not the score's own.
AGGREGATION_SCALES = {
    "perplexity": Scale.PERPLEXITY,
    "weighted_perplexity": Scale.PERPLEXITY,
    "bits_per_byte": Scale.BITS,
}


@dataclass(frozen=True)
class TaskRequest:
    """One task (or group, or tag) as the recipe asks for it. None = the task YAML's own setting."""

    name: str
    num_fewshot: int | None = None
    limit: int | None = None
    gen_kwargs: Mapping[str, Any] | None = None
    apply_chat_template: bool | str = False
    fewshot_as_multiturn: bool | None = None  # None: on with a chat template, as lm-eval's CLI does
    system_instruction: str | None = None
    repeats: int = 1  # runs of a sampled task, each with its own seeds (`repeat_seeds`)
    seed: int = 0  # what the repeats' seeds are derived from, with the task's name

    @property
    def multiturn(self) -> bool:
        return bool(self.apply_chat_template) if self.fewshot_as_multiturn is None else self.fewshot_as_multiturn

    def seeds(self) -> list[dict[str, int]]:
        """lm-eval's seeds for each run of the task: SEEDS once, or `repeat_seeds` for each repeat."""
        return [SEEDS] if self.repeats == 1 else [repeat_seeds(self.seed, self.name, r) for r in range(self.repeats)]


def repeat_seeds(seed: int, task: str, repeat: int) -> dict[str, int]:
    """lm-eval's seeds for repeat `repeat` (0-based) of `task`: SAMPLING_SEEDS all one number derived from (seed,
    task, repeat), the few-shot seed SEEDS'. A function of the recipe alone, so baseline and every variant sample
    with the same seeds. In process, HFLM samples from torch's global generator, which simple_evaluate seeds with
    torch_random_seed before the task runs; a served model is sent it as each request's `seed` (`score_tasks`)."""
    digest = hashlib.sha256(f"{seed}/{task}/{repeat}".encode()).digest()
    derived = int.from_bytes(digest[:4], "big") % 2**31
    return SEEDS | dict.fromkeys(SAMPLING_SEEDS, derived)


@dataclass(frozen=True)
class Score:
    """One figure lm-eval reported for a task or group: its `metric,filter`."""

    task: str
    metric: str
    filter: str
    value: float
    stderr: float | None
    higher_is_better: bool | None  # lm-eval's; None when it declared none (named, never dropped)
    scale: Scale = Scale.SCORE
    documents: DocumentScores | None = None  # leaves: per-document values that reproduce `value`
    leaves: tuple[str, ...] = ()  # groups: the leaf score keys whose weighted sum is `value`
    weights: tuple[float, ...] = ()
    note: str | None = None  # why there is no per-document analysis

    @property
    def key(self) -> str:
        return str(EvalKey(self.task, self.metric, self.filter))

    @property
    def stderr_key(self) -> str:
        return str(EvalKey(self.task, self.metric, self.filter, stderr=True))


@dataclass(frozen=True)
class TaskSettings:
    """What a leaf task actually ran with (after the YAML, the recipe's overrides and lm-eval's defaults)."""

    num_fewshot: int
    limit: int | None
    documents: int  # scored
    gen_kwargs: dict[str, Any] | None  # generation tasks only
    apply_chat_template: bool | str
    fewshot_as_multiturn: bool
    system_instruction: str | None
    version: str
    repeats: int = 1  # runs of a sampled task; one: the task ran once, with SEEDS
    seeds: tuple[int, ...] = ()  # repeats > 1: each repeat's sampling seed (`repeat_seeds`), in order

    def params(self, task: str) -> dict[str, str]:
        generation = "not used" if self.gen_kwargs is None else json.dumps(self.gen_kwargs, sort_keys=True, default=str)
        values = asdict(self) | {"gen_kwargs": generation, "seeds": ",".join(map(str, self.seeds))}
        if self.repeats == 1:  # a task run once logs what it logged before repeats existed
            values = {name: value for name, value in values.items() if name not in ("repeats", "seeds")}
        return {f"eval.{task}.{name}": str(value) for name, value in values.items()}


@dataclass(frozen=True)
class TaskDataset:
    """What a leaf task scored, as an MLflow dataset input (its digest follows config, local data files, limit)."""

    name: str
    digest: str
    source: str
    profile: str
    source_type: str = "lm-eval"


@dataclass(frozen=True)
class TaskScores:
    task: str
    scores: list[Score]  # lm-eval's order; the first is the task's primary score
    is_group: bool = False
    settings: TaskSettings | None = None  # leaves only
    dataset: TaskDataset | None = None  # leaves only
    labels: dict[int, str] = field(default_factory=dict)  # doc_id -> end of its prompt
    answers: dict[AnswerKey, DocumentAnswer] = field(default_factory=dict)  # (doc_id, repeat) -> prompt, answer, gold

    @property
    def primary(self) -> Score:
        return self.scores[0]


def known_tasks(include_path: Path | None, defaults: bool = True) -> set[str]:
    """Every name lm-eval can resolve: its tasks, groups and tags (`defaults`), plus those under include_path."""
    return set(task_manager(include_path, defaults).all_tasks) if defaults or include_path else set()


def task_index_identity(include_path: Path | None, defaults: bool = True) -> dict[str, Any]:
    """What decides `known_tasks`: lm-eval's installed version and the task files under include_path."""
    return {
        "lm_eval": version("lm-eval"),
        "include_path": str(include_path.resolve()) if include_path else None,
        "include_files": cache.tasks_digest(include_path),
    } | ({} if defaults else {"defaults": False})


@functools.cache
def task_manager(include_path: Path | None, defaults: bool = True) -> TaskManager:
    """lm-eval's task index, built once per include path per process. lm-eval's own ~10k YAMLs take
    20-30 s on 2 cores; include_path's alone (`defaults=False`) take a blink."""
    from lm_eval.tasks import TaskManager

    included = str(include_path.resolve()) if include_path is not None else None
    return TaskManager(include_path=included, include_defaults=defaults)


def task_manager_for(names: Sequence[str], include_path: Path | None) -> TaskManager:
    """The index that resolves `names` as lm-eval's whole one would, built as cheaply as that allows:
    include_path's alone when every name is a task defined there (include_path overrides lm-eval's
    own), the whole otherwise (a group or tag there may name lm-eval's tasks)."""
    if include_path is not None and set(names) <= set(task_manager(include_path, False).all_subtasks):
        return task_manager(include_path, False)
    return task_manager(include_path)


def run_tasks(
    model,
    tokenizer,
    tasks: list[TaskRequest],
    include_path: Path | None,
    batch_size: int,
    progress=lambda step: None,
    max_length: int | None = None,
) -> list[TaskScores]:
    """Score an already loaded Hugging Face `model` on each requested task (see `score_tasks`); `max_length`: HFLM's
    (`scoring_max_length`), None: lm-eval's own for the model (`model_context`)."""
    return score_tasks(hf_language_model(model, tokenizer, batch_size, max_length), tasks, include_path, progress)


def hf_language_model(model, tokenizer, batch_size: int, max_length: int | None = None):
    """lm-eval's HFLM around the already loaded `model`, as `run_tasks` scores it."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(
        pretrained=model,
        tokenizer=tokenizer,
        batch_size=batch_size,
        add_bos_token=adds_bos(tokenizer),
        max_length=max_length,
    )


# How many more tokens than HFLM's max_length lm-eval's TemplateAPI (local-completions) must be given to score the
# same windows. HFLM's max_length counts what the model is fed, and it never feeds the last scored token (the logits
# before it score it); a completion request carries that token too, since a server scores prompt tokens only, and
# generates one more, even an echo that only scores its prompt (`max_tokens: 1`). So api_models.py keeps a token for
# the generated one (`self.max_length = max_length - 1`) and its rolling windows one fewer again
# (`loglikelihood_rolling`: `max_seq_len=self.max_length - 1`).
SERVED_MAX_LENGTH_MARGIN = 2


def model_context(model, tokenizer) -> int:
    """The max_length lm-eval's HFLM takes for `model` when given none: its config's, else its tokenizer's, else
    lm-eval's default (HFLM.max_length)."""
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.utils import resolve_max_length

    return resolve_max_length(model.config, tokenizer, default=HFLM._DEFAULT_MAX_LENGTH)


def scoring_max_length(model_context: int, server_max_model_len: int | None) -> int:
    """The max_length both scoring paths score with, as HFLM counts it: the tokens of a rolling perplexity window
    (wikitext's), and the longest (context, continuation) scored. `server_max_model_len`: the longest request of the
    server the variant is also scored through (None: scored in process only, the model's own context). A served
    window is sent with SERVED_MAX_LENGTH_MARGIN more tokens, so a server's limit shortens the windows of both paths
    alike: otherwise one perplexity would be two, scored in windows of different lengths."""
    if server_max_model_len is None:
        return model_context
    length = min(model_context, server_max_model_len - SERVED_MAX_LENGTH_MARGIN)
    if length < 1:
        raise ValueError(
            f"a server that accepts {server_max_model_len} tokens a request leaves no token to score "
            f"(lm-eval sends {SERVED_MAX_LENGTH_MARGIN} beyond each window)"
        )
    return length


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer's own encoding starts with its BOS token (Llama 3's does, SmolLM2's has none): both
    scoring paths send exactly that. lm-eval's HFLM follows the tokenizer; its local-completions sends no BOS
    unless told (`add_bos_token=False` by default), which would score the served model on other inputs."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("x").input_ids[:1] == [bos]


def served_language_model(
    engine: Engine,
    url: str,
    model_name: str,
    tokenizer_path: Path,
    concurrency: int,
    max_length: int,
    batch_size: int,
):
    """The engine's lm-eval client (`engine.scoring_protocol.completions`, e.g. `local-completions`) against its
    running server: loglikelihood requests go as `echo: true, logprobs: 1` completions, `batch_size` prompts per
    request and `concurrency` requests in flight (the engine batches them), generation as plain ones; tokens are
    counted with the checkpoint's own tokenizer, read locally (no hub, no remote tokenizer endpoint). `max_length` as
    HFLM counts it (`scoring_max_length`): the requests carry the tokens HFLM given it scores, and need a server that
    accepts SERVED_MAX_LENGTH_MARGIN more."""
    from transformers import AutoTokenizer

    if engine.scoring_protocol is None:
        raise ValueError(f"{engine.label} does not score prompts: lm-eval cannot score through it")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    return _served_completions_class(engine.scoring_protocol.completions)(
        base_url=f"{url}/v1/completions",
        model=model_name,
        tokenizer_backend="huggingface",
        tokenizer=str(tokenizer_path),
        add_bos_token=adds_bos(tokenizer),
        num_concurrent=concurrency,
        batch_size=batch_size,
        # TemplateAPI's rolling windows are its max_length less the margin, and it cuts a (context, continuation)
        # pair to its max_length less one: given this, both are HFLM's at `max_length` (huggingface.py: windows of
        # `max_seq_len=self.max_length`, pairs cut to `[-(self.max_length + 1):]`).
        max_length=max_length + SERVED_MAX_LENGTH_MARGIN,
        max_retries=3,
        timeout=600,
    )


@functools.cache
def _served_completions_class(completions: str) -> type:
    """lm-eval's registered completions client `completions` (a TemplateAPI, whose windows and cuts
    SERVED_MAX_LENGTH_MARGIN aligns with HFLM's), its generation requests keeping HFLM's context: the one request type
    that one max_length cannot align. lm-eval is imported where a served model is built, not with this module."""
    from lm_eval.api.registry import get_model
    from lm_eval.models.api_models import TemplateAPI

    client = get_model(completions)
    if not issubclass(client, TemplateAPI):
        raise ValueError(f"lm-eval's {completions!r} is not a TemplateAPI client: its windows cannot be aligned")

    class ServedCompletions(client):
        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            # Both keep a context of max_length less max_gen_toks (api_models.py `max_context_len`, huggingface.py
            # `max_ctx_len`), but `self.max_length` here is HFLM's plus one (the margin less the token TemplateAPI
            # keeps for generating): a context cut at the limit would keep one token more than the reference's.
            self.max_length -= 1
            try:
                return super().generate_until(requests, disable_tqdm=disable_tqdm)
            finally:
                self.max_length += 1

    return ServedCompletions


def score_tasks(
    language_model,
    tasks: list[TaskRequest],
    include_path: Path | None,
    progress=lambda step: None,
    samples: Mapping[str, Sequence[int]] | None = None,
    cache: Path | None = None,
) -> list[TaskScores]:
    """Score `language_model` (an lm-eval LM: the loaded model, or a served one) on each requested task, in order,
    each with its own settings.

    A group (e.g. "mmlu") yields its aggregate scores under its own name (when its YAML asks
    lm-eval to aggregate), then one entry per leaf task; a tag yields its leaf tasks only.
    Requests with the same settings and no task in common share one lm-eval call (`batches`).

    `samples`: leaf task -> the documents (ids) to score, lm-eval's own selection, in place of each request's
    `limit` (a leaf not named scores all of its documents). `cache`: lm-eval's request cache (a SQLite file this
    path names), which answers a request scored before from there: a later call on more of the same documents
    scores only the new ones.
    """
    from unittest.mock import patch

    from lm_eval import evaluator
    from lm_eval.evaluator import simple_evaluate

    manager = task_manager_for([request.name for request in tasks], include_path)
    scored: dict[int, list[TaskScores]] = {}
    with contextlib.ExitStack() as restore:
        # lm-eval adds torch's environment report to every result (`add_env_info`: torch.utils.collect_env runs
        # `pip list` and other commands, seconds per call); quantlab reads none of it, and logs the
        # library versions in the variant's own params (runner).
        restore.enter_context(patch.object(evaluator, "add_env_info", lambda results: None))
        if cache is not None:
            # lm-eval's request cache hooks itself into the model, which would go on writing to it after this call.
            from lm_eval.api.model import CacheHook

            restore.callback(language_model.set_cache_hook, CacheHook(None))
        # lm-eval logs every request batch at INFO; keep its warnings (overridden settings among them).
        for logger in map(logging.getLogger, ("lm_eval", "lm-eval")):
            restore.callback(logger.setLevel, logger.level)
            logger.setLevel(logging.WARNING)
        for batch in batches(tasks, [task_names(r.name, manager.task_index) for r in tasks]):
            first = tasks[batch[0]]  # the requests of a batch have the same settings
            runs = []
            for repeat, seeds in enumerate(first.seeds()):
                shown = f" (repeat {repeat + 1} of {first.repeats})" if first.repeats > 1 else ""
                progress(_describe(first, [tasks[i].name for i in batch]) + shown)
                with _served_seed(language_model, seeds["torch_random_seed"] if first.repeats > 1 else None):
                    results = simple_evaluate(
                        model=language_model,
                        tasks=[tasks[i].name for i in batch],
                        num_fewshot=first.num_fewshot,  # None keeps the task YAML's own shots
                        limit=first.limit if samples is None else None,
                        samples={name: sorted(ids) for name, ids in samples.items()} if samples is not None else None,
                        # lm-eval's request cache would answer a later repeat with the first one's generations.
                        use_cache=str(cache) if cache is not None and first.repeats == 1 else None,
                        gen_kwargs=dict(first.gen_kwargs) if first.gen_kwargs else None,
                        apply_chat_template=first.apply_chat_template,
                        fewshot_as_multiturn=first.multiturn,
                        system_instruction=first.system_instruction,
                        log_samples=True,
                        task_manager=manager,
                        **seeds,
                    )
                if results is None:  # only non-zero ranks of a distributed run get None
                    raise RuntimeError(f"lm-eval returned no results for {', '.join(tasks[i].name for i in batch)}")
                runs.append(results)
            structure = runs[0].get("group_subtasks") or {}
            for i in batch:
                names = task_names(tasks[i].name, manager.task_index, structure)
                found = [read_results(tasks[i], restrict(results, names)) for results in runs]
                scored[i] = found[0] if len(found) == 1 else merge_repeats(found, tasks[i])
    return [task for i in range(len(tasks)) for task in scored[i]]


@contextlib.contextmanager
def _served_seed(language_model, seed: int | None) -> Iterator[None]:
    """A served model (lm-eval's TemplateAPI) sends its `_seed` with every request, where a server's sampling reads
    it; torch's seed, which simple_evaluate sets, reaches only a model in this process. None: leave it."""
    if seed is None or not hasattr(language_model, "_seed"):
        yield
        return
    kept = language_model._seed
    language_model._seed = seed
    try:
        yield
    finally:
        language_model._seed = kept


def merge_repeats(runs: Sequence[list[TaskScores]], request: TaskRequest) -> list[TaskScores]:
    """One task's scores from its repeats (pure): each score's value the mean over the repeats; a per-document mean
    score's documents `DocumentScores.of_repeats` (each document's value its mean, each repeat's kept), its stderr
    the se of the item means (items as clusters of their repeats); a score without per-document means has no
    stderr (lm-eval's are per run) and says why it has no per-document analysis. Every repeat's answers are kept, each
    marked with its repeat; labels and the dataset are the first repeat's; the settings say the repeats and seeds."""
    seeds = tuple(seeds["torch_random_seed"] for seeds in request.seeds())
    merged = []
    for tasks in zip(*runs, strict=True):
        first = tasks[0]
        if any((t.task, [s.key for s in t.scores]) != (first.task, [s.key for s in first.scores]) for t in tasks):
            raise RuntimeError(f"the repeats of {request.name} reported different scores")
        scores = [_merged_score([task.scores[index] for task in tasks]) for index in range(len(first.scores))]
        settings = replace(first.settings, repeats=len(tasks), seeds=seeds) if first.settings is not None else None
        answers = keyed(
            replace(answer, repeat=repeat) for repeat, task in enumerate(tasks, 1) for answer in task.answers.values()
        )
        merged.append(replace(first, scores=scores, settings=settings, answers=answers))
    return merged


def _merged_score(repeats: Sequence[Score]) -> Score:
    first = repeats[0]
    value = math.fsum(score.value for score in repeats) / len(repeats)
    if first.leaves:  # a group: its leaves merged alike, its weights (from document counts) the same in each repeat
        return replace(first, value=value, stderr=None)
    documents = [score.documents for score in repeats]
    if all(d is not None and d.aggregation is Aggregation.MEAN and not d.repeats for d in documents):
        try:
            items = DocumentScores.of_repeats([d.values for d in documents])  # type: ignore[union-attr]
        except ValueError:
            note = f"its {len(repeats)} repeats scored different documents"
        else:
            means = np.array(list(items.values.values()), dtype=np.float64)
            se = float(means.std(ddof=1)) / math.sqrt(means.size) if means.size > 1 else None
            return replace(first, value=value, stderr=se, documents=items, note=None)
    else:
        note = first.note or "scored in repeats: no per-document mean to average over them"
    return replace(first, value=value, stderr=None, documents=None, note=note)


def _describe(request: TaskRequest, names: list[str]) -> str:
    shots = f", {request.num_fewshot}-shot" if request.num_fewshot is not None else ""
    limit = f", first {request.limit} docs" if request.limit is not None else ""
    return f"lm-eval {', '.join(names)}{shots}{limit}"


def batches(requests: list[TaskRequest], names: list[set[str]]) -> list[list[int]]:
    """The requests (indices, in order) that can share one simple_evaluate call: the same value of every
    setting it takes for all its tasks, and no task in common (`names[i]`: request i's groups, tags and leaves).

    num_fewshot is one of those settings: lm-eval takes a per-task one only as a task config override,
    which unlike simple_evaluate's also overrides a YAML's `num_fewshot: 0`. Two requests naming a common
    task run apart: lm-eval refuses overlapping groups in one call and would score a tag's leaf once.
    """
    found: list[tuple[tuple, set[str], list[int]]] = []
    for index, (request, mine) in enumerate(zip(requests, names, strict=True)):
        key = (
            request.num_fewshot,
            request.limit,
            dict(request.gen_kwargs or {}),
            request.apply_chat_template,
            request.multiturn,
            request.system_instruction,
            request.repeats,
            request.seed,
            request.name if request.repeats > 1 else None,  # a repeat's seeds are the task's own: one task a call
        )
        batch = next((b for b in found if b[0] == key and not b[1] & mine), None)
        if batch is None:
            found.append((key, set(mine), [index]))
        else:
            batch[1].update(mine)
            batch[2].append(index)
    return [indices for _, _, indices in found]


def repeat_problem(name: str, gen_kwargs: Mapping[str, Any] | None, include_path: Path | None) -> str | None:
    """Why task (or group, or tag) `name` cannot run in repeats, or None: each of its tasks must generate (a
    loglikelihood task scores the same numbers in every run) with sampled decoding, do_sample true and a temperature
    above 0 once the recipe's `gen_kwargs` are merged over its YAML's generation_kwargs (as simple_evaluate merges
    them; HFLM decodes greedily at a temperature of 0)."""
    manager = task_manager_for([name], include_path)
    for leaf in sorted(task_names(name, manager.task_index)):
        entry = manager.task_index.get(leaf)
        if getattr(getattr(entry, "kind", None), "name", None) != "TASK" or not isinstance(entry.cfg, Mapping):
            continue
        output = entry.cfg.get("output_type", "generate_until")  # lm-eval's TaskConfig default
        if output != "generate_until":
            return f"{leaf} is scored by {output}, the same numbers in every run: only a generation task samples"
        generation = dict(entry.cfg.get("generation_kwargs") or {}) | dict(gen_kwargs or {})
        sampled, temperature = generation.get("do_sample"), generation.get("temperature", 0)
        if sampled is not True or not (_is_number(temperature) and temperature > 0):
            return (
                f"{leaf} decodes greedily (do_sample {sampled}, temperature {temperature}, its YAML's generation "
                "settings under the recipe's): set gen_kwargs do_sample: true and a temperature above 0"
            )
    return None


def task_names(name: str, index: Mapping[str, Any], structure: Mapping[str, list[str]] | None = None) -> set[str]:
    """A requested name and every group and task below it: from lm-eval's group_subtasks where a call
    reported them, else from its task index (a tag's tasks, the names a group's YAML lists)."""
    entry = index.get(name)
    kind = getattr(getattr(entry, "kind", None), "name", None)
    if structure and name in structure:
        below = structure[name]
    elif kind == "TAG":
        below = sorted(entry.tags)
    elif kind == "GROUP":
        items = (entry.cfg or {}).get("task") or []
        below = [i if isinstance(i, str) else i.get("task") or i.get("group") for i in items]
        below = [b for b in below if isinstance(b, str)]
    else:
        below = []
    return {name}.union(*(task_names(child, index, structure) for child in below))


def names_scored(names: Sequence[str], include_path: Path | None) -> set[str]:
    """Every task, group and tag that requesting `names` scores: each name and everything below it."""
    index = task_manager_for(names, include_path).task_index
    return set().union(*(task_names(name, index) for name in names))


# The sections of lm-eval's results dict that are keyed by task or group.
_PER_TASK = (
    "results",
    "groups",
    "group_subtasks",
    "configs",
    "versions",
    "n-shot",
    "higher_is_better",
    "n-samples",
    "samples",
)


def restrict(results: Mapping[str, Any], names: set[str]) -> dict[str, Any]:
    """One call's results as if only `names` had been asked for (pure)."""
    return {
        section: {t: v for t, v in value.items() if t in names}
        if section in _PER_TASK and isinstance(value, Mapping)
        else value
        for section, value in results.items()
    }


# From lm-eval's results dict to scores (pure: dicts in, dataclasses out)


def read_results(request: TaskRequest, results: Mapping[str, Any]) -> list[TaskScores]:
    """Groups first (outermost first), then leaves, as lm-eval reported them."""
    structure: Mapping[str, list[str]] = results.get("group_subtasks") or {}
    reported = results.get("results") or {}
    leaves = {task: _leaf_scores(task, request, results) for task in reported if task not in structure}
    groups = [_group_scores(group, results, structure, leaves) for group in structure if group in reported]
    return [group for group in groups if group.scores] + [leaf for leaf in leaves.values() if leaf.scores]


def _of(results: Mapping[str, Any], section: str, task: str, default: Any = None) -> Any:
    """One task's entry in a per-task section of lm-eval's results ("results", "samples", "configs", ...)."""
    return (results.get(section) or {}).get(task, default)


def _leaves_under(group: str, structure: Mapping[str, list[str]]) -> list[str]:
    """Every leaf task below a group, nested groups expanded (lm-eval aggregates over these)."""
    below = [_leaves_under(child, structure) if child in structure else [child] for child in structure.get(group, [])]
    return list(dict.fromkeys(leaf for leaves in below for leaf in leaves))


def _leaf_scores(task: str, request: TaskRequest, results: Mapping[str, Any]) -> TaskScores:
    samples: list[dict[str, Any]] = _of(results, "samples", task, [])
    scores = []
    for score in reported_scores(task, results):
        documents, note = document_scores(score.metric, score.filter, samples, score.value)
        scores.append(replace(score, scale=scale_of(score.metric, documents), documents=documents, note=note))
    primary_filter = scores[0].filter if scores else NO_FILTER
    labels = {
        int(s["doc_id"]): _document_label(s)
        for s in samples
        if s.get("filter", NO_FILTER) == primary_filter and "doc_id" in s
    }
    primary = [s for s in samples if s.get("filter", NO_FILTER) == primary_filter and isinstance(s.get("doc_id"), int)]
    answers = keyed(document_answer(s, scores[0].metric) for s in primary) if scores else {}
    settings = _settings(task, request, results)
    return TaskScores(task, scores, False, settings, _dataset(task, results, settings), labels, answers)


def _group_scores(
    group: str, results: Mapping[str, Any], structure: Mapping[str, list[str]], leaves: Mapping[str, TaskScores]
) -> TaskScores:
    """lm-eval's aggregate scores of a group, each with the leaf scores and weights that reproduce it."""
    scores = []
    for score in reported_scores(group, results):
        weighted, note = tree_weights(group, score.metric, score.filter, structure, results, leaves)
        parts = [leaf for leaf, _ in weighted or []]
        weights = [weight for _, weight in weighted] if weighted is not None else None
        if weighted is None:  # the leaves that would have counted, for the group's scale
            parts = [
                leaf
                for name in _leaves_under(group, structure)
                for leaf in (leaves[name].scores if name in leaves else [])
                if (leaf.metric, leaf.filter) == (score.metric, score.filter)
            ]
        not_means = [p for p in parts if p.documents is None or p.documents.aggregation is not Aggregation.MEAN]
        if weights is not None and not_means:
            # combine() adds weighted differences: right for means, not for perplexities.
            note = "a leaf has no per-document mean scores: " + "; ".join(
                f"{p.task}: {p.note or 'not a mean'}" for p in not_means
            )
            weights = None
        scales = {p.scale for p in parts}
        scale = scales.pop() if len(scales) == 1 else Scale.SCORE
        leaf_keys = tuple(p.key for p in parts) if weights else ()
        scores.append(replace(score, scale=scale, leaves=leaf_keys, weights=tuple(weights or ()), note=note))
    return TaskScores(group, scores, is_group=True)


def tree_weights(
    node: str,
    metric: str,
    filter_name: str,
    structure: Mapping[str, list[str]],
    results: Mapping[str, Any],
    leaves: Mapping[str, TaskScores],
) -> tuple[list[tuple[Score, float]] | None, str | None]:
    """Each leaf score's weight in `node`'s value of (`metric`, `filter_name`): down the group tree, at each group the
    weights over its children that reproduce lm-eval's value for it (size-weighted, else the plain mean: lm-eval's
    weight_by_size), multiplied along the path (a mean of sub-group means weighs a leaf by 1/children at each level).
    None and why where some group's value is reproduced by neither."""
    children: list[tuple[list[tuple[Score, float]], float, int]] = []  # (its leaves' weights within it, value, size)
    for child in structure.get(node, []):
        if child in structure:
            inner, note = tree_weights(child, metric, filter_name, structure, results, leaves)
            value = next(
                (s.value for s in reported_scores(child, results) if (s.metric, s.filter) == (metric, filter_name)),
                None,
            )
            if inner is None or value is None:
                return None, f"{child}: {note or f'lm-eval reported no {metric} for it'}"
            size = sum(leaves[leaf.task].settings.documents for leaf, _ in inner)
            children.append((inner, value, size))
        elif child in leaves:
            found = next((s for s in leaves[child].scores if (s.metric, s.filter) == (metric, filter_name)), None)
            if found is not None:  # a leaf without this metric does not count towards it, in lm-eval either
                children.append(([(found, 1.0)], found.value, leaves[child].settings.documents))
    reported = next(
        (s.value for s in reported_scores(node, results) if (s.metric, s.filter) == (metric, filter_name)), math.nan
    )
    weights, note = group_weights([value for _, value, _ in children], [size for _, _, size in children], reported)
    if weights is None:
        return None, note
    return [
        (leaf, weight * inner_weight)
        for weight, (inner, _, _) in zip(weights, children)
        for leaf, inner_weight in inner
    ], None


def reported_scores(task: str, results: Mapping[str, Any]) -> Iterator[Score]:
    """Every numeric "metric,filter" entry of a task or group, in lm-eval's order, with its stderr and direction."""
    raw = _of(results, "results", task)
    directions = _of(results, "higher_is_better", task, {})
    for key, value in raw.items():
        if "," not in key or not _is_number(value):
            continue
        metric, filter_name = key.split(",", 1)
        if metric.endswith("_stderr") and f"{metric.removesuffix('_stderr')},{filter_name}" in raw:
            continue
        stderr = raw.get(f"{metric}_stderr,{filter_name}")
        # lm-eval reports "N/A" where it has no stderr, nan for a single document, and no direction
        # (None) for a group whose leaves disagree.
        finite = float(stderr) if _is_number(stderr) and math.isfinite(float(stderr)) else None
        higher = directions.get(metric)
        yield Score(task, metric, filter_name, float(value), finite, bool(higher) if _is_bool(higher) else None)


def document_scores(
    metric: str, filter_name: str, samples: list[dict[str, Any]], reported: float
) -> tuple[DocumentScores | None, str | None]:
    """The per-document values of one metric and filter, or None and the reason.

    Accepted only when re-aggregating them reproduces `reported`: a scalar per document under a
    mean, or (loglikelihood, weight) pairs under lm-eval's weighted perplexity or bits per byte.
    """
    rows = [s for s in samples if s.get("filter", NO_FILTER) == filter_name and metric in s]
    if not rows:
        return None, "lm-eval logged no per-document values for it"
    if not math.isfinite(reported):
        return None, f"lm-eval reported {reported}"
    doc_ids = [s.get("doc_id") for s in rows]
    if any(not isinstance(d, int) for d in doc_ids) or len(set(doc_ids)) != len(doc_ids):
        return None, "documents are not identified once each by an integer doc_id"
    values = [s[metric] for s in rows]
    if all(_is_number(v) or _is_bool(v) for v in values):
        candidates = [DocumentScores(Aggregation.MEAN, {d: float(v) for d, v in zip(doc_ids, values)})]
    elif all(isinstance(v, (tuple, list)) and len(v) == 2 and all(_is_number(x) for x in v) for v in values):
        loglikelihoods = {d: float(v[0]) for d, v in zip(doc_ids, values)}
        weights = {d: float(v[1]) for d, v in zip(doc_ids, values)}
        candidates = [
            DocumentScores(aggregation, loglikelihoods, weights)
            for aggregation in (Aggregation.WEIGHTED_PERPLEXITY, Aggregation.BITS_PER_BYTE)
        ]
    else:
        return None, f"per-document values of type {type(values[0]).__name__} have no known aggregation"
    found = []
    for candidate in candidates:
        try:
            again = candidate.aggregate()
        except (ArithmeticError, ValueError, KeyError):
            continue
        if _reproduces(again, reported):
            return candidate, None
        found.append(f"{candidate.aggregation.value} {again:.6g}")
    gives = " or ".join(found) or "nothing"
    return None, f"re-aggregating the per-document values gives {gives}, lm-eval reported {reported:.6g}"


def group_weights(values: list[float], sizes: list[int], reported: float) -> tuple[list[float] | None, str | None]:
    """The leaf weights that reproduce a group's value: size-weighted first (lm-eval's default,
    and the one that makes the group one pool of documents), else the plain mean."""
    if not values:
        return None, "no leaf reports this metric"
    if not math.isfinite(reported):
        return None, f"lm-eval reported {reported}"
    candidates = [[size / sum(sizes) for size in sizes]] if sum(sizes) > 0 else []
    for weights in [*candidates, [1 / len(values)] * len(values)]:
        if _reproduces(sum(w * v for w, v in zip(weights, values)), reported):
            return weights, None
    return None, "neither the size-weighted nor the plain mean of its leaves reproduces lm-eval's group value"


def _reproduces(again: float, reported: float) -> bool:
    # Float sums in another order differ in the last bits; a different aggregation differs in the first.
    return math.isclose(again, reported, rel_tol=1e-9, abs_tol=1e-12)


def scale_of(metric: str, documents: DocumentScores | None) -> Scale:
    """FRACTION when the per-document values are 0-1 under a mean; else the unit of the aggregation that
    reproduced lm-eval's value (without one: of lm-eval's registered aggregation of the metric), or SCORE."""
    if documents is not None and documents.aggregation is Aggregation.MEAN:
        return Scale.FRACTION if all(0.0 <= v <= 1.0 for v in documents.values.values()) else Scale.SCORE
    if documents is not None:
        return AGGREGATION_SCALES.get(documents.aggregation.value, Scale.SCORE)
    import lm_eval.api.metrics  # noqa: F401  (registers lm-eval's own metrics)
    from lm_eval.api.registry import METRIC_AGGREGATION_REGISTRY

    registered = getattr(METRIC_AGGREGATION_REGISTRY.get(metric, None), "__name__", None)
    return AGGREGATION_SCALES.get(registered, Scale.SCORE)


def _settings(task: str, request: TaskRequest, results: Mapping[str, Any]) -> TaskSettings:
    config = _of(results, "configs", task, {})
    generation = config.get("generation_kwargs") if config.get("output_type") == "generate_until" else None
    return TaskSettings(
        num_fewshot=int(_of(results, "n-shot", task, config.get("num_fewshot", 0)) or 0),
        limit=request.limit,
        documents=int(_of(results, "n-samples", task, {}).get("effective", 0)),
        gen_kwargs=dict(generation) if isinstance(generation, Mapping) else None,
        apply_chat_template=request.apply_chat_template,
        fewshot_as_multiturn=request.multiturn,
        system_instruction=request.system_instruction,
        version=str(_of(results, "versions", task, "")),
    )


def _dataset(task: str, results: Mapping[str, Any], settings: TaskSettings) -> TaskDataset:
    config = _of(results, "configs", task, {})
    digest = hashlib.sha256()
    # The dumped config is the task as lm-eval ran it, includes resolved. Some functions dump
    # as their repr, whose memory address changes every process: drop the address. The code
    # of lm-eval's own task helpers comes with its version.
    dumped = json.dumps(config, sort_keys=True, default=str)
    digest.update(re.sub(r" at 0x[0-9a-fA-F]+", "", dumped).encode())
    digest.update(f"lm_eval={version('lm-eval')} limit={settings.limit}".encode())
    # dataset_kwargs.data_files: one file, a list, or split -> file(s).
    data_files = (config.get("dataset_kwargs") or {}).get("data_files") or []
    splits = data_files.values() if isinstance(data_files, Mapping) else [data_files]
    files = [str(f) for split in splits for f in ([split] if isinstance(split, str) else split)]
    for path in files:
        if Path(path).is_file():  # local data: its content, not just its name
            digest.update(Path(path).read_bytes())
    source = str(config.get("dataset_path", ""))
    if config.get("dataset_name"):
        source += f":{config['dataset_name']}"
    if files:
        source += " " + ",".join(files)
    profile = {name: getattr(settings, name) for name in ("limit", "documents", "num_fewshot", "version")}
    return TaskDataset(task, digest.hexdigest()[:16], source, json.dumps(profile, sort_keys=True))


def _is_number(value: Any) -> bool:
    # numpy floats are numbers.Real too; a bool is a 0/1 document score but never an aggregate.
    return isinstance(value, numbers.Real) and not _is_bool(value)


def _is_bool(value: Any) -> bool:
    return isinstance(value, (bool, np.bool_))


def _document_label(sample: Mapping[str, Any]) -> str:
    """The end of the document's prompt (its own question, after any few-shot examples)."""
    try:
        prompt = sample["arguments"][0][0]  # (context, continuation) or (context, generation kwargs)
    except (IndexError, KeyError, TypeError):
        prompt = ""
    return " ".join(str(prompt).split())[-DOCUMENT_LABEL_CHARS:]
