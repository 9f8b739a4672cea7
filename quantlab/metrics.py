"""The metric contract: every metric key quantlab logs, with its direction, scale and meaning.

Frontier, report, `pick` and the registry read directions and scales from here; nothing guesses from a name.
A key with no entry, or an lm-eval score whose direction was not recorded, gets direction None: callers name it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from fractions import Fraction

EVAL_PREFIX = "eval/"
PAIRED_PREFIX = "quality/paired/"
# The variant's own scores on its serving engine against the same variant loaded in transformers (evals.engine: both).
ENGINE_VS_REFERENCE_PREFIX = "quality/engine_vs_reference/"
# The baseline served twice, the second pass against the first: the engine's own variation (its floor)
ENGINE_FLOOR_PREFIX = "quality/engine_floor/"
# Token damage through the serving engine's prompt log-probabilities (quality/served/<figure of quality/...>);
# its KL is over the engine's top-k tokens plus one bucket for the rest: kld_topk_*, a lower bound of the exact KL.
SERVED_QUALITY_PREFIX = "quality/served/"
# A variant's quantized KV cache against the same checkpoint with it off (quantlab.evaluate.contexts), per token.
KV_CACHE_PREFIX = "quality/kv_cache/"
STDERR_SUFFIX = "_stderr"
# Adaptive evaluation: quality/adaptive/<task>/<figure> (the entries below), the tag quantlab.adaptive/<task> (why its
# task stopped where it did, in words) and the param eval.adaptive (the design: stages, spending, seed, level).
ADAPTIVE_PREFIX = "quality/adaptive/"
ADAPTIVE_TAG_PREFIX = "quantlab.adaptive/"
ADAPTIVE_PARAM = "eval.adaptive"
NO_FILTER = "none"


class Scale(str, Enum):
    FRACTION = "fraction"  # 0-1, shown as %, limits and differences in percentage points
    NATS = "nats"
    PERPLEXITY = "perplexity"
    BITS = "bits"
    BYTES = "bytes"
    TOKENS_PER_S = "tokens_per_s"
    REQUESTS_PER_S = "requests_per_s"
    MILLISECONDS = "ms"
    SECONDS = "s"
    JOULES = "J"
    USD = "USD"
    COUNT = "count"
    RATIO = "ratio"  # unitless ratio of two like figures
    P_VALUE = "p_value"
    SCORE = "score"  # an lm-eval score that is not a 0-1 fraction (e.g. BLEU)


@dataclass(frozen=True)
class MetricSpec:
    key: str
    entry: str  # the contract entry that declares it, e.g. "eval/<task>/<metric>[:<filter>]"
    higher_is_better: bool | None  # None: not known (named, never dropped)
    scale: Scale
    label: str

    @property
    def direction_known(self) -> bool:
        return self.higher_is_better is not None

    @property
    def timed(self) -> bool:
        """A figure timed on this machine, or derived from one: other work on the variant's cores distorts it
        (a busy host's warnings name it). The contract's column `TIMED`, by entry."""
        return self.entry in TIMED or any(self.entry.startswith(prefix) for prefix in TIMED_PREFIXES)


@dataclass(frozen=True)
class Declared:
    """What the sweep recorded about one lm-eval score: lm-eval's direction and the scale seen."""

    higher_is_better: bool | None
    scale: Scale


@dataclass(frozen=True)
class EvalKey:
    """An lm-eval score, ``eval/<task>/<metric>[:<filter>]``: lm-eval's ``metric,filter`` with a colon
    (MLflow keys allow no comma) and the filter ``none`` left out; stderr as lm-eval spells it,
    ``eval/gsm8k/exact_match_stderr:strict-match``. Its direction is lm-eval's `higher_is_better`,
    recorded with the run (see `Declared`)."""

    task: str
    metric: str
    filter: str = NO_FILTER
    stderr: bool = False

    def __str__(self) -> str:
        metric = self.metric + (STDERR_SUFFIX if self.stderr else "")
        suffix = "" if self.filter == NO_FILTER else f":{self.filter}"
        return f"{EVAL_PREFIX}{self.task}/{metric}{suffix}"

    @property
    def label(self) -> str:
        shown = self.metric if self.filter == NO_FILTER else f"{self.metric} ({self.filter})"
        return f"{self.task} {shown}" + (" stderr" if self.stderr else "")

    @classmethod
    def parse(cls, key: str) -> EvalKey | None:
        """The inverse of str(): None for a key that is not an lm-eval score."""
        task, _, last = key.removeprefix(EVAL_PREFIX).rpartition("/")
        metric, _, filter_name = last.partition(":")
        stderr = metric.endswith(STDERR_SUFFIX)
        metric = metric.removesuffix(STDERR_SUFFIX)
        if not key.startswith(EVAL_PREFIX) or not task or not metric:
            return None
        return cls(task, metric, filter_name or NO_FILTER, stderr)


def is_eval_score(key: str) -> bool:
    """`eval/<task>/<metric>[:<filter>]`, not its stderr companion."""
    parsed = EvalKey.parse(key)
    return parsed is not None and not parsed.stderr


# Paired comparisons with the baseline: quality/paired/<quality metric key>/<statistic>.
# statistic -> its scale (None: the metric's own),  # meaning
PAIRED_STATISTICS: dict[str, Scale | None] = {
    "diff": None,  # variant minus baseline, over the documents (or tokens) both scored
    "se": None,  # paired standard error of diff
    # The ends of the two-sided 95% interval of diff, the bounds a verdict judges by: from the flips for 0/1 scores of one
    # pool (Tango's score bounds, paired.flip_interval), else diff +- a t (or normal) quantile times se.
    "ci95_low": None,
    "ci95_high": None,
    # Two-sided p of no difference: exact McNemar for 0/1 scores, paired t for continuous scores,
    # z on the per-document log ratio for perplexities.
    "p_value": Scale.P_VALUE,
    "n": Scale.COUNT,  # documents (or tokens) paired
    # Degrees of freedom of se where the intervals use Student's t (continuous scores: documents - 1; per-token
    # figures: scoring windows - 1; groups: Welch-Satterthwaite); absent for 0/1 scores (normal quantile).
    "df": Scale.COUNT,
    "correct_to_wrong": Scale.COUNT,  # 0/1 scores only: documents right for the baseline, wrong for the variant
    "wrong_to_correct": Scale.COUNT,  # 0/1 scores only: documents wrong for the baseline, right for the variant
    "repeats": Scale.COUNT,  # a sampled task run in repeats (more than one): repeats per document; n counts documents
    "within_sd": None,  # repeats: the sd of one repeat's difference around its document's mean difference
}


def adaptive_key(task: str, figure: str) -> str:
    """quality/adaptive/<task>/<figure>: documents_used, documents_total, stage or level_share."""
    return f"{ADAPTIVE_PREFIX}{task}/{figure}"


def paired_key(metric_key: str, statistic: str, prefix: str = PAIRED_PREFIX) -> str:
    if statistic not in PAIRED_STATISTICS:
        raise ValueError(f"unknown paired statistic {statistic!r}; known: {sorted(PAIRED_STATISTICS)}")
    return f"{prefix}{metric_key}/{statistic}"


# Fixed keys, then templates (each <name> one path segment, filled into the label).
# key: (higher_is_better, scale, label),  # meaning
_FIXED: dict[str, tuple[bool | None, Scale, str]] = {
    "quality/ppl": (False, Scale.PERPLEXITY, "perplexity"),  # token perplexity on the quality corpus
    "quality/ppl_tokens": (None, Scale.COUNT, "scored tokens"),  # tokens scored for quality/ppl: a count, not a quality
    "quality/kld_mean": (False, Scale.NATS, "mean KL divergence"),  # mean per-token KL(baseline || variant)
    # standard error of quality/kld_mean, cluster-robust over the scoring windows
    "quality/kld_mean_stderr": (None, Scale.NATS, "mean KL stderr"),
    "quality/kld_median": (False, Scale.NATS, "median KL divergence"),  # median per-token KL
    "quality/kld_p90": (False, Scale.NATS, "p90 KL divergence"),  # 90th percentile of per-token KL
    "quality/kld_p95": (False, Scale.NATS, "p95 KL divergence"),  # 95th percentile of per-token KL
    "quality/kld_p99": (False, Scale.NATS, "p99 KL divergence"),  # 99th percentile of per-token KL
    "quality/kld_p999": (False, Scale.NATS, "p99.9 KL divergence"),  # 99.9th percentile of per-token KL
    "quality/kld_max": (False, Scale.NATS, "max KL divergence"),  # largest per-token KL
    "quality/top1_agreement": (True, Scale.FRACTION, "top-1 agreement"),  # tokens whose top-1 matches the baseline's
    # Mean of p_variant - p_baseline of the correct token. Signed: its sign says which way p(correct) moved,
    # not how much, so it has no better direction.
    "quality/delta_p_mean": (None, Scale.FRACTION, "mean change in p(correct)"),
    "quality/delta_p_rms": (False, Scale.FRACTION, "RMS change in p(correct)"),  # RMS of p_variant - p_baseline
    "quality/ln_ppl_ratio": (False, Scale.NATS, "ln(PPL ratio)"),  # difference of mean token NLLs
    # the baseline's mean probability outside the engine's top k: how much the served top-k KL bound leaves out
    "quality/served/kld_topk_tail_mass": (None, Scale.FRACTION, "served top-k KL: mass outside the top k"),
    # Tokens of one scoring window are correlated: the variance of the paired difference's mean with windows as
    # the sampled units (cluster-robust, what se and the verdicts use) over its variance were tokens independent.
    # A property of the corpus and the variant's damage, not a quality; absent for the baseline (no difference).
    "quality/ppl_design_effect": (None, Scale.RATIO, "perplexity design effect (windows)"),
    "quality/kld_mean_design_effect": (None, Scale.RATIO, "mean KL design effect (windows)"),
    "quality/top1_agreement_design_effect": (None, Scale.RATIO, "top-1 agreement design effect (windows)"),
    # By context length (quality.contexts; quantlab.evaluate.contexts): the tokens with fewer than <length> and at
    # least the previous length's tokens before them in windows of the longest. Design effects first: the figure's
    # own template would match them too.
    "quality/kld_mean/ctx<length>_design_effect": (None, Scale.RATIO, "mean KL design effect at ctx {length}"),
    "quality/top1_agreement/ctx<length>_design_effect": (None, Scale.RATIO, "top-1 design effect at ctx {length}"),
    "quality/kld_mean/ctx<length>": (False, Scale.NATS, "mean KL divergence at ctx {length}"),
    "quality/kld_p99/ctx<length>": (False, Scale.NATS, "p99 KL divergence at ctx {length}"),
    "quality/top1_agreement/ctx<length>": (True, Scale.FRACTION, "top-1 agreement at ctx {length}"),
    "quality/ppl_tokens/ctx<length>": (None, Scale.COUNT, "scored tokens at ctx {length}"),
    # On-policy damage (quality.generate; quantlab.evaluate.on_policy): teacher-forced over prompt + the baseline's
    # greedy continuation. <part>: prompt, generated, or gen<first>-<last> (generated positions, from 1). Design
    # effects first (sequences as clusters), as above.
    "quality/on_policy/<part>/kld_mean_design_effect": (None, Scale.RATIO, "on-policy mean KL design effect ({part})"),
    "quality/on_policy/<part>/top1_agreement_design_effect": (
        None,
        Scale.RATIO,
        "on-policy top-1 design effect ({part})",
    ),
    "quality/on_policy/<part>/ear_design_effect": (None, Scale.RATIO, "on-policy EAR design effect ({part})"),
    "quality/on_policy/<part>/delta_nll_design_effect": (None, Scale.RATIO, "on-policy dNLL design effect ({part})"),
    "quality/on_policy/<part>/kld_mean": (False, Scale.NATS, "on-policy mean KL divergence ({part})"),
    "quality/on_policy/<part>/top1_agreement": (True, Scale.FRACTION, "on-policy top-1 agreement ({part})"),
    # expected acceptance rate: mean over tokens of sum over the vocabulary of min(p_baseline, p_variant)
    "quality/on_policy/<part>/ear": (True, Scale.FRACTION, "on-policy expected acceptance rate ({part})"),
    # mean of variant NLL - baseline NLL of the baseline's own tokens
    "quality/on_policy/<part>/delta_nll": (False, Scale.NATS, "on-policy delta-NLL of the baseline's tokens ({part})"),
    "quality/on_policy/<part>/tokens": (None, Scale.COUNT, "on-policy scored tokens ({part})"),
    "cost/weight_bytes": (False, Scale.BYTES, "weight size"),  # *.safetensors files of the checkpoint on disk
    "cost/weight_bytes_in_memory": (False, Scale.BYTES, "weights in memory"),  # tensor payload in its stored format
    "cost/loaded_weight_bytes": (False, Scale.BYTES, "weights as loaded here"),  # parameters as loaded for measuring
    "cost/peak_memory_bytes": (False, Scale.BYTES, "peak memory"),  # while measuring: device memory on GPU, RSS on CPU
    "cost/peak_device_memory_bytes": (False, Scale.BYTES, "peak device memory"),  # accelerator memory, while measuring
    "cost/process_peak_rss_bytes": (False, Scale.BYTES, "process peak RSS"),  # of the variant's process
    "cost/measured_bandwidth_bytes_per_s": (None, Scale.SCORE, "measured copy bandwidth"),  # a property of the machine
    "cost/bits_per_weight": (False, Scale.BITS, "bits per weight"),  # stored bits per decoder-block linear weight
    "cost/bits_per_parameter": (False, Scale.BITS, "bits per parameter"),  # stored bits per parameter
    "cost/parameter_count": (None, Scale.COUNT, "parameters"),  # parameters of the model (a size, not a cost)
    "cost/kv_bytes_per_token": (False, Scale.BYTES, "KV cache per token"),  # modeled KV-cache bytes per token
    # modeled sequences that fit beside the weights on the target
    "cost/max_concurrent_sequences": (True, Scale.COUNT, "concurrent sequences on target"),
    # modeled memory-bound decode rate on the target
    "cost/roofline_decode_tokens_per_s": (True, Scale.TOKENS_PER_S, "decode roofline on target"),
    # modeled batched decode rate on the target
    "cost/serving_decode_tokens_per_s": (True, Scale.TOKENS_PER_S, "serving decode on target (modeled)"),
    "cost/usd_per_million_output_tokens": (False, Scale.USD, "USD per million output tokens"),  # modeled, on the target
    "cost/load_seconds": (False, Scale.SECONDS, "load time"),  # seconds to load the checkpoint
    # Served behind a real server under guidellm's load (quantlab.serving), on this machine. The best load level
    # meeting the recipe's service levels (serving.slo) gives goodput and the dollar figure.
    "cost/serving/usd_per_mtok": (False, Scale.USD, "USD per million output tokens (served, at goodput)"),
    # Goodput (DistServe's): the highest load level whose share of requests meeting every per-request SLO
    # reaches serving.slo.attainment (default 90%), none after the first level shown below it; its requests/s (all its requests, not only those within SLO),
    # output tokens/s and mean requests in flight. The tag quantlab.serving.goodput_definition states the SLOs.
    "cost/serving/goodput_tokens_per_s": (True, Scale.TOKENS_PER_S, "output tokens/s at goodput (SLO share met)"),
    "cost/serving/goodput_requests_per_s": (True, Scale.REQUESTS_PER_S, "goodput: requests/s with the SLO share met"),
    "cost/serving/goodput_concurrency": (True, Scale.COUNT, "requests in flight at goodput (SLO share met)"),
    "cost/serving/peak_tokens_per_s": (True, Scale.TOKENS_PER_S, "served output tokens/s at peak"),
    # the memory-bound decode ceiling on the serving hardware at the peak level's concurrency, and peak / it
    "cost/serving/modeled_tokens_per_s": (True, Scale.TOKENS_PER_S, "modeled prefill + decode ceiling (serving hw)"),
    "cost/serving/peak_vs_modeled": (True, Scale.RATIO, "served peak / modeled ceiling"),
    # One load level (c4: 4 concurrent streams; sync, max, r<rate>: guidellm's sweep levels), over its requests.
    "cost/serving/<level>/output_tokens_per_s": (True, Scale.TOKENS_PER_S, "served output tokens/s at {level}"),
    "cost/serving/<level>/requests_per_s": (True, Scale.REQUESTS_PER_S, "served requests/s at {level}"),
    # Nearest-rank percentiles, each logged only where the level's requests support it (p50 from 2, p99 from 100:
    # serving.levels.supports; the tag quantlab.serving.unavailable.<level>/<pXX> says when not); maxima always.
    "cost/serving/<level>/ttft_ms_p50": (False, Scale.MILLISECONDS, "served TTFT p50 at {level}"),
    "cost/serving/<level>/ttft_ms_p99": (False, Scale.MILLISECONDS, "served TTFT p99 at {level}"),
    "cost/serving/<level>/ttft_ms_max": (False, Scale.MILLISECONDS, "served TTFT max at {level}"),
    "cost/serving/<level>/itl_ms_p50": (False, Scale.MILLISECONDS, "served ITL p50 at {level}"),
    "cost/serving/<level>/itl_ms_p99": (False, Scale.MILLISECONDS, "served ITL p99 at {level}"),
    "cost/serving/<level>/itl_ms_max": (False, Scale.MILLISECONDS, "served ITL max at {level}"),
    "cost/serving/<level>/tpot_ms_p50": (False, Scale.MILLISECONDS, "served TPOT p50 at {level}"),
    "cost/serving/<level>/tpot_ms_p99": (False, Scale.MILLISECONDS, "served TPOT p99 at {level}"),
    "cost/serving/<level>/tpot_ms_max": (False, Scale.MILLISECONDS, "served TPOT max at {level}"),
    "cost/serving/<level>/succeeded": (None, Scale.COUNT, "requests measured at {level}"),  # after the warm-up
    "cost/serving/<level>/errors": (False, Scale.COUNT, "failed requests at {level}"),
    # cut off by serving.seconds_per_level: left out of every figure, as guidellm leaves them out
    "cost/serving/<level>/incomplete": (None, Scale.COUNT, "requests cut off at {level}"),
    # share of the level's requests meeting every per-request SLO (guidellm's count; errored ones miss)
    "cost/serving/<level>/slo_attainment": (True, Scale.FRACTION, "requests within every SLO at {level}"),
    # its exact (Clopper-Pearson) one-sided 95% bounds, from the requests judged (quantlab.serving.goodput)
    "cost/serving/<level>/slo_attainment_lower": (True, Scale.FRACTION, "95% lower bound: within SLO at {level}"),
    "cost/serving/<level>/slo_attainment_upper": (True, Scale.FRACTION, "95% upper bound: within SLO at {level}"),
    # vLLM's request goodput: requests completed within every SLO per second at the level
    "cost/serving/<level>/good_requests_per_s": (True, Scale.REQUESTS_PER_S, "requests/s within every SLO at {level}"),
    "cost/serving/<level>/concurrency": (None, Scale.COUNT, "mean requests in flight at {level}"),
    # Documents whose 0/1 score differs from the baseline's (a group: the sum of its leaves), then by direction.
    "quality/flips/<task>": (False, Scale.COUNT, "{task} answer flips"),
    "quality/flips/<task>/correct_to_wrong": (False, Scale.COUNT, "{task} right-to-wrong flips"),
    "quality/flips/<task>/wrong_to_correct": (True, Scale.COUNT, "{task} wrong-to-right flips"),
    "quality/mcnemar_p/<task>": (None, Scale.P_VALUE, "{task} McNemar p"),  # exact McNemar p of the primary 0/1 score
    # Adaptive evaluation (evals.adaptive, quantlab.adaptive), per requested task (group, tag) and each task under it:
    # documents it scored and has, the stage it stopped at (1-based), and that stage's nominal one-sided level as a
    # share of the policy's: the final verdict tests the drop limits on its scores at the policy's levels times it.
    "quality/adaptive/<task>/documents_used": (None, Scale.COUNT, "{task} documents scored (adaptive)"),
    "quality/adaptive/<task>/documents_total": (None, Scale.COUNT, "{task} documents it has (adaptive)"),
    "quality/adaptive/<task>/stage": (None, Scale.COUNT, "{task} stage it stopped at (adaptive)"),
    "quality/adaptive/<task>/level_share": (None, Scale.RATIO, "{task} level share of its last stage (adaptive)"),
    "time/<stage>_seconds": (False, Scale.SECONDS, "{stage} time"),  # wall seconds of one stage of the variant's run
    # What competed with the measure stage's timed generations (measure.contention): facts about the machine.
    "measure/load_1m": (None, Scale.RATIO, "1-minute load average while timing"),  # the higher, before or after
    "measure/cpu_seconds_per_wall_second": (None, Scale.RATIO, "own CPU s per wall s while timing"),
    "measure/other_cores_busy": (None, Scale.RATIO, "cores other work kept busy while timing"),
    "measure/threads": (None, Scale.COUNT, "torch threads while timing"),
    # The same facts while the serve stage timed its load (the server and guidellm are its own work)
    "measure/serve/load_1m": (None, Scale.RATIO, "1-minute load average while serving"),
    "measure/serve/cpu_seconds_per_wall_second": (None, Scale.RATIO, "the load's own CPU s per wall s"),
    "measure/serve/other_cores_busy": (None, Scale.RATIO, "cores other work kept busy while serving"),
    "measure/serve/threads": (None, Scale.COUNT, "the server's threads while serving"),
}
# A load level run several times (serving.repeats): how many runs its figures pool, and a served figure's two-sided
# 95% t interval over them (quantlab.serving.intervals), whose ends follow the figure's direction.
_FIXED["cost/serving/<level>/runs"] = (None, Scale.COUNT, "runs of {level}")
# Where a level's runs went in rounds across the sweep's variants (serving.interleave), the figures a decision reads
# are also logged run by run, `<figure>/round_<n>`: the frontier pairs a variant's round n with another's.
SERVING_ROUND_FIGURES = (
    "cost/serving/goodput_tokens_per_s",
    "cost/serving/goodput_requests_per_s",
    "cost/serving/usd_per_mtok",
)
SERVING_INTERVAL_FIGURES = (
    *(
        f"cost/serving/<level>/{figure}"
        for figure in ("output_tokens_per_s", "requests_per_s", "ttft_ms_p50", "itl_ms_p50", "good_requests_per_s")
    ),
    *SERVING_ROUND_FIGURES,
)


def _companions(figures: Sequence[str], ends: Mapping[str, str]) -> dict[str, tuple[bool | None, Scale, str]]:
    """Each figure's companion entries (`<figure>/<end>`), in its direction and scale, labelled with the end's words."""
    return {
        f"{figure}/{end}": (*_FIXED[figure][:2], f"{_FIXED[figure][2]}, {words}")
        for figure in figures
        for end, words in ends.items()
    }


_FIXED |= _companions(SERVING_INTERVAL_FIGURES, {"ci95_low": "95% interval low", "ci95_high": "95% interval high"})
_FIXED |= _companions(SERVING_ROUND_FIGURES, {"round_<round>": "round {round}"})
_PATTERNS = {re.compile(re.sub(r"<(\w+)>", r"(?P<\1>[^/]+)", re.escape(entry))): entry for entry in _FIXED}

# The entries timed on this machine (MetricSpec.timed): the measure stage's batch figures, the load and copy timings,
# the stages' wall seconds, and every served figure (under load, against the clock: throughputs, latencies, goodput
# and its price, requests cut off or failed). Not timed: sizes, memory, modeled figures, quality, measure/* (facts
# about the machine while timing).
# The measure stage's figures, per batch size, and the ends of their intervals over its repeats (_BATCH_KEY below)
BATCH_ENTRY, BATCH_INTERVAL_ENTRY = "cost/<figure>[_bs<N>]", "cost/<figure>[_bs<N>]/<end>"
BATCH_ROUND_ENTRY = "cost/<figure>[_bs<N>]/round_<n>"  # the serve stage's single-stream runs, in rounds
BATCH_ENTRIES = (BATCH_ENTRY, BATCH_INTERVAL_ENTRY, BATCH_ROUND_ENTRY)
TIMED = frozenset(
    {
        *BATCH_ENTRIES,
        "cost/load_seconds",
        "cost/measured_bandwidth_bytes_per_s",
        "time/<stage>_seconds",
    }
)
TIMED_PREFIXES = ("cost/serving/",)
# cost/serving/workload/<workload>/<figure>: a serving figure of one named workload (the plain keys are the first's)
WORKLOAD_PREFIX = "cost/serving/workload/"

# Figures the measure stage measured on this machine (see the run's quantlab.cost.* tags), once per batch
# size: `cost/<figure>` and `cost/<figure>_bs<N>`.
_BATCH_FIGURES: dict[str, tuple[bool, Scale, str]] = {
    "prefill_tokens_per_s": (True, Scale.TOKENS_PER_S, "prefill throughput"),
    "decode_tokens_per_s": (True, Scale.TOKENS_PER_S, "decode throughput"),
    **{
        f"{figure}_ms_p{q}": (False, Scale.MILLISECONDS, f"{label} (p{q})")
        for figure, label in (("ttft", "time to first token"), ("itl", "inter-token latency"))
        for q in (50, 90, 99)
    },
    "energy_joules_per_token": (False, Scale.JOULES, "energy per output token"),
    "local_roofline_decode_tokens_per_s": (True, Scale.TOKENS_PER_S, "decode roofline here"),
    "roofline_efficiency": (True, Scale.FRACTION, "roofline efficiency"),
}
_BATCH_KEY = re.compile(
    r"^cost/(?P<figure>[a-z0-9_]+?)(?:_bs(?P<batch>\d+))?(?:/(?P<end>ci95_low|ci95_high|round_\d+))?$"
)
# The batch figures logged with a 95% t interval over the measure stage's repeats (quantlab.measure.cost)
BATCH_INTERVAL_FIGURES = ("prefill_tokens_per_s", "decode_tokens_per_s")
# quality/recovery/<task>/<metric>[:<filter>]: variant score / baseline score (above 1 is worse for lower-is-better scores)
_RECOVERY = re.compile(r"^quality/recovery/(?P<score>[^/]+/[^/]+)$")


def spec(key: str, declared: Mapping[str, Declared] | None = None) -> MetricSpec:
    """The contract entry of a logged key. `declared`: what the sweep recorded for lm-eval scores."""
    declared = declared or {}
    if key.startswith(WORKLOAD_PREFIX):  # a named request shape's serving figures (serving.workloads)
        name, _, figure = key.removeprefix(WORKLOAD_PREFIX).partition("/")
        base = spec("cost/serving/" + figure)
        if name and base.entry:
            entry = WORKLOAD_PREFIX + "<workload>/" + base.entry.removeprefix("cost/serving/")
            return MetricSpec(key, entry, base.higher_is_better, base.scale, f"{base.label}, {name} workload")
    for pattern, entry in _PATTERNS.items():
        if (match := pattern.fullmatch(key)) is not None:
            higher, scale, label = _FIXED[entry]
            return MetricSpec(key, entry, higher, scale, label.format(**match.groupdict()))
    if (parsed := EvalKey.parse(key)) is not None:
        # A stderr key (lm-eval's unpaired standard error; quantlab's verdicts use the paired ones): its score's scale.
        found = declared.get(str(replace(parsed, stderr=False)), Declared(None, Scale.SCORE))
        higher = None if parsed.stderr else found.higher_is_better  # lm-eval's higher_is_better
        entry = "eval/<task>/<metric>" + (STDERR_SUFFIX if parsed.stderr else "") + "[:<filter>]"
        return MetricSpec(key, entry, higher, found.scale, parsed.label)
    # A difference is better the more it favours the variant (or the quantized KV cache) in the metric's direction;
    # engine and reference should agree: neither way of differing is better.
    for prefix, describe, directional in (
        (PAIRED_PREFIX, "paired", True),
        (ENGINE_VS_REFERENCE_PREFIX, "engine - reference, paired", False),
        (ENGINE_FLOOR_PREFIX, "engine - engine (the baseline served twice), paired", False),
        (KV_CACHE_PREFIX, "KV cache quantized - not, paired", True),
    ):
        metric_key, _, statistic = key.removeprefix(prefix).rpartition("/")
        if key.startswith(prefix) and metric_key and statistic in PAIRED_STATISTICS:
            base = spec(metric_key, declared)
            higher = base.higher_is_better if directional and statistic in ("diff", "ci95_low", "ci95_high") else None
            scale = PAIRED_STATISTICS[statistic] or base.scale
            label = f"{base.label}: {describe} {statistic}"
            return MetricSpec(key, f"{prefix}<metric>/{statistic}", higher, scale, label)
    if key.startswith(ENGINE_FLOOR_PREFIX + "served/"):
        base = spec(SERVED_QUALITY_PREFIX + key.removeprefix(ENGINE_FLOOR_PREFIX + "served/"), declared)
        if base.entry:
            label = f"{base.label}, the baseline served twice"
            return MetricSpec(key, "quality/engine_floor/served/<figure>", None, base.scale, label)
    if key.startswith(SERVED_QUALITY_PREFIX):
        figure = key.removeprefix(SERVED_QUALITY_PREFIX)
        base = spec("quality/" + figure.replace("kld_topk_", "kld_").replace("ear_topk", "ear"), declared)
        if base.entry:
            bound = " (top-k, a lower bound)" if "kld_topk_" in figure else ""
            bound = " (top-k, an upper bound)" if figure.endswith("ear_topk") else bound
            return MetricSpec(
                key, "quality/served/<figure>", base.higher_is_better, base.scale, f"served {base.label}{bound}"
            )
    if (match := _RECOVERY.match(key)) is not None:
        base = spec(EVAL_PREFIX + match["score"], declared)
        entry = "quality/recovery/<task>/<metric>[:<filter>]"
        return MetricSpec(key, entry, base.higher_is_better, Scale.RATIO, f"{base.label} recovery")
    if (match := _BATCH_KEY.match(key)) is not None and match["figure"] in _BATCH_FIGURES:
        higher, scale, label = _BATCH_FIGURES[match["figure"]]
        label += f" at batch {match['batch']}" if match["batch"] else ""
        if match["end"] is None:
            return MetricSpec(key, BATCH_ENTRY, higher, scale, label)
        if match["figure"] in BATCH_INTERVAL_FIGURES and match["end"].startswith("round_"):
            number = match["end"].removeprefix("round_")
            return MetricSpec(key, BATCH_ROUND_ENTRY, higher, scale, f"{label}, round {number}")
        if match["figure"] in BATCH_INTERVAL_FIGURES:
            side = match["end"].removeprefix("ci95_")
            return MetricSpec(key, BATCH_INTERVAL_ENTRY, higher, scale, f"{label}, 95% interval {side}")
    return MetricSpec(key, "", None, Scale.SCORE, key)  # not in quantlab's metric contract


def has_entry(key: str, declared: Mapping[str, Declared] | None = None) -> bool:
    """Whether the contract declares the key (lm-eval scores: with a recorded direction)."""
    found = spec(key, declared)
    return bool(found.entry) and (not is_eval_score(key) or found.direction_known)


def unknown_directions(keys: Iterable[str], declared: Mapping[str, Declared] | None = None) -> list[str]:
    """Quality scores among `keys` whose direction nobody declared: to be named, not dropped."""
    return sorted(key for key in keys if is_eval_score(key) and not spec(key, declared).direction_known)


# How declarations travel with a run: tag `quantlab.metric/<score key>` = "higher|lower|unknown <scale>".
DECLARED_TAG_PREFIX = "quantlab.metric/"
_DIRECTION_WORDS = {True: "higher", False: "lower", None: "unknown"}


def declared_tags(declared: Mapping[str, Declared]) -> dict[str, str]:
    return {
        f"{DECLARED_TAG_PREFIX}{key}": f"{_DIRECTION_WORDS[d.higher_is_better]} {d.scale.value}"
        for key, d in declared.items()
    }


def declared_from_tags(tags: Mapping[str, str]) -> dict[str, Declared]:
    directions = {word: higher for higher, word in _DIRECTION_WORDS.items()}
    found: dict[str, Declared] = {}
    for tag, value in tags.items():
        if not tag.startswith(DECLARED_TAG_PREFIX):
            continue
        direction, _, scale = value.partition(" ")
        try:
            found[tag.removeprefix(DECLARED_TAG_PREFIX)] = Declared(directions[direction], Scale(scale))
        except (KeyError, ValueError):
            continue  # a tag this version cannot read counts as undeclared, and gets named
    return found


def supports(percentile: float, requests: int) -> bool:
    """Whether `requests` observations support a nearest-rank `percentile` (0-100): its rank, ceil(q n / 100), falls
    below the top one, i.e. n >= 100 / (100 - q) - p50 from 2 requests, p90 from 10, p99 from 100. Below that, what
    is called the percentile is the maximum (or, interpolated, next to it): no percentile of that name is logged."""
    q = Fraction(str(percentile))
    return requests > 0 and math.ceil(q * requests / 100) < requests


def min_requests(percentile: float) -> int:
    """The fewest observations that support `percentile` (`supports`)."""
    return math.ceil(100 / (100 - Fraction(str(percentile))))


COST_TAG_PREFIX = "quantlab.cost."  # tags of the measure stage's figures; + "unavailable.<figure>": why one is absent
SERVING_TAG_PREFIX = "quantlab.serving."  # the serve stage's, alike


# The serve stage's load levels still contended after its re-runs: comma-separated labels, and each one's reason.
CONTENDED_LEVELS_TAG = SERVING_TAG_PREFIX + "contended_levels"
LEVEL_CONTENTION_TAG = SERVING_TAG_PREFIX + "contention."  # + level
# "<level>: <key>, <key>": the batch-1 figures (`cost/...`) the serve stage took from its single-stream level
SINGLE_STREAM_FIGURES_TAG = SERVING_TAG_PREFIX + "single_stream_figures"
# Served figures that rest on every level: goodput stops at the first level shown below the SLO share, and the peak
# is the fastest of them.
_ALL_LEVELS = ("usd_per_mtok", "goodput_tokens_per_s", "goodput_requests_per_s", "goodput_concurrency")
_ALL_LEVELS += ("peak_tokens_per_s", "peak_vs_modeled")


def rests_on_contention(metric: str, tags: Mapping[str, str]) -> str | None:
    """Why `metric` rests on a contended load level (other work competed with it, or it slowed while timed: the run's
    tags say which, after the serve stage's re-runs); None when it does not. Such a figure is logged, and no frontier
    or choice rests on it."""
    if metric.startswith(WORKLOAD_PREFIX):  # a named workload's: its own tags, `quantlab.serving.workload/<name>/...`
        name, _, figure = metric.removeprefix(WORKLOAD_PREFIX).partition("/")
        scope = f"{SERVING_TAG_PREFIX}workload/{name}/"
        own = {
            SERVING_TAG_PREFIX + tag.removeprefix(scope): value for tag, value in tags.items() if tag.startswith(scope)
        }
        why = rests_on_contention("cost/serving/" + figure, own)
        return None if why is None else why.replace("cost/serving/" + figure, metric, 1)
    levels = [label for label in tags.get(CONTENDED_LEVELS_TAG, "").split(",") if label]
    if not levels:
        return None
    figure = metric.removeprefix("cost/serving/")
    first = figure.split("/")[0]
    if figure != metric:
        found = [first] if first in levels else levels if first in _ALL_LEVELS else []
    else:
        level, _, keys = tags.get(SINGLE_STREAM_FIGURES_TAG, "").partition(": ")
        found = [level] if level in levels and metric.split("/ci95_")[0] in keys.split(", ") else []
    if not found:
        return None
    shown = ", ".join(found)
    return (
        f"{metric} rests on load level {shown}, timed while contended "
        f"({tags.get(LEVEL_CONTENTION_TAG + found[0], 'contended').removeprefix('contended: ')})"
    )


def why_unavailable(metric: str, tags: Mapping[str, str]) -> str | None:
    """Why a run logged no `metric` (`cost/<figure>` or `cost/serving/<figure>`), as the run's tags say; None if
    they do not."""
    figure = metric.removeprefix("cost/")
    serving = figure.removeprefix("serving/")
    keys = [f"{SERVING_TAG_PREFIX}unavailable.{serving}"] if serving != figure else []
    return next((tags[key] for key in [*keys, f"{COST_TAG_PREFIX}unavailable.{figure}"] if key in tags), None)


def contract_digest() -> str:
    """A hash of what the contract declares a run logs: every entry with its direction and scale, the batch figures,
    the paired statistics. Labels are left out (they only name a figure). Part of a variant's results version
    (plan.results_version): a figure added or redefined here changes it, so a sweep recomputes a run logged before
    rather than copying one that lacks the figure."""
    import hashlib
    import json

    declared = {
        "fixed": {entry: [higher, scale.value] for entry, (higher, scale, _) in _FIXED.items()},
        "batch": {figure: [higher, scale.value] for figure, (higher, scale, _) in _BATCH_FIGURES.items()},
        "batch_intervals": list(BATCH_INTERVAL_FIGURES),
        "paired": {name: scale.value if scale else None for name, scale in PAIRED_STATISTICS.items()},
    }
    return hashlib.sha256(json.dumps(declared, sort_keys=True).encode()).hexdigest()[:16]


class Shown(str, Enum):
    """Where a figure is shown beyond its run: each list of figures a reader sees is derived from `SHOWN`."""

    FRONTIER_COST = "a cost axis of the frontiers"
    FRONTIER_DAMAGE = "a token-damage axis of the frontiers, beside the task scores"
    REPORT_COST = "the report's key costs, and the figures `pick` prints"
    SERVING_TABLE = "the report's serving table"
    REGISTRY = "the registered model version's summary"
    RUNS_TABLE = "the columns of the MLflow runs table's view that `publish` saves"
    SENSITIVITY = "each layer group's damage in `quantlab sensitivity`"
    BY_CONTEXT = "paired per context-length bucket (quality.contexts)"


# Figure (a contract key) -> where it is shown; the order of the keys is the order each place lists them in.
SHOWN: dict[str, frozenset[Shown]] = {
    "quality/kld_mean": frozenset({Shown.FRONTIER_DAMAGE, Shown.REGISTRY, Shown.SENSITIVITY, Shown.BY_CONTEXT}),
    "quality/kld_p99": frozenset({Shown.SENSITIVITY}),
    "quality/top1_agreement": frozenset({Shown.FRONTIER_DAMAGE, Shown.REGISTRY, Shown.SENSITIVITY, Shown.BY_CONTEXT}),
    "quality/ppl": frozenset({Shown.FRONTIER_DAMAGE, Shown.SENSITIVITY}),
    "cost/weight_bytes": frozenset({Shown.FRONTIER_COST, Shown.REPORT_COST, Shown.REGISTRY, Shown.RUNS_TABLE}),
    "cost/decode_tokens_per_s": frozenset({Shown.FRONTIER_COST, Shown.REPORT_COST, Shown.REGISTRY}),
    "cost/peak_memory_bytes": frozenset({Shown.REPORT_COST}),
    "cost/serving/goodput_tokens_per_s": frozenset({Shown.REPORT_COST, Shown.SERVING_TABLE, Shown.RUNS_TABLE}),
    "cost/serving/goodput_concurrency": frozenset({Shown.SERVING_TABLE}),
    "cost/serving/usd_per_mtok": frozenset(
        {Shown.FRONTIER_COST, Shown.REPORT_COST, Shown.SERVING_TABLE, Shown.RUNS_TABLE}
    ),
    "cost/serving/peak_tokens_per_s": frozenset({Shown.SERVING_TABLE}),
    "cost/serving/peak_vs_modeled": frozenset({Shown.SERVING_TABLE}),
}


def shown_in(place: Shown) -> tuple[str, ...]:
    """The figures shown at `place`, in `SHOWN`'s order."""
    return tuple(key for key, places in SHOWN.items() if place in places)
