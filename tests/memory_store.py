"""A FAKE tracking store: quantlab.tracking.TrackingStore's primitives in plain dicts, for fast tests.

Not MLflow. It keeps what quantlab logs (runs, tags, metrics, params, artifacts, dataset
inputs, registered versions) in memory so that sweep bookkeeping, publish and pick can be tested
without a database or a server. It follows TrackingStore where quantlab relies on it: search
returns runs newest first, a run's tags include mlflow.parentRunId and mlflow.runName, logging
twice overwrites. test_tracking_door.py runs the same checks on both stores to keep them alike.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable
from dataclasses import replace

from quantlab.tracking import PARENT, DatasetRecord, RunRecord, metric_dataset, safe_key


class MemoryStore:
    """A fake TrackingStore (see the module docstring): everything lives in this object."""

    def __init__(self, uri: str = "memory://"):
        self.uri = uri
        self._experiments: dict[str, str] = {}  # id -> name
        self._experiment_tags: dict[str, dict[str, str]] = {}  # id -> key -> value
        self._runs: dict[str, RunRecord] = {}  # its dicts updated in place, a copy handed out
        self._artifacts: dict[str, dict[str, bytes]] = {}  # run id -> name -> content
        self._versions: dict[str, dict[str, dict[str, str]]] = {}  # model -> version -> tags
        self.aliases: dict[tuple[str, str], str] = {}  # (model, alias) -> version
        self.sources: dict[tuple[str, str], tuple[str, str]] = {}  # (model, version) -> (source, run id)
        self.descriptions: dict[tuple[str, str], str] = {}  # (model, version) -> its description
        self._models: dict[str, dict] = {}  # logged model id -> as TrackingStore.logged_models lists it
        self._ids = itertools.count(1)
        # Strictly increasing start and end times: newest first is well defined.
        self._clock = itertools.count(1_700_000_000_000)

    def experiment_id(self, name: str, create: bool = True) -> str | None:
        found = next((id_ for id_, known in self._experiments.items() if known == name), None)
        if found is None and create:
            found = str(next(self._ids))
            self._experiments[found] = name
        return found

    def experiments(self) -> dict[str, str]:
        return dict(self._experiments)

    def experiment_tags(self, experiment_id: str) -> dict[str, str]:
        return dict(self._experiment_tags.get(experiment_id, {}))

    def set_experiment_tag(self, experiment_id: str, key: str, value: str) -> None:
        self._experiment_tags.setdefault(experiment_id, {})[key] = value

    def start_run(self, experiment_id: str, name: str, tags: dict[str, str], parent: str | None = None) -> str:
        run_id = f"run{next(self._ids)}"
        all_tags = {"mlflow.runName": name, **tags, **({PARENT: parent} if parent else {})}
        self._runs[run_id] = RunRecord(run_id, experiment_id, name, "RUNNING", next(self._clock), {}, {}, all_tags)
        self._artifacts[run_id] = {}
        return run_id

    def log_values(
        self,
        run_id: str,
        metrics: dict[str, float] | None = None,
        params: dict[str, str] | None = None,
        tags: dict[str, str] | None = None,
        model_id: str | None = None,
        datasets: Iterable[DatasetRecord] = (),
    ) -> None:
        run = self._runs[run_id]
        run.metrics.update({safe_key(key): float(value) for key, value in (metrics or {}).items()})
        if model_id is not None:
            digests = {item.name: item.digest for item in datasets}
            for key, value in (metrics or {}).items():
                on = metric_dataset(key, digests)
                self._models[model_id]["metrics"].append((safe_key(key), float(value), on, digests.get(on)))
        run.params.update({safe_key(key): str(value)[:6000] for key, value in (params or {}).items()})
        run.tags.update({key: str(value) for key, value in (tags or {}).items()})

    def log_files(self, run_id: str, files: dict[str, str | bytes]) -> None:
        for name, content in files.items():
            self._artifacts[run_id][name] = content if isinstance(content, bytes) else content.encode("utf-8")

    def log_datasets(self, run_id: str, datasets: Iterable) -> None:
        run = self._runs[run_id]
        self._runs[run_id] = replace(run, datasets=run.datasets + tuple(map(DatasetRecord.of, datasets)))

    def create_external_model(
        self, experiment_id: str, name: str, run_id: str, tags: dict[str, str], params: dict[str, str]
    ) -> str:
        model_id = f"m-{next(self._ids)}"
        self._models[model_id] = {
            "model_id": model_id,
            "name": name,
            "source_run_id": run_id,
            "experiment_id": experiment_id,
            "tags": {"mlflow.model.isExternal": "true", **tags},
            "params": {safe_key(key): str(value)[:6000] for key, value in params.items()},
            "metrics": [],
        }
        return model_id

    def set_model_tags(self, model_id: str, tags: dict[str, str]) -> None:
        self._models[model_id]["tags"].update(tags)

    def logged_models(self, experiment_id: str) -> list[dict]:
        found = [model for model in self._models.values() if model["experiment_id"] == experiment_id]
        return [{k: v for k, v in copy.deepcopy(model).items() if k != "experiment_id"} for model in found]

    def finish(self, run_id: str, status: str) -> None:
        self._runs[run_id] = replace(self._runs[run_id], status=status, end_time=next(self._clock))

    def run(self, run_id: str) -> RunRecord:
        return copy.deepcopy(self._runs[run_id])

    def search(
        self, experiment_ids: list[str], tags: dict[str, str], status: str | None = None, limit: int = 5000
    ) -> list[RunRecord]:
        found = [
            self.run(run_id)
            for run_id, run in self._runs.items()
            if run.experiment_id in experiment_ids
            and (status is None or run.status == status)
            and all(run.tags.get(key) == value for key, value in tags.items())
        ]
        return sorted(found, key=lambda run: run.start_time, reverse=True)[:limit]

    def read_artifact(self, run_id: str, path: str) -> bytes | None:
        return self._artifacts[run_id].get(path)

    def copy_artifacts(self, source_run_id: str, target_run_id: str) -> None:
        self._artifacts[target_run_id].update(self._artifacts[source_run_id])

    def model_versions(self, model_name: str) -> dict[str, dict[str, str]]:
        return dict(self._versions.get(model_name, {}))

    def create_model_version(
        self, model_name: str, source: str, run_id: str, tags: dict[str, str], model_id: str | None = None
    ) -> str:
        versions = self._versions.setdefault(model_name, {})
        version = str(len(versions) + 1)
        versions[version] = dict(tags)
        self.sources[(model_name, version)] = (source, run_id)
        return version

    def describe_version(self, model_name: str, version: str, description: str, tags: dict[str, str]) -> None:
        self.descriptions[(model_name, version)] = description
        self._versions[model_name][version].update(tags)

    def version_description(self, model_name: str, version: str) -> str:
        return self.descriptions.get((model_name, version), "")

    def set_alias(self, model_name: str, alias: str, version: str) -> None:
        self.aliases[(model_name, alias)] = version

    def aliased_versions(self) -> list[tuple[str, str, str, dict[str, str]]]:
        return [
            (model, alias, version, dict(self._versions[model][version]))
            for (model, alias), version in sorted(self.aliases.items())
        ]
