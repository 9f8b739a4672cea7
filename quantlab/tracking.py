"""MLflow: the store, the sweep's parent run, one nested run per variant, artifacts, registry reads.

Layout (a contract other tools rely on, see DESIGN.md): experiment = recipe name; parent run
tagged quantlab.role=sweep; nested runs tagged quantlab.role=variant, quantlab.variant,
quantlab.method, quantlab.checkpoint, quantlab.on_frontier.
"""

from __future__ import annotations

import base64
import os
import re
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from quantlab.errors import BadInput, Problem

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

DEFAULT_TRACKING_URI = "sqlite:///mlruns/mlflow.db"
ROLE = "quantlab.role"
VARIANT = "quantlab.variant"
METHOD = "quantlab.method"
CHECKPOINT = "quantlab.checkpoint"
ON_FRONTIER = "quantlab.on_frontier"
CONTENT_KEY = "quantlab.content_key"
PARENT = "mlflow.parentRunId"
NOTE = "mlflow.note.content"
# MLflow's batch endpoint limits.
_BATCH = {"metrics": 1000, "params": 100, "tags": 100}
_CREATED: set[str] = set()  # SQLite stores this process has opened (and so created, if new)


def tracking_uri(flag: str | None) -> str:
    return flag or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


@dataclass(frozen=True)
class Store:
    uri: str

    @property
    def client(self) -> MlflowClient:
        from mlflow.tracking import MlflowClient

        if self.sqlite_path is None or self.uri in _CREATED:
            return MlflowClient(tracking_uri=self.uri)
        # MLflow creates a new database's tables (alembic migrations) when a process first opens
        # it; two sweeps doing that at once corrupt the schema version ("expected to match one
        # row ... in 'alembic_version'"). One process at a time, under a lock file beside it.
        import fcntl

        with open(f"{self.sqlite_path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            client = MlflowClient(tracking_uri=self.uri)  # MLflow keeps this store for the process
        _CREATED.add(self.uri)
        return client

    @property
    def sqlite_path(self) -> Path | None:
        return Path(self.uri.removeprefix("sqlite:///")) if self.uri.startswith("sqlite:///") else None


def _with_userinfo(parts: urllib.parse.SplitResult, userinfo: str) -> str:
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{userinfo}@{host}" if userinfo else host))


def shown_uri(uri: str) -> str:
    """The URI with any password masked, for messages (`postgresql://user:pw@host/db` is common)."""
    parts = urllib.parse.urlsplit(uri)
    return uri if parts.password is None else _with_userinfo(parts, f"{parts.username}:***")


def run_address(uri: str, experiment_id: str, run_id: str) -> str | None:
    """Where a tracking server shows a run (password masked); None for a store without a UI of its own."""
    if not uri.startswith(("http://", "https://")):
        return None
    return f"{shown_uri(uri).rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def _health_request(uri: str) -> urllib.request.Request:
    """GET <server>/health, with the URI's user and password (if any) as basic auth, as MLflow sends them."""
    parts = urllib.parse.urlsplit(uri)
    request = urllib.request.Request(_with_userinfo(parts, "").rstrip("/") + "/health")
    if parts.username is not None:
        user = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        request.add_header("Authorization", "Basic " + base64.b64encode(user.encode()).decode())
    return request


def open_store(uri: str) -> Store:
    """Check the store is usable before any work: an unreachable server is bad input (exit 2)."""
    if uri.startswith(("http://", "https://")):
        # MLflow's own client retries for minutes; one direct probe answers in seconds.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        # MLflow prints "View run ... at <tracking URI>" as each run ends: the URI's password
        # with it, between the sweep's progress lines. The sweep prints a masked link instead.
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        try:
            with urllib.request.urlopen(_health_request(uri), timeout=10) as response:
                response.read()
        except (urllib.error.URLError, OSError) as error:
            raise BadInput([Problem("--tracking-uri", "", f"tracking server {shown_uri(uri)} is unreachable: {error}")]) from None
    elif uri.startswith("sqlite:///"):
        database = Path(uri.removeprefix("sqlite:///"))
        database.parent.mkdir(parents=True, exist_ok=True)
    elif not uri.startswith(("file:", "databricks", "postgresql", "mysql", "mssql")) and "://" in uri:
        raise BadInput([Problem("--tracking-uri", "", f"unsupported tracking URI scheme: {shown_uri(uri)}")])
    return Store(uri)


def experiment_id(store: Store, name: str, create: bool = True) -> str | None:
    client = store.client
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.lifecycle_stage == "deleted":
            client.restore_experiment(experiment.experiment_id)
        return experiment.experiment_id
    if not create:
        return None
    # A SQLite store keeps its artifacts beside the database (the default: under mlruns/), not
    # wherever the first sweep happened to run, as MLflow's cwd-relative default would.
    location = (store.sqlite_path.parent / "artifacts" / name).resolve().as_uri() if store.sqlite_path else None
    return client.create_experiment(name, artifact_location=location)


def start_run(store: Store, experiment: str, name: str, tags: dict[str, str], parent: str | None = None) -> str:
    all_tags = dict(tags)
    if parent:
        all_tags[PARENT] = parent
    return store.client.create_run(experiment, run_name=name, tags=all_tags).info.run_id


def log_values(
    store: Store,
    run_id: str,
    metrics: dict[str, float] | None = None,
    params: dict[str, str] | None = None,
    tags: dict[str, str] | None = None,
) -> None:
    import time

    from mlflow.entities import Metric, Param, RunTag

    client = store.client
    now = int(time.time() * 1000)
    entries = {
        "metrics": [Metric(safe_key(key), float(value), now, 0) for key, value in (metrics or {}).items()],
        "params": [Param(safe_key(key), str(value)[:6000]) for key, value in (params or {}).items()],
        "tags": [RunTag(key, str(value)) for key, value in (tags or {}).items()],
    }
    for kind, items in entries.items():
        for start in range(0, len(items), _BATCH[kind]):
            client.log_batch(run_id, **{kind: items[start : start + _BATCH[kind]]})


def safe_key(key: str) -> str:
    """MLflow keys allow letters, digits and _-. :/ only (lm-eval metric names may hold others)."""
    return re.sub(r"[^\w\-. :/]", "_", key)


def log_text_artifacts(store: Store, run_id: str, files: dict[str, str | bytes]) -> None:
    """Write each (relative name -> content) to a scratch dir and upload it as one batch."""
    if not files:
        return
    with tempfile.TemporaryDirectory() as scratch:
        for name, content in files.items():
            path = Path(scratch) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
        store.client.log_artifacts(run_id, scratch)


EVALUATION_CONTEXT = "evaluation"


def log_dataset_inputs(store: Store, run_id: str, datasets: Iterable, context: str = EVALUATION_CONTEXT) -> None:
    """Record what a run was scored on as MLflow dataset inputs (the runs table's Dataset column).

    Each item has name, digest, source_type, source and profile (quantlab's TaskDataset, or the
    mlflow Dataset of another run's input, when a run is copied).
    """
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    inputs = [
        DatasetInput(
            Dataset(name=item.name, digest=item.digest, source_type=item.source_type, source=item.source,
                    schema=getattr(item, "schema", None), profile=getattr(item, "profile", None)),
            tags=[InputTag(key=MLFLOW_DATASET_CONTEXT, value=context)],
        )
        for item in datasets
    ]
    if inputs:
        store.client.log_inputs(run_id, datasets=inputs)


def finish(store: Store, run_id: str, status: str) -> None:
    store.client.set_terminated(run_id, status=status)


def child_runs(store: Store, parent_run_id: str) -> list:
    experiment = store.client.get_run(parent_run_id).info.experiment_id
    return store.client.search_runs(
        [experiment], filter_string=f"tags.`{PARENT}` = '{parent_run_id}'", max_results=1000
    )


def latest_sweep(store: Store, experiment_name: str | None):
    """The newest parent run of an experiment (of any experiment when None), or BadInput saying why not."""
    if experiment_name is None:
        experiments = [experiment.experiment_id for experiment in store.client.search_experiments()]
        where = f"the store {store.uri}"
    else:
        found = experiment_id(store, experiment_name, create=False)
        if found is None:
            raise BadInput([Problem("--experiment", "", f"no experiment named '{experiment_name}' in {store.uri}")])
        experiments, where = [found], f"experiment '{experiment_name}'"
    runs = store.client.search_runs(
        experiments, filter_string=f"tags.`{ROLE}` = 'sweep'", order_by=["attributes.start_time DESC"], max_results=1
    ) if experiments else []
    if not runs:
        raise BadInput([Problem("--experiment", "", f"{where} has no sweep runs; run `quantlab sweep RECIPE` first")])
    return runs[0]


def names(runs: Iterable) -> list[str]:
    return [run.data.tags.get(VARIANT, run.info.run_name) for run in runs]


def ui_addresses(store: Store, host: str, port: int) -> list[tuple[str, str]]:
    """The runs-table address of each experiment; MLflow 3 otherwise opens in its GenAI view."""
    base = f"http://{host}:{port}"
    experiments = [e for e in store.client.search_experiments() if e.name != "Default"]
    if not experiments:
        return [("MLflow UI (no sweeps yet)", base)]
    return [(e.name, f"{base}/#/experiments/{e.experiment_id}/runs?workflowType=machine_learning") for e in experiments]


def register_checkpoint(
    store: Store, model_name: str, alias: str, run_id: str, checkpoint: str, content_key: str, tags: dict[str, str]
) -> tuple[str, bool]:
    """Register the checkpoint where it lies (no weights copied) under `alias`; (version, created).

    The same checkpoint (content key) registered again reuses its version instead of adding one.
    """
    from mlflow.exceptions import MlflowException

    client = store.client
    try:
        client.get_registered_model(model_name)
    except MlflowException:
        client.create_registered_model(model_name, description="Variants chosen by `quantlab pick`.")
    existing = [
        version for version in client.search_model_versions(f"name = '{model_name}'")
        if version.tags.get(CONTENT_KEY) == content_key
    ]
    if existing:
        version, created = existing[0].version, False
    else:
        source = Path(checkpoint).resolve().as_uri() if "://" not in checkpoint else checkpoint
        version = client.create_model_version(
            model_name, source=source, run_id=run_id, tags={**tags, CONTENT_KEY: content_key, CHECKPOINT: checkpoint}
        ).version
        created = True
    client.set_registered_model_alias(model_name, alias, version)
    return str(version), created
