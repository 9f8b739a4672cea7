"""guidellm, the load generator: a scenario per variant (pure), and its run as a subprocess against a running server.

guidellm runs as its own process (`guidellm run --scenario`, started early by `LoadGenerator`), not imported: it sets
the process-wide asyncio policy to uvloop on import and spawns workers that re-import the caller's __main__.

Fixed output lengths: each engine says what a request must carry (`Engine.request_body`). guidellm drops every body
field whose value is null after merging the backend's `extras`, so an engine can remove a field guidellm adds.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from quantlab.serving.engines import ENGINES
from quantlab.serving.engines.base import post_json
from quantlab.serving.launcher import RunningServer, ServerFailed, log_tail, start_group, stop_group
from quantlab.serving.load_queue import end_file, exit_file, scenario_file, write_whole
from quantlab.serving.measured import measured_as_stated
from quantlab.serving.settings import ServingSettings

_FILE_KINDS = {".txt": "text_file", ".csv": "csv_file", ".json": "json_file", ".jsonl": "json_file"}
PROMPT_FILE_SUFFIXES = tuple(_FILE_KINDS)
SCHEDULER_START_DELAY_S = 0.2  # guidellm waits this long between its workers being ready and a level's first request


class LoadFailed(RuntimeError):
    """guidellm did not produce a report; the message ends with its log's tail."""


def request_body(engine: str, output_tokens: int) -> dict[str, Any]:
    """The fields every request carries beyond guidellm's own, so that each generates exactly `output_tokens`."""
    return ENGINES[engine].request_body(output_tokens)


def scenario(
    settings: ServingSettings,
    engine: str,
    url: str,
    checkpoint: Path,
    prompts: Path | None,
    report_path: Path,
    runs: Sequence[int] | None = None,
) -> dict[str, Any]:
    """guidellm's scenario file (`guidellm run --scenario`): the server, the workload, the load levels, the SLOs.
    `runs`: the streams of each run, in order (the concurrent profile; default: each level's serving.repeats runs)."""
    backend = {
        "kind": "openai_http",
        "target": url,
        "model": str(checkpoint),
        # Plain completions: exact prompt lengths (no chat template), and `max_tokens` honoured by both engines.
        "request_format": "/v1/completions",
        "timeout": settings.request_timeout_s,
        "extras": {"body": request_body(engine, settings.output_tokens)},
    }
    if prompts is None:
        data = {"kind": "synthetic_text", "prompt_tokens": settings.prompt_tokens}
        data["output_tokens"] = settings.output_tokens
    else:
        data = {"kind": _FILE_KINDS[prompts.suffix.lower()], "path": str(prompts)}
    constraints: list[dict[str, Any]] = [
        {"kind": "max_requests", "count": settings.requests_per_level},
        # A level whose requests all fail ends there, not after every timeout.
        {"kind": "max_errors", "count": settings.requests_per_level},
    ]
    if settings.seconds_per_level:
        constraints.append({"kind": "max_duration", "seconds": settings.seconds_per_level})
    levels = settings.concurrency
    profile, benchmarks = _profile(settings, runs)
    spec = {
        "backend": backend,
        "profile": profile,
        "constraints": constraints,
        "tokenizer": {"kind": "huggingface_auto", "model": str(checkpoint)},
        "data": [data],
        "seed": {"kind": "static", "value": settings.seed},
        "metrics": {"kind": "generative", "sample_size": max(levels) * 2},
        "outputs": [{"kind": "json", "path": str(report_path)}],
    }
    document = {"metadata": {"labels": {"quantlab": "serving"}}, "spec": spec, "benchmarks": benchmarks}
    return measured_as_stated(settings, document)  # warm-up, SLOs, goodput share: quantlab.serving.measured


def _profile(settings: ServingSettings, runs: Sequence[int] | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    levels = settings.concurrency
    if settings.profile == "sweep":
        # guidellm's sweep: synchronous, then everything at once, then constant rates between the two.
        return {"kind": "sweep", "sweep_size": settings.levels, "strategy_type": "constant"}, []
    if settings.profile == "goodput":
        search = {"kind": "goodput", "target_attainment": 0.99, "initial_streams": min(levels)}
        return search | {"max_streams": max(max(levels), min(levels) * 2)}, []
    # Each level's runs back to back (serving.repeats), from the lightest level to the heaviest.
    streams = list(runs) if runs is not None else [level for level in levels for _ in range(settings.runs_per_level())]
    return {"kind": "concurrent", "streams": streams[0]}, [{"profile.streams": each} for each in streams]


def warm_up(server: RunningServer, checkpoint: Path, settings: ServingSettings) -> None:
    """One request with the measured requests' settings before guidellm starts: the server's first request pays
    its one-time set-up (continuous batching takes its shared generation settings from it), not a measured one."""
    body = {"model": str(checkpoint), "prompt": "Hello", **request_body(server.engine, settings.output_tokens)}
    body = {key: value for key, value in body.items() if value is not None}
    try:
        post_json(f"{server.url}/v1/completions", body, settings.request_timeout_s)
    except OSError as error:
        why = server.died() or f"its log ends:\n{log_tail(server.log_path)}"
        raise ServerFailed(f"the server's first completion failed ({error}); {why}") from None


def guidellm_environment(worker_processes: int | None = None) -> dict[str, str]:
    """The variables guidellm runs under: offline, unbuffered, `worker_processes` if set (guidellm's default, up to
    10 worker processes, would crowd a CPU server's cores), and its processes forked from a fork server.

    guidellm makes a manager and its workers again for every load level; by its default ("spawn") each starts a
    fresh interpreter that imports guidellm's CLI again (several seconds of CPU each on 2 cores). Its fork server
    imports it once (quantlab.serving.guidellm_runner preloads it), and each level's processes fork from it.

    guidellm starts each level its scheduler's start delay after its workers have passed their start-up barrier;
    its default (1 s) leaves time for distributed nodes to agree, and one process needs far less. The levels' warm-up
    requests (quantlab.serving.measured) keep any late first request out of the figures."""
    found = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "GUIDELLM__MP_CONTEXT_TYPE": "forkserver"}
    found["GUIDELLM__SCHEDULER_START_DELAY_NON_DISTRIBUTED"] = str(SCHEDULER_START_DELAY_S)
    if worker_processes:
        found["GUIDELLM__MAX_WORKER_PROCESSES"] = str(worker_processes)
    return found


class LoadGenerator:
    """guidellm for one variant's load, started before its scenarios exist (quantlab.serving.guidellm_runner).

    `start()` early and guidellm's import (most of its start) runs beside the variant's other stages; each `run()`
    hands it a scenario and waits for its report: every load run of the variant (its levels' rounds, their re-runs)
    in one guidellm process. Ended, with every process it started, on exit."""

    END_WAIT_S = 10.0  # for the runner to stop its fork server (reaped: its CPU time stays the stage's) and exit

    def __init__(self, work_dir: Path, log_path: Path, worker_processes: int | None = None) -> None:
        self.work_dir, self.log_path, self.worker_processes = work_dir, log_path, worker_processes
        self._process: subprocess.Popen | None = None
        self._runs = 0  # scenarios handed so far

    def __enter__(self) -> LoadGenerator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._process is not None:
            end_file(self._scenarios).touch()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(self.END_WAIT_S)
            stop_group(self._process)

    @property
    def report_path(self) -> Path:
        """Where the next run's report goes (each run has its own)."""
        return self.work_dir / f"guidellm-{self._runs + 1}.json"

    @property
    def _ready(self) -> Path:
        return self.work_dir / "imported"

    @property
    def _scenarios(self) -> Path:
        return self.work_dir / "scenario"

    def start(self) -> None:
        if self._process is None:
            self.work_dir.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, **guidellm_environment(self.worker_processes)}
            runner = [sys.executable, "-m", "quantlab.serving.guidellm_runner", str(self._ready), str(self._scenarios)]
            # guidellm reads a .env file from its working directory: run it where there is none.
            self._process = start_group(runner, self.log_path, env, cwd=self.work_dir)

    def wait_imported(self, timeout_s: float) -> None:
        """Until guidellm is imported (or gone, or `timeout_s` passed: `run` then says what happened)."""
        deadline = time.monotonic() + timeout_s
        while self._process is not None and self._process.poll() is None and time.monotonic() < deadline:
            if self._ready.exists():
                return
            time.sleep(0.1)

    def run(
        self,
        scenario_spec: Mapping[str, Any],
        server: RunningServer,
        timeout_s: float,
        on_poll: Callable[[], object] | None = None,
    ) -> dict[str, Any]:
        """guidellm on `scenario_spec` while watching the server; its JSON report. ServerFailed if the server dies
        under load (guidellm is stopped), LoadFailed if guidellm fails, exits or runs past `timeout_s` (it is stopped,
        and runs nothing more). `on_poll`: called at each look at the server (a few times a second), e.g. to read the
        cores' load level by level."""
        self.start()
        assert self._process is not None
        report_path = Path(scenario_spec["spec"]["outputs"][0]["path"])
        self._runs += 1
        write_whole(scenario_file(self._scenarios, self._runs), json.dumps(scenario_spec, indent=2))
        finished = exit_file(self._scenarios, self._runs)
        deadline = time.monotonic() + timeout_s
        try:
            while not finished.exists():
                if self._process.poll() is not None:
                    raise LoadFailed(
                        f"guidellm exited with code {self._process.returncode}; its log ends:\n{log_tail(self.log_path)}"
                    )
                if on_poll is not None:
                    on_poll()
                if (why := server.died()) is not None:
                    raise ServerFailed(f"the server died under load: {why}")
                if time.monotonic() > deadline:
                    raise LoadFailed(f"guidellm ran past {timeout_s:.0f} s; its log ends:\n{log_tail(self.log_path)}")
                time.sleep(0.25)
        except BaseException:
            stop_group(self._process)
            raise
        if (why := server.died()) is not None:
            raise ServerFailed(f"the server died under load: {why}")
        code = int(finished.read_text())
        if code != 0 or not report_path.is_file():
            raise LoadFailed(f"guidellm exited with code {code}; its log ends:\n{log_tail(self.log_path)}")
        return json.loads(report_path.read_text())


def run_load(
    scenario_spec: Mapping[str, Any],
    work_dir: Path,
    log_path: Path,
    server: RunningServer,
    timeout_s: float,
    worker_processes: int | None = None,
) -> dict[str, Any]:
    """guidellm started now and run on `scenario_spec` (`LoadGenerator.run`)."""
    with LoadGenerator(work_dir, log_path, worker_processes) as load:
        return load.run(scenario_spec, server, timeout_s)
