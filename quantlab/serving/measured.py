"""What guidellm measures at each load level and how it judges each request, set on its scenario: a warm-up that
it leaves out of every figure, the recipe's per-request SLOs for its attainment count, and the recipe's share for
its own goodput search. Pure.

guidellm's warm-up of W requests (a profile's `warmup`, counted in requests) ends when W + 1 requests have
completed, and its measured window opens then: the W + 1 requests that completed first are left out of every
figure, and requests still in flight are measured (windows overlap). At a concurrent level of c streams the first
c requests are batched together and end nearly at once, so with W = c some of them would be measured, by a race.
With W >= 2c every one of them is left out: a second-wave request starts when its own stream's first one ends and
takes a whole generation, so the first wave has ended before 2c + 1 requests have (seen on transformers serve, 4
streams, W = 8: the first 9 to complete, two whole waves, left out; 23 of 32 measured).

guidellm takes one warm-up setting for all levels of a run, but each level's own request count: the warm-up is a
share of each level's requests (one of WARMUP_SHARES, the one that sends the fewest requests in all), and a level
sends enough that its share covers two waves of its streams and leaves at least serving.requests_per_level
measured, TTFT included (guidellm windows TTFT by first tokens: requests in flight when the window opens count in
the other figures, not in TTFT's). A quarter suits many requests per level; a half suits few, where the two waves
are most of what a level sends (a level run several times, serving.repeats, sends them in every run). guidellm's
count of what it measured is logged (`cost/serving/<level>/succeeded`).
"""

from __future__ import annotations

import copy
import math
from fractions import Fraction
from typing import Any

from quantlab.serving.settings import ServiceLevels, ServingSettings

# Exact in binary, so guidellm's int(share * requests) is the warm-up asked for; the first is taken on a tie.
WARMUP_SHARES = (Fraction(1, 4), Fraction(1, 2))
WARMUP_SHARE = WARMUP_SHARES[0]
WARMUP_WAVES = 2


def level_requests(settings: ServingSettings, streams: int | None, share: Fraction = WARMUP_SHARE) -> tuple[int, int]:
    """(requests a level sends, the first of them guidellm leaves out as its warm-up): the warm-up is `share` of the
    requests, at least two waves of the level's `streams` (None: guidellm's sweep and goodput search, whose levels
    have no fixed streams), and leaves at least serving.requests_per_level measured."""
    # Left out besides the warm-up: the one more that completes before the window opens, and for TTFT (windowed by
    # first tokens) the up to streams - 1 others in flight then.
    extra = max(1, streams or 0)
    measured_per_warmup = (1 - share) / share
    warmup = max(WARMUP_WAVES * (streams or 0), math.ceil((settings.requests_per_level + extra) / measured_per_warmup))
    return int(warmup / share), warmup


def warmup_share(settings: ServingSettings) -> Fraction:
    """The share of WARMUP_SHARES with which the run's levels send the fewest requests in all (`level_requests`)."""
    streams: list[int | None] = list(settings.concurrency) if settings.profile == "concurrent" else [None]
    return min(WARMUP_SHARES, key=lambda share: sum(level_requests(settings, each, share)[0] for each in streams))


def guidellm_slo(slo: ServiceLevels) -> dict[str, float]:
    """guidellm's per-request objectives: its `tpot_ms` is compared with each request's inter-token latency."""
    return {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.itl_ms}


def measured_as_stated(settings: ServingSettings, document: dict[str, Any]) -> dict[str, Any]:
    """guidellm's scenario `document` (load.scenario) with the warm-up, each level's requests (`level_requests`) and
    no more made ahead, the recipe's SLOs and, for guidellm's goodput search, the recipe's share."""
    found = copy.deepcopy(document)
    spec = found["spec"]
    spec["metrics"]["slo"] = guidellm_slo(settings.slo)
    profile = spec["profile"]
    if profile["kind"] == "goodput":
        profile["target_attainment"] = settings.slo.attainment
    share = warmup_share(settings)
    profile["warmup"] = {"percent": float(share), "mode": "requests"}
    [limit] = [i for i, constraint in enumerate(spec["constraints"]) if constraint["kind"] == "max_requests"]
    if profile["kind"] == "concurrent":  # guidellm's list-capable override: one request count per level
        for level in found["benchmarks"]:
            level[f"constraints[{limit}].count"] = level_requests(settings, level["profile.streams"], share)[0]
        sent = [level[f"constraints[{limit}].count"] for level in found["benchmarks"]]
    else:
        spec["constraints"][limit]["count"] = level_requests(settings, None, share)[0]
        sent = [spec["constraints"][limit]["count"]]
    # guidellm's data worker makes each level's requests ahead of need, 4096 by default: on a CPU that is seconds of
    # tokenizing per level beside the server under load (benchmarks/README.md, "guidellm's overhead"). What the
    # busiest level sends is enough; the worker makes more as they go if a level sends more.
    spec["data_loader"] = {"kind": "pytorch", "prefetch_factor": max(sent)}
    return found
