"""guidellm's own cost per load run, side by side: guidellm as quantlab starts it now against as it did before.

One variant's serve stage runs guidellm once over every load level and repeat of the recipe's serving section (the
embedded recipe's: 2 levels x 3 repeats). guidellm starts a manager and workers for every run, so most of the stage
on a CPU is guidellm, not the model. This serves the recipe's scenario against guidellm's own mock server (a fixed
time per token, so only guidellm's cost differs), alternating:

- `before`: guidellm imported early (the variant's other stages hide it), its fork server started by the first run
  and importing guidellm then, and guidellm's default scheduler start delay (1 s);
- `now`: quantlab.serving.guidellm_runner as the serve stage runs it: the fork server started and done importing
  before READY, and quantlab's start delay (quantlab.serving.load.SCHEDULER_START_DELAY_S).

For each: the early part (until READY, beside other stages in a sweep) and the timed part (scenario to report),
the runs' measured seconds and the gaps between runs, and the timed ratio now / before. Run it alone on the machine:

    .venv/bin/python benchmarks/guidellm_runs.py --checkpoint <any checkpoint folder with a tokenizer> --pairs 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The runner before the fork server was preloaded: guidellm imported early, then guidellm's own `run`.
BEFORE = """
import sys, time
from pathlib import Path
from guidellm.cli import cli
import guidellm.benchmark.entrypoints
ready, scenario = map(Path, sys.argv[1:])
ready.touch()
while not scenario.exists():
    time.sleep(0.05)
cli.main(["run", "--scenario", str(scenario), "--disable-console-interactive"], prog_name="guidellm")
"""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True, help="a model folder: its name and tokenizer")
    parser.add_argument("--recipe", type=Path, default=REPO / "recipes" / "smollm2-135m.yaml")
    parser.add_argument("--pairs", type=int, default=2, help="before/now pairs, alternated")
    return parser.parse_args(argv)


def mock_server(checkpoint: Path, output_tokens: int, log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [str(Path(sys.executable).with_name("guidellm")), "mock-server", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--model", str(checkpoint), "--output-tokens", str(output_tokens)]
    command += ["--ttft-ms", "20", "--itl-ms", "10"]
    server = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1)
            return server, url
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"guidellm's mock server did not answer; see {log}")


def one_load(way: str, spec: dict, work: Path) -> dict[str, object]:
    from quantlab.serving.load import guidellm_environment
    from quantlab.serving.load_queue import end_file, exit_file, scenario_file

    work.mkdir(parents=True)
    ready, scenarios, report = work / "imported", work / "scenario", work / "report.json"
    scenario = scenario_file(scenarios, 1)
    spec["spec"]["outputs"][0]["path"] = str(report)
    env = {**os.environ, **guidellm_environment(1)}
    runner = ["-m", "quantlab.serving.guidellm_runner"]
    if way == "before":
        env["GUIDELLM__SCHEDULER_START_DELAY_NON_DISTRIBUTED"] = "1.0"  # guidellm's default
        runner = ["-c", BEFORE]
    started = time.monotonic()
    with (work / "guidellm.log").open("w") as log:
        process = subprocess.Popen(
            [sys.executable, *runner, str(ready), str(scenario if way == "before" else scenarios)],
            stdout=log,
            stderr=log,
            env=env,
        )
        while not ready.exists():
            if process.poll() is not None:
                raise RuntimeError(f"guidellm ended before its import; see {work / 'guidellm.log'}")
            time.sleep(0.05)
        imported = time.monotonic()
        scenario.write_text(json.dumps(spec))
        if way == "now":  # the runner waits for more scenarios until told to end
            while not exit_file(scenarios, 1).exists() and process.poll() is None:
                time.sleep(0.05)
            end_file(scenarios).touch()
        if process.wait(timeout=600) != 0:
            raise RuntimeError(f"guidellm failed; see {work / 'guidellm.log'}")
    done = time.monotonic()
    runs = [(b["start_time"], b["end_time"]) for b in json.loads(report.read_text())["benchmarks"]]
    return {
        "early_s": imported - started,
        "timed_s": done - imported,
        "measured_s": sum(end - start for start, end in runs),
        "gaps_s": [runs[i + 1][0] - runs[i][1] for i in range(len(runs) - 1)],
        "runs": len(runs),
    }


def main(argv: Sequence[str] | None = None) -> int:
    from quantlab.recipe import load_recipe
    from quantlab.serving.load import scenario

    args = parse_args(argv)
    settings = load_recipe(args.recipe).recipe.serving
    work = Path(tempfile.mkdtemp(prefix="guidellm-runs-"))
    server, url = mock_server(args.checkpoint, settings.output_tokens, work / "mock.log")
    results: dict[str, list[dict]] = {"before": [], "now": []}
    try:
        for pair in range(args.pairs):
            for way in ("before", "now"):
                spec = scenario(settings, "vllm", url, args.checkpoint, None, work / "unused.json")
                found = one_load(way, spec, work / f"{way}-{pair}")
                results[way].append(found)
                gaps = ", ".join(f"{gap:.1f}" for gap in found["gaps_s"])
                print(
                    f"{way:6} pair {pair + 1}: early {found['early_s']:.1f} s, timed {found['timed_s']:.1f} s for "
                    f"{found['runs']} runs measuring {found['measured_s']:.1f} s; gaps between runs {gaps} s",
                    flush=True,
                )
    finally:
        server.terminate()
        server.wait()
    ratios = [now["timed_s"] / before["timed_s"] for before, now in zip(results["before"], results["now"])]
    print(
        f"timed now / before, per pair: {', '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f})"
    )
    early = [now["early_s"] - before["early_s"] for before, now in zip(results["before"], results["now"])]
    print(f"early part now - before, per pair: {', '.join(f'{e:+.1f}' for e in early)} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
