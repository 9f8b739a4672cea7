"""MLflow behind one door: the only quantlab module that imports MLflow (`quantlab ui` aside).

`TrackingStore` is the few primitives a store offers (the tests' MemoryStore fakes them); the operations
below write DESIGN.md's run layout once over either. Runs come back as `RunRecord`s.
"""

from __future__ import annotations

import base64
import json
import os
import re
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import TypeVar

from quantlab.errors import bad_input, first_line

T = TypeVar("T")

DEFAULT_TRACKING_URI = "sqlite:///mlruns/mlflow.db"
ROLE = "quantlab.role"
VARIANT = "quantlab.variant"
METHOD = "quantlab.method"
BASELINE = "quantlab.baseline"
CHECKPOINT = "quantlab.checkpoint"
ON_FRONTIER = "quantlab.on_frontier"
CONTENT_KEY = "quantlab.content_key"
RUN_KEY = "quantlab.run_key"  # content hash of everything that decides a variant's numbers (plan.make_plan)
SETTINGS_KEY = "quantlab.settings_key"  # the run key without the results version: same recipe, same checkpoint
RESULTS_VERSION = "quantlab.results_version"  # how this quantlab computed and stored them (plan.results_version)
REUSED_FROM = "quantlab.reused_from"  # the run that computed a copied run's numbers
FAILURE = "quantlab.failure"
PARENT = "mlflow.parentRunId"
NOTE = "mlflow.note.content"
SAMPLES_ARTIFACT = "samples.json"  # a variant run's per-document scores (format: jobs.BaselineOutputs)
# The decision on the sweep's runs (publish): the chosen variant, the policy in words, each variant's verdict.
CHOSEN = "quantlab.chosen"  # the parent's: a variant name, or "none"
POLICY = "quantlab.policy"
VERDICT = "quantlab.verdict"  # a variant run's; the parent has one per variant, quantlab.verdict.<variant>
METRICS_OF = "quantlab.metrics_of"  # the parent's metrics are this variant's (the chosen one), under its keys
SWEEP = "quantlab.sweep"  # on the parent and each variant: the runs table groups a sweep's runs by it
# MLflow's UI: the experiment tag it once read to open the classic runs view (3.17 reads only the address's
# workflowType, or what the browser last chose: every address quantlab prints carries CLASSIC_VIEW).
EXPERIMENT_KIND = "mlflow.experimentKind"
CLASSIC_KIND = "custom_model_development"
CLASSIC_VIEW = "workflowType=machine_learning"
# A runs-table view (columns, grouping) kept on the experiment, that an address opens with viewStateShareKey:
# the only runs-table default a server can give (the rest of the table's state lives in each browser).
VIEW_KEY = "quantlab"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
# MLflow 3's logged models (the experiment's Models tab): each finished variant run is one, its checkpoint referenced
# where it lies (an external model: no weights copied), its metrics linked to it and to the data sets they were
# scored on.
MODEL_ID = "quantlab.model_id"  # a variant run's logged model
MODEL_TYPE = "quantlab-variant"
RELEASE_CARD = "quantlab.release_card"  # a registered version's: its card's JSON, an artifact of the sweep's run
_CREATED: set[str] = set()  # SQLite stores this process has opened (and so created, if new)


@dataclass(frozen=True)
class DatasetRecord:
    """A dataset a run was scored on (an MLflow dataset input; lm_eval_runner.TaskDataset has these fields)."""

    name: str
    digest: str
    source_type: str
    source: str
    profile: str | None = None
    schema: str | None = None

    @classmethod
    def of(cls, item) -> DatasetRecord:
        """From anything with these fields (profile and schema optional), e.g. a TaskDataset or an MLflow Dataset."""
        optional = {key: getattr(item, key, None) for key in ("profile", "schema")}
        return cls(item.name, item.digest, item.source_type, item.source, **optional)


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    experiment_id: str
    name: str
    status: str  # RUNNING, FINISHED, FAILED or KILLED
    start_time: int  # milliseconds since the epoch
    metrics: dict[str, float]
    params: dict[str, str]
    tags: dict[str, str]
    datasets: tuple[DatasetRecord, ...] = ()
    end_time: int = 0  # milliseconds since the epoch; 0 while running

    @property
    def variant(self) -> str:
        return self.tags.get(VARIANT, self.name)


class TrackingStore:
    """The primitives quantlab needs of a tracking store, on MLflow (SQLite, a tracking server, any URI MLflow
    accepts); everything else is built on them below. search() is newest first."""

    def __init__(self, uri: str):
        self.uri = uri

    @property
    def sqlite_path(self) -> Path | None:
        return Path(self.uri.removeprefix("sqlite:///")) if self.uri.startswith("sqlite:///") else None

    @cached_property
    def _client(self):
        """One client per store: building one per call re-reads the store's configuration each time."""
        from mlflow.tracking import MlflowClient

        if self.sqlite_path is None or self.uri in _CREATED:
            return MlflowClient(tracking_uri=self.uri)
        # MLflow creates a new database's tables (alembic migrations) when a process first opens
        # it; two sweeps doing that at once corrupt the schema version ("expected to match one
        # row ... in 'alembic_version'"). One process at a time, under a lock file beside it.
        import fcntl

        with open(f"{self.sqlite_path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not self.sqlite_path.exists():
                _create_whole(self.sqlite_path)
            client = MlflowClient(tracking_uri=self.uri)
        _CREATED.add(self.uri)
        return client

    def experiment_id(self, name: str, create: bool = True) -> str | None:
        experiment = self._client.get_experiment_by_name(name)
        if experiment is not None:
            if experiment.lifecycle_stage == "deleted":
                self._client.restore_experiment(experiment.experiment_id)
            if experiment.tags.get(EXPERIMENT_KIND) is None:  # made by an older quantlab
                self._client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND, CLASSIC_KIND)
            return experiment.experiment_id
        if not create:
            return None
        # A SQLite store keeps its artifacts beside the database (the default: under mlruns/), not
        # wherever the first sweep happened to run, as MLflow's cwd-relative default would.
        location = (self.sqlite_path.parent / "artifacts" / name).resolve().as_uri() if self.sqlite_path else None
        return self._client.create_experiment(name, artifact_location=location, tags={EXPERIMENT_KIND: CLASSIC_KIND})

    def experiment_tags(self, experiment_id: str) -> dict[str, str]:
        return dict(self._client.get_experiment(experiment_id).tags)

    def set_experiment_tag(self, experiment_id: str, key: str, value: str) -> None:
        self._client.set_experiment_tag(experiment_id, key, value)

    def experiments(self) -> dict[str, str]:
        return {e.experiment_id: e.name for e in self._client.search_experiments()}

    def start_run(self, experiment_id: str, name: str, tags: dict[str, str], parent: str | None = None) -> str:
        return self._client.create_run(
            experiment_id, run_name=name, tags=tags | ({PARENT: parent} if parent else {})
        ).info.run_id

    def log_values(
        self,
        run_id: str,
        metrics: dict[str, float] | None = None,
        params: dict[str, str] | None = None,
        tags: dict[str, str] | None = None,
        model_id: str | None = None,
        datasets: Iterable[DatasetRecord] = (),
    ) -> None:
        """With `model_id`, each metric is the logged model's too, linked to the data set (of `datasets`) it names."""
        from mlflow.entities import Metric, Param, RunTag

        now, digests = int(time.time() * 1000), {item.name: item.digest for item in datasets}

        def metric(key: str, value: float) -> Metric:
            on = metric_dataset(key, digests) if model_id else None
            linked = {"model_id": model_id, "dataset_name": on, "dataset_digest": digests.get(on or "")}
            return Metric(safe_key(key), float(value), now, 0, **(linked if on else {"model_id": model_id}))

        self._client.log_batch(  # MLflow splits it into batches within the server's limits
            run_id,
            metrics=[metric(key, value) for key, value in (metrics or {}).items()],
            params=[Param(safe_key(key), str(value)[:6000]) for key, value in (params or {}).items()],
            tags=[RunTag(key, str(value)) for key, value in (tags or {}).items()],
        )

    def log_files(self, run_id: str, files: dict[str, str | bytes]) -> None:
        """Write each (relative name -> content) to a scratch dir and upload it as one batch (folders kept)."""
        if not files:
            return
        with tempfile.TemporaryDirectory() as scratch:
            for name, content in files.items():
                path = Path(scratch) / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
            self._client.log_artifacts(run_id, scratch)

    def log_datasets(self, run_id: str, datasets: Iterable) -> None:
        """Record what a run was scored on as MLflow dataset inputs (the runs table's Dataset column)."""
        from mlflow.entities import Dataset, DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        tags = [InputTag(key=MLFLOW_DATASET_CONTEXT, value="evaluation")]
        inputs = [DatasetInput(Dataset(**asdict(DatasetRecord.of(item))), tags=tags) for item in datasets]
        if inputs:
            self._client.log_inputs(run_id, datasets=inputs)

    def create_external_model(
        self, experiment_id: str, name: str, run_id: str, tags: dict[str, str], params: dict[str, str]
    ) -> str:
        """A logged model whose files live outside MLflow (mlflow.create_external_model's record, made with this
        store's client rather than the process's default one), READY at once, as the run's output; its id."""
        from mlflow.entities import LoggedModelOutput, LoggedModelStatus
        from mlflow.utils.mlflow_tags import MLFLOW_MODEL_IS_EXTERNAL

        model = self._client.create_logged_model(
            experiment_id,
            name=re.sub(r"[/:.%\"']", "_", name) or "variant",  # MLflow refuses these in a model's name
            source_run_id=run_id,
            tags={MLFLOW_MODEL_IS_EXTERNAL: "true", **{key: value[:5000] for key, value in tags.items()}},
            params={safe_key(key): str(value)[:6000] for key, value in params.items()},
            model_type=MODEL_TYPE,
        )
        self._client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
        self._client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=0)])
        return model.model_id

    def set_model_tags(self, model_id: str, tags: dict[str, str]) -> None:
        self._client.set_logged_model_tags(model_id, tags)

    def logged_models(self, experiment_id: str) -> list[dict]:
        """The experiment's logged models: model_id, name, source_run_id, tags, params, and metrics as
        (key, value, dataset name, dataset digest)."""
        found, token = [], None
        while True:
            page = self._client.search_logged_models([experiment_id], max_results=100, page_token=token)
            found += [
                {
                    "model_id": model.model_id,
                    "name": model.name,
                    "source_run_id": model.source_run_id,
                    "tags": dict(model.tags),
                    "params": dict(model.params),
                    "metrics": [(m.key, m.value, m.dataset_name, m.dataset_digest) for m in model.metrics or []],
                }
                for model in page
            ]
            if not (token := page.token):
                return found

    def finish(self, run_id: str, status: str) -> None:
        self._client.set_terminated(run_id, status=status)

    def run(self, run_id: str) -> RunRecord:
        return _record(self._client.get_run(run_id))

    def search(
        self, experiment_ids: list[str], tags: dict[str, str], status: str | None = None, limit: int = 5000
    ) -> list[RunRecord]:
        """The runs with these tags (and status), newest first, at most `limit`."""
        if not experiment_ids:
            return []
        where = [f"tags.`{key}` = '{value}'" for key, value in tags.items()]
        where += [f"attributes.status = '{status}'"] if status else []
        order = ["attributes.start_time DESC"]
        runs = self._client.search_runs(experiment_ids, " and ".join(where), order_by=order, max_results=limit)
        return [_record(run) for run in runs]

    def read_artifact(self, run_id: str, path: str) -> bytes | None:
        from mlflow.exceptions import MlflowException

        with tempfile.TemporaryDirectory() as scratch:
            try:
                return Path(self._client.download_artifacts(run_id, path, scratch)).read_bytes()
            except (MlflowException, OSError):  # not logged (e.g. a run of an older quantlab)
                return None

    def copy_artifacts(self, source_run_id: str, target_run_id: str) -> None:
        with tempfile.TemporaryDirectory() as scratch:
            self._client.log_artifacts(target_run_id, self._client.download_artifacts(source_run_id, "", scratch))

    def model_versions(self, model_name: str) -> dict[str, dict[str, str]]:
        """Version -> its tags."""
        found = self._client.search_model_versions(f"name = '{model_name}'")
        return {str(version.version): dict(version.tags) for version in found}

    def create_model_version(
        self, model_name: str, source: str, run_id: str, tags: dict[str, str], model_id: str | None = None
    ) -> str:
        from mlflow.exceptions import MlflowException

        try:
            self._client.get_registered_model(model_name)
        except MlflowException:
            self._client.create_registered_model(model_name, description="Variants chosen by `quantlab pick`.")
        version = self._client.create_model_version(
            model_name, source=source, run_id=run_id, tags=tags, model_id=model_id
        )
        if model_id is not None:  # the logged model lists its versions (the Models tab's "Registered models")
            from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

            with suppress(MlflowException):  # a store without logged models: the version stands without the link
                listed = json.loads(self._client.get_logged_model(model_id).tags.get(MLFLOW_MODEL_VERSIONS, "[]"))
                entry = {"name": model_name, "version": str(version.version)}
                self.set_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps([*listed, entry])})
        return str(version.version)

    def describe_version(self, model_name: str, version: str, description: str, tags: dict[str, str]) -> None:
        self._client.update_model_version(model_name, version, description=description)
        for key, value in tags.items():
            self._client.set_model_version_tag(model_name, version, key, value)

    def version_description(self, model_name: str, version: str) -> str:
        return self._client.get_model_version(model_name, version).description or ""

    def set_alias(self, model_name: str, alias: str, version: str) -> None:
        self._client.set_registered_model_alias(model_name, alias, version)

    def aliased_versions(self) -> list[tuple[str, str, str, dict[str, str]]]:
        """(model, alias, version, the version's tags) for every alias of every registered model."""
        found, token = [], None
        while True:
            page = self._client.search_registered_models(max_results=100, page_token=token)
            for model in page:
                for alias, version in sorted(model.aliases.items()):
                    tags = dict(self._client.get_model_version(model.name, str(version)).tags)
                    found.append((model.name, alias, str(version), tags))
            if not (token := page.token):
                return found


def _record(run) -> RunRecord:
    inputs = run.inputs.dataset_inputs if run.inputs is not None else []
    return RunRecord(
        run_id=run.info.run_id,
        experiment_id=run.info.experiment_id,
        name=run.info.run_name or "",
        status=run.info.status,
        start_time=run.info.start_time or 0,
        metrics=dict(run.data.metrics),
        params=dict(run.data.params),
        tags=dict(run.data.tags),
        datasets=tuple(DatasetRecord.of(item.dataset) for item in inputs),
        end_time=run.info.end_time or 0,
    )


def safe_key(key: str) -> str:
    """MLflow keys allow letters, digits and _-. :/ only (lm-eval metric names may hold others)."""
    return re.sub(r"[^\w\-. :/]", "_", key)


def shown_uri(uri: str) -> str:
    """The URI with any password masked, for messages (`postgresql://user:pw@host/db` is common)."""
    password = urllib.parse.urlsplit(uri).password
    return uri if password is None else uri.replace(f":{password}@", ":***@", 1)  # its first ":...@" is the netloc's


def run_address(uri: str, experiment_id: str, run_id: str, artifact: str = "") -> str | None:
    """Where a tracking server shows a run, or one of its artifacts (password masked), in MLflow's classic view;
    None for a store without a UI of its own."""
    if not uri.startswith(("http://", "https://")):
        return None
    return _address(shown_uri(uri), experiment_id, f"runs/{run_id}" + (f"/artifacts/{artifact}" if artifact else ""))


def _address(base: str, experiment_id: str, page: str, query: str = "") -> str:
    """An address of MLflow's UI that opens in its classic view: without workflowType=machine_learning, MLflow
    3.17 opens whatever view the browser last chose, GenAI for a first visit."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/{page}?{CLASSIC_VIEW}{query}"


def _health_request(uri: str) -> urllib.request.Request:
    """GET <server>/health, with the URI's user and password (if any) as basic auth, as MLflow sends them."""
    parts = urllib.parse.urlsplit(uri)
    without_userinfo = parts._replace(netloc=parts.netloc.rpartition("@")[2])
    request = urllib.request.Request(urllib.parse.urlunsplit(without_userinfo).rstrip("/") + "/health")
    if parts.username is not None:
        user = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        request.add_header("Authorization", "Basic " + base64.b64encode(user.encode()).decode())
    return request


def _create_whole(path: Path) -> None:
    """A new SQLite store, created whole or not at all. MLflow builds its tables in dozens of migrations, each its
    own statement; a process stopped among them (Ctrl-C in a sweep's first seconds) leaves a database no later
    client can open ("duplicate column name"). Built under a scratch name and linked into place: the link either
    makes the whole store appear or fails because one appeared meanwhile."""
    from mlflow.tracking import MlflowClient

    scratch = path.with_name(f".{path.name}.{os.getpid()}.creating")
    try:
        MlflowClient(tracking_uri=f"sqlite:///{scratch}").search_experiments()  # opening it runs the migrations
        with suppress(FileExistsError):
            os.link(scratch, path)
    finally:
        scratch.unlink(missing_ok=True)


def open_store(uri: str | None = None) -> TrackingStore:
    """The store `uri`, $MLFLOW_TRACKING_URI or the default names, checked usable: an unreachable server is bad input."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    store = TrackingStore(uri)
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
            raise bad_input("--tracking-uri", "", f"tracking server {shown_uri(uri)} is unreachable: {error}") from None
    elif store.sqlite_path:
        store.sqlite_path.parent.mkdir(parents=True, exist_ok=True)
    elif not uri.startswith(("file:", "databricks", "postgresql", "mysql", "mssql")) and "://" in uri:
        raise bad_input("--tracking-uri", "", f"unsupported tracking URI scheme: {shown_uri(uri)}")
    elif uri.startswith("file:") or "://" not in uri:
        _file_store_allowed(store)
    return store


def _file_store_allowed(store: TrackingStore) -> None:
    """MLflow 3 refuses to open a file store (its "maintenance mode") unless MLFLOW_ALLOW_FILE_STORE is set: its
    client, opened here (and kept), before anything is written; a refusal is bad input in one line, not a traceback
    from the middle of a sweep."""
    from mlflow.exceptions import MlflowException

    try:
        store._client  # noqa: B018 - opening the store is the check
    except MlflowException as error:
        why = "MLflow refuses this file store" if "maintenance mode" in str(error) else first_line(error)
        raise bad_input(
            "--tracking-uri",
            "",
            f"{shown_uri(store.uri)}: {why}; use sqlite:///<folder>/mlflow.db, or set MLFLOW_ALLOW_FILE_STORE=true",
        ) from None


# Operations on any TrackingStore: the MLflow layout is written and read here, once.


def start_sweep(store: TrackingStore, experiment_id: str, name: str, tags: dict[str, str]) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())  # the group's name in the runs table
    return store.start_run(experiment_id, name, {ROLE: "sweep", SWEEP: f"{started} UTC", **tags})


SENSITIVITY_PARENT_ROLE = "sensitivity-sweep"  # not "sweep": the latest sweep, its frontier and pick never see it


def start_sensitivity(
    store: TrackingStore, experiment_id: str, variant: str, method: str, run_key: str, tags: dict[str, str]
) -> tuple[str, str]:
    """(parent, run) of one `quantlab sensitivity`: a parent of its own, and its run of role `sensitivity`."""
    parent = store.start_run(experiment_id, f"sensitivity {variant}", {ROLE: SENSITIVITY_PARENT_ROLE, **tags})
    run_tags = {ROLE: "sensitivity", VARIANT: variant, METHOD: method, RUN_KEY: run_key}
    return parent, store.start_run(experiment_id, f"{variant} by group", run_tags, parent=parent)


def end_unfinished(store: TrackingStore, run_ids: Iterable[str], status: str, reason: str | None = None) -> None:
    """Runs of work that is dying end with `status` (and why, when given), unless they already ended (or the store
    is down)."""
    try:
        for run_id in run_ids:
            if store.run(run_id).status == "RUNNING":
                if reason is not None:
                    store.log_values(run_id, tags={FAILURE: reason[:5000]})
                store.finish(run_id, status)
    except store_errors():
        pass


def start_variant(
    store: TrackingStore,
    experiment_id: str,
    parent: str,
    name: str,
    method: str,
    *,
    baseline: bool,
    run_key: str,
    settings_key: str = "",
    results_version: str = "",
) -> str:
    tags = {ROLE: "variant", VARIANT: name, METHOD: method, BASELINE: str(baseline).lower(), RUN_KEY: run_key}
    tags |= {tag: value for tag, value in ((SETTINGS_KEY, settings_key), (RESULTS_VERSION, results_version)) if value}
    if (sweep := store.run(parent).tags.get(SWEEP)) is not None:  # the runs table groups it with its sweep
        tags[SWEEP] = sweep
    return store.start_run(experiment_id, name, tags, parent=parent)


def log_variant(
    store: TrackingStore,
    run_id: str,
    *,
    metrics: dict[str, float],
    params: dict[str, str],
    tags: dict[str, str],
    datasets: Iterable,
    files: dict[str, str | bytes],
) -> str | None:
    """A variant's result: figures, its datasets and artifacts, and the logged model they are of; then the run is
    FINISHED. Returns why the run has no logged model (a store whose server predates them), None when it has one."""
    datasets = [DatasetRecord.of(item) for item in datasets]
    model_id, why = variant_model(store, run_id, params, tags)
    store.log_values(run_id, metrics=metrics, params=params, tags=tags, model_id=model_id, datasets=datasets)
    store.log_datasets(run_id, datasets)
    store.log_files(run_id, files)
    store.finish(run_id, "FINISHED")
    return why


def variant_model(
    store: TrackingStore, run_id: str, params: dict[str, str], tags: dict[str, str]
) -> tuple[str | None, str | None]:
    """(the run's logged model, None), made once (logging is retried whole), referencing its checkpoint; or (None,
    why not) where the store's models API fails: the variant is logged without one rather than not at all."""
    run = store.run(run_id)
    if known := run.tags.get(MODEL_ID):
        return known, None
    shown = {key: value for key, value in (run.tags | tags).items() if key.startswith("quantlab.") and key != MODEL_ID}
    try:
        model_id = store.create_external_model(run.experiment_id, run.variant, run_id, shown, params)
    except store_errors() as error:
        return None, f"no logged model in the Models tab: the store refused one ({first_line(error)})"
    store.log_values(run_id, tags={MODEL_ID: model_id})
    return model_id, None


def metric_dataset(key: str, names: Iterable[str]) -> str | None:
    """The data set a metric was scored on, where its key names one as a task: eval/<task>/... (also nested, as in
    quality/paired/eval/<task>/...) or quality/<kind>/<task>..."""
    parts, names = key.split("/"), set(names)
    named = [parts[at + 1] for at, part in enumerate(parts[:-1]) if part == "eval"]
    named += parts[2:3] if parts[0] == "quality" else []
    return next((task for task in named if task in names), None)


def log_failure(store: TrackingStore, run_id: str, reason: str, files: dict[str, str | bytes]) -> None:
    store.log_files(run_id, files)
    store.log_values(run_id, tags={FAILURE: reason[:5000]})
    store.finish(run_id, "FAILED")


VERSION_DESCRIPTION = 5000  # characters a registry database keeps of a model version's description


def run_description(markdown: str, whole: str, tail: str = "", limit: int | None = None) -> str:
    """`markdown` as a run's description (the NOTE tag), then `tail` (kept whole: links the artifact lacks). MLflow
    keeps a tag to 8,000 characters (`limit`: another description's) and cuts a longer one with only a logged warning
    (or refuses it): cut `markdown` here instead, at the last line that fits, and say that the artifact `whole` holds
    all of it."""
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

    limit = limit or MAX_TAG_VAL_LENGTH
    if len(markdown) + len(tail) <= limit:
        return markdown + tail
    pointer = f"\n\n*Cut to fit MLflow's {limit:,}-character description: all of it is the artifact `{whole}`.*"
    kept = markdown[: max(limit - len(pointer) - len(tail), 0)]
    return (kept[: kept.rfind("\n") + 1 or len(kept)].rstrip("\n") + pointer + tail)[:limit]


LOGGED_ARTIFACTS = "mlflow.loggedArtifacts"  # a run's tables, as MLflow's log_table lists them for its UI


def log_tables(store: TrackingStore, run_id: str, tables: dict[str, tuple[list[str], list[list]]]) -> None:
    """Tables (artifact path -> columns, rows) as MLflow's `log_table` keeps one (JSON in pandas' "split" layout,
    listed in the run's mlflow.loggedArtifacts tag, which the UI reads), each replaced whole where it exists: MLflow's
    own appends to an existing file, so a run published twice, or copied and published, would list its rows twice."""
    if not tables:
        return
    store.log_files(
        run_id, {path: json.dumps({"columns": cols, "data": rows}) for path, (cols, rows) in tables.items()}
    )
    listed = json.loads(store.run(run_id).tags.get(LOGGED_ARTIFACTS, "[]"))
    added = [entry for path in tables if (entry := {"path": path, "type": "table"}) not in listed]
    if added:
        store.log_values(run_id, tags={LOGGED_ARTIFACTS: json.dumps([*listed, *added])})


def artifact_link(experiment_id: str, run_id: str, artifact: str) -> str:
    """A link, relative to the UI's own address, that opens a run's artifact in the classic view (for descriptions)."""
    return _address("", experiment_id, f"runs/{run_id}/artifacts/{artifact}").removeprefix("/")


def store_errors() -> tuple[type[BaseException], ...]:
    """What a store raises when it is down, slow or refusing a write (an HTTP error, a timeout, a locked database)."""
    import requests
    from mlflow.exceptions import MlflowException

    return (MlflowException, requests.exceptions.RequestException, OSError)


def with_retries(
    operation: Callable[[], T],
    budget_seconds: float,
    on_retry: Callable[[BaseException, float], object] = lambda error, wait: None,
) -> T:
    """`operation()`, tried again after 1, 2, 4 ... 30 s while the store fails, for `budget_seconds` at most;
    then its last error is raised. `on_retry` hears each failure and the wait before the next try."""
    deadline, wait = time.monotonic() + budget_seconds, 1.0
    while True:
        try:
            return operation()
        except store_errors() as error:
            if time.monotonic() + wait > deadline:
                raise
            on_retry(error, wait)
            time.sleep(wait)
            wait = min(2 * wait, 30.0)


def child_runs(store: TrackingStore, parent_run_id: str) -> list[RunRecord]:
    return store.search([store.run(parent_run_id).experiment_id], {PARENT: parent_run_id})


def finished_runs(store: TrackingStore, experiment_id: str, keys: set[str], tag: str = RUN_KEY) -> dict[str, RunRecord]:
    """The newest FINISHED variant run for each key, a value of `tag` (the run key, or the settings key): a query per
    key, for one run each (MLflow's search has no IN for tags). Every re-run adds a copy of each variant; reading all
    of them made a re-run slower with each one."""
    found = {}
    for key in sorted(keys):
        if newest := store.search([experiment_id], {ROLE: "variant", tag: key}, status="FINISHED", limit=1):
            found[key] = newest[0]
    return found


def copy_run(store: TrackingStore, source: RunRecord, target_run_id: str) -> str | None:
    """Copy a finished run's numbers, datasets and artifacts into `target_run_id` (made by start_variant, so it
    says who it is: a renamed variant keeps its new name) and finish it; reused_from names the original run.
    Returns why the copy has no logged model (log_variant)."""
    name = store.run(target_run_id).tags.get(VARIANT)
    # The copying sweep's to say, not the original's (the copy is a logged model of its own).
    identity = {ON_FRONTIER, ROLE, VARIANT, BASELINE, SWEEP, VERDICT, MODEL_ID}
    tags = {k: v for k, v in source.tags.items() if not k.startswith("mlflow.") and k not in identity}
    params = source.params | ({"variant.name": name} if "variant.name" in source.params and name else {})
    store.copy_artifacts(source.run_id, target_run_id)
    # The copy was scored on what the original was: the runs table lists the same datasets.
    return log_variant(
        store,
        target_run_id,
        metrics=source.metrics,
        params=params,
        tags=tags | {REUSED_FROM: source.tags.get(REUSED_FROM, source.run_id)},
        datasets=source.datasets,
        files={},
    )


def kill_sweeps(
    store: TrackingStore, experiment_id: str, dead: Callable[[dict[str, str]], bool], reason: str
) -> list[str]:
    """RUNNING sweeps that will never finish (`dead` of their tags): each and its RUNNING variant runs become KILLED."""
    running = [
        run
        for role in ("sweep", SENSITIVITY_PARENT_ROLE)
        for run in store.search([experiment_id], {ROLE: role}, status="RUNNING")
    ]
    killed = [run.run_id for run in running if dead(run.tags)]
    for sweep_run_id in killed:
        for child in child_runs(store, sweep_run_id):
            if child.status == "RUNNING":
                store.log_values(child.run_id, tags={FAILURE: reason})
                store.finish(child.run_id, "KILLED")
        store.finish(sweep_run_id, "KILLED")
    return killed


def latest_sweep(store: TrackingStore, experiment_name: str | None) -> RunRecord:
    """The newest parent run of an experiment (of any experiment when None), or BadInput saying why not."""
    if experiment_name is None:
        experiments, where = list(store.experiments()), f"the store {shown_uri(store.uri)}"
    else:
        found = store.experiment_id(experiment_name, create=False)
        if found is None:
            raise bad_input("--experiment", "", f"no experiment named '{experiment_name}' in {shown_uri(store.uri)}")
        experiments, where = [found], f"experiment '{experiment_name}'"
    runs = store.search(experiments, {ROLE: "sweep"}, limit=1)
    if not runs:
        raise bad_input("--experiment", "", f"{where} has no sweep runs; run `quantlab sweep RECIPE` first")
    return runs[0]


def ui_addresses(store: TrackingStore, host: str, port: int) -> list[tuple[str, str]]:
    """What `quantlab ui` prints, each in MLflow's classic view: per experiment its runs table (grouped by sweep,
    the reviewer's columns shown, where publish kept that view), its newest sweep's run page and frontier.html."""
    base = f"http://{host}:{port}"
    experiments = {id_: name for id_, name in store.experiments().items() if name != "Default"}
    if not experiments:
        return [("MLflow UI (no sweeps yet)", base)]
    found = []
    for id_, name in experiments.items():
        tags = store.experiment_tags(id_)
        if tags.get(EXPERIMENT_KIND) is None:  # made by an older quantlab: MLflow versions that read it need it
            store.set_experiment_tag(id_, EXPERIMENT_KIND, CLASSIC_KIND)
        view = f"&viewStateShareKey={VIEW_KEY}" if VIEW_TAG in tags else ""
        found.append((f"{name}: runs", _address(base, id_, "runs", view)))
        if sweeps := store.search([id_], {ROLE: "sweep"}, limit=1):
            found.append((f"{name}: newest sweep", _address(base, id_, f"runs/{sweeps[0].run_id}")))
            found.append((f"{name}: frontier", _address(base, id_, f"runs/{sweeps[0].run_id}/artifacts/frontier.html")))
    return found


def runs_view(columns: Iterable[str]) -> str:
    """The runs-table view publish keeps on the experiment (VIEW_TAG, MLflow's shared-view JSON): each sweep a
    group of rows, expanded, newest first (MLflow keeps a sweep's variants folded under it, and their unfolding
    is each browser's, never the server's), and `columns` (metric keys, `tags.<key>` for a tag) beside the
    datasets. A grouped row shows the largest of its runs' values."""
    named = [
        f"tags.`{key.removeprefix('tags.')}`" if key.startswith("tags.") else f"metrics.`{safe_key(key)}`"
        for key in columns
    ]
    tags = [key for key in named if key.startswith("tags.")]
    # The table draws only the columns in sight: the datasets come right after the decision's tags.
    selected = [*tags, "attributes.`Dataset`", *(key for key in named if key not in tags)]
    return json.dumps(
        {
            "searchFilter": "",
            "orderByKey": "attributes.start_time",
            "orderByAsc": False,
            "startTime": "ALL",
            "lifecycleFilter": "Active",
            "datasetsFilter": [],
            "modelVersionFilter": "All Runs",
            "selectedColumns": selected,
            "columnOrder": ["attributes.`Run Name`", *selected],
            # Narrow enough that the first metrics are in sight at 1600 px beside MLflow's assistant panel.
            "columnWidths": {
                "attributes.`Run Name`": 240,
                **{key: 130 for key in named},
                f"tags.`{VERDICT}`": 160,
                "attributes.`Dataset`": 200,
            },
            "groupBy": {"aggregateFunction": "max", "groupByKeys": [{"mode": "tag", "groupByData": SWEEP}]},
            "groupsExpanded": {},
        }
    )


def log_decision(
    store: TrackingStore,
    parent_run_id: str,
    *,
    tags: dict[str, str],
    verdicts: dict[str, str],
    metrics: dict[str, float],
    columns: Iterable[str],
) -> None:
    """The sweep's decision where reviewers look: `tags` (CHOSEN, POLICY) and every variant's verdict on the
    parent, each verdict on its variant's run too, `metrics` (the chosen variant's) on the parent, the datasets
    its variants were scored on, and the experiment's runs-table view showing `columns`."""
    children = child_runs(store, parent_run_id)
    for run in children:
        if run.variant in verdicts:
            store.log_values(run.run_id, tags={VERDICT: verdicts[run.variant]})
            if model_id := run.tags.get(MODEL_ID):  # the Models tab compares the variants by it too
                store.set_model_tags(model_id, {VERDICT: verdicts[run.variant]})
    verdict_tags = {f"{VERDICT}.{name}": words for name, words in verdicts.items()}
    store.log_values(parent_run_id, metrics=metrics, tags=tags | verdict_tags)
    logged = {(item.name, item.digest) for item in store.run(parent_run_id).datasets}
    datasets = {(item.name, item.digest): item for run in children for item in run.datasets}
    store.log_datasets(parent_run_id, [item for key, item in datasets.items() if key not in logged])
    store.set_experiment_tag(store.run(parent_run_id).experiment_id, VIEW_TAG, runs_view(columns))


def register_checkpoint(
    store: TrackingStore, model_name: str, alias: str, run: RunRecord, tags: dict[str, str]
) -> tuple[str, bool]:
    """Register the run's checkpoint where it lies (no weights copied) under `alias`; (version, created).
    The same checkpoint (content key) registered again reuses its version."""
    checkpoint, content_key = run.tags[CHECKPOINT], run.tags.get(CONTENT_KEY, run.run_id)
    versions = store.model_versions(model_name).items()
    version = next((known for known, on_it in versions if on_it.get(CONTENT_KEY) == content_key), None)
    created = version is None
    if created:
        source = Path(checkpoint).resolve().as_uri() if "://" not in checkpoint else checkpoint
        version = store.create_model_version(
            model_name,
            source,
            run.run_id,
            {**tags, CONTENT_KEY: content_key, CHECKPOINT: checkpoint},
            model_id=run.tags.get(MODEL_ID),  # the version page links the variant's logged model
        )
    store.set_alias(model_name, alias, version)
    return version, created


def registered_checkpoints(store: TrackingStore) -> dict[str, list[str]]:
    """Checkpoint (as its registered version's CHECKPOINT tag names it) -> "model@alias vN" for each registry
    alias that points at it. A version without an alias is not listed."""
    found: dict[str, list[str]] = {}
    for model, alias, version, tags in store.aliased_versions():
        if CHECKPOINT in tags:
            found.setdefault(tags[CHECKPOINT], []).append(f"{model}@{alias} v{version}")
    return found
