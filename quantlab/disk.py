"""Will it fit: what a sweep or a variant will write (checkpoints, a GGUF model's conversion, MLflow artifacts),
estimated before any of it is, against the free space of the file system it goes to.

A checkpoint's size is modeled exactly from the model's shape and the method's stored format (what
`quantlab.measure.modeled` counts, and what llm-compressor's compressed-tensors writes), then given a margin.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantlab.cache import NotEnoughSpace
from quantlab.errors import BadInput, Problem
from quantlab.measure.modeled import ModelShape, WeightCounts, weight_counts
from quantlab.models import ModelSource, gguf_reader
from quantlab.quantize import METHODS

if TYPE_CHECKING:
    from quantlab.recipe import VariantSpec

logger = logging.getLogger(__name__)

MARGIN = 0.10  # on the modeled tensor bytes: safetensors headers, a method whose layout drifts
FIXED_BYTES = 16 << 20  # tokenizer (SmolLM2's tokenizer.json: 3.4 MB; Llama 3's: 8.7 MB), configs, the marker
# What one MLflow run of a sweep logs: samples.json (one record per scored document: about 3 MB for all of
# MMLU's 14k questions), the variant's log, a failure's traceback, small JSON files; the parent run's recipe,
# frontier page and plot, report. Known only once the run is done, and small beside any checkpoint: a fixed,
# generous figure per run costs nothing on a disk that holds the checkpoints, and catches a full one.
ARTIFACT_BYTES_PER_RUN = 16 << 20
FREE_CACHE = (
    "free space there (`quantlab cache prune` removes the checkpoints no sweep used lately) "
    "or point --cache-dir / QUANTLAB_CACHE_DIR at a larger disk"
)
FREE_STORE = "free space there or log to another store (--tracking-uri / MLFLOW_TRACKING_URI)"


def checkpoint_bytes(shape: ModelShape, method: str, params: Mapping[str, Any]) -> int:
    """Tensor bytes of the checkpoint the quantize stage writes."""
    return _stored_bytes(weight_counts(shape), method, params)


def _stored_bytes(weights: WeightCounts, method: str, params: Mapping[str, Any]) -> int:
    """A method that models no stored bytes (`Method.linear_bytes`), or one told to keep more than lm_head unquantized (how much more the
    shape does not say), counts as BF16: an upper bound."""
    bf16 = 2 * weights.parameters
    linear = METHODS[method].linear_bytes(weights, params) if method in METHODS else None
    if linear is None or set(params.get("ignore", ["lm_head"])) - {"lm_head"}:
        return bf16
    return bf16 - 2 * weights.linear_weights + linear


def with_margin(tensor_bytes: int) -> int:
    """Bytes to have free for a checkpoint of `tensor_bytes` tensor data."""
    return math.ceil(tensor_bytes * (1 + MARGIN)) + FIXED_BYTES


@dataclass(frozen=True)
class CacheWrites:
    """What computing a sweep's variants writes into the cache, modeled from one reading of the model's shape, with
    margins: each checkpoint it builds, and a GGUF model's float32 conversion while the cache lacks it."""

    checkpoints: dict[str, int]  # variant name -> its checkpoint
    conversion: int  # 0: none to make
    converted: str  # the GGUF file converted

    def needs(self, cache_root: Path, replaced: int) -> list[Need]:
        """What to have free under `cache_root`; `replaced`: the cached copies that --force removes first."""
        needs = []
        if self.conversion:
            needs.append(Need(cache_root, self.conversion, f"the float32 conversion of {self.converted}"))
        if self.checkpoints:
            count, names = len(self.checkpoints), ", ".join(self.checkpoints)
            what = f"{count} checkpoint{'s' if count > 1 else ''} to build ({names})"
            needs.append(Need(cache_root / "checkpoints", max(sum(self.checkpoints.values()) - replaced, 0), what))
        return needs


def cache_writes(source: ModelSource, building: Iterable[VariantSpec]) -> CacheWrites | None:
    """What computing variants writes into the cache; `building`: those whose checkpoint it lacks; `source`: the
    model as the cache has it (`models.materialized`: a GGUF file until it is converted). The shape is read once;
    None when it is not at hand (nothing is estimated)."""
    shape = model_shape(source)
    if shape is None:
        return None
    weights = weight_counts(shape)
    checkpoints = {
        variant.name: with_margin(_stored_bytes(weights, variant.method, variant.params.model_dump()))
        for variant in building
    }
    conversion = with_margin(4 * weights.parameters) if source.kind == "gguf" else 0  # float32 (models.materialize)
    return CacheWrites(checkpoints, conversion, str(source.gguf_file))


def model_shape(source: ModelSource) -> ModelShape | None:
    """The model's shape from what is on this machine, loading no library but the small `gguf` reader: a
    directory's config.json, a hub model's config.json in the local Hugging Face cache, a GGUF file's metadata.
    None when none is at hand or it is not a Llama-family decoder (then nothing is estimated)."""
    try:
        if source.kind == "gguf":
            values = _gguf_config(Path(source.location) / str(source.gguf_file))
        else:
            values = Path(source.location) / "config.json" if source.kind == "local_dir" else _hub_config(source)
        return ModelShape.from_config(values) if values is not None else None
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.info("no size estimate for %s: %s", source.display, error)
        return None


def _hub_config(source: ModelSource) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(source.location, "config.json", revision=source.revision)
    return Path(found) if isinstance(found, str) else None


def _gguf_config(path: Path) -> dict[str, Any]:
    """The config.json fields a Llama-family GGUF's metadata holds (about 3 s for the embedded model, once per
    process: the recipe check's parse is reused)."""
    reader = gguf_reader(path)
    arch = reader.fields["general.architecture"].contents()

    def value(key: str) -> Any:
        field = reader.fields.get(f"{arch}.{key}")
        return field.contents() if field is not None else None

    return {
        "hidden_size": value("embedding_length"),
        "num_hidden_layers": value("block_count"),
        "num_attention_heads": value("attention.head_count"),
        "num_key_value_heads": value("attention.head_count_kv"),
        "head_dim": value("attention.key_length"),
        "intermediate_size": value("feed_forward_length"),
        "vocab_size": value("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data),
        "tie_word_embeddings": not any(tensor.name == "output.weight" for tensor in reader.tensors),
    }


@dataclass(frozen=True)
class Need:
    """Bytes that `what` will write under `directory`; `remedy` says what to do when they do not fit."""

    directory: Path
    bytes: int
    what: str
    remedy: str = FREE_CACHE
    field: str = "--cache-dir"  # the flag that chose `directory`, for a sweep's bad input


def artifact_needs(tracking_uri: str, runs: int) -> list[Need]:
    """The artifacts of `runs` MLflow runs, when the store keeps them on a local file system: a SQLite store
    beside its database (`tracking.TrackingStore.experiment_id`), a file store (`file:` URI or a plain path)
    in its directory. A server, or a database elsewhere, keeps them where this machine cannot judge."""
    parts = urllib.parse.urlsplit(tracking_uri)
    if tracking_uri.startswith("databricks"):
        return []
    if parts.scheme == "sqlite" and tracking_uri.startswith("sqlite:///"):
        directory = Path(tracking_uri.removeprefix("sqlite:///")).parent / "artifacts"
    elif parts.scheme == "file":
        directory = Path(urllib.parse.unquote(parts.path))
    elif not parts.scheme or len(parts.scheme) == 1:  # a path (a Windows drive letter parses as a scheme)
        directory = Path(tracking_uri)
    else:
        return []
    what = f"the MLflow artifacts of {runs} runs (about {_size(ARTIFACT_BYTES_PER_RUN)} each)"
    return [Need(directory.resolve(), runs * ARTIFACT_BYTES_PER_RUN, what, FREE_STORE, "--tracking-uri")]


def free_bytes(directory: Path) -> int:
    """Free bytes (for an unprivileged writer) of the file system `directory` is or will be on."""
    return shutil.disk_usage(_existing(directory)).free


def _existing(directory: Path) -> Path:
    """`directory`, or its nearest ancestor that exists (where it will be created)."""
    path = Path(directory).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def shortfalls(needs: list[Need]) -> list[tuple[Need, str]]:
    """For each file system that `needs` do not fit on (needs on one file system add up): the first of them and
    a one-line message naming the directories, the bytes needed and free, and what to free."""
    by_device: dict[int, list[Need]] = {}
    for need in needs:
        by_device.setdefault(os.stat(_existing(need.directory)).st_dev, []).append(need)
    found = []
    for group in by_device.values():
        # One file system reports one figure; the least of them, should a directory's differ (a quota).
        needed, free = sum(need.bytes for need in group), min(free_bytes(need.directory) for need in group)
        if needed <= free:
            continue
        directories = " and ".join(dict.fromkeys(str(need.directory) for need in group))
        what = " and ".join(need.what for need in group)
        remedies = "; ".join(dict.fromkeys(need.remedy for need in group))
        found.append(
            (
                group[0],
                f"{directories}: {what}: about {_size(needed)} ({needed:,} bytes) needed, {_size(free)} "
                f"({free:,} bytes) free on its file system; {remedies} (at least {_size(needed - free)} more)",
            )
        )
    return found


def require(needs: list[Need]) -> None:
    """Raise NotEnoughSpace (a variant's failure) when `needs` do not fit."""
    if problems := shortfalls(needs):
        raise NotEnoughSpace("; ".join(message for _, message in problems))


def refuse_sweep(needs: list[Need]) -> None:
    """Raise BadInput (exit 2, before any run) when what a whole sweep would write does not fit."""
    if problems := shortfalls(needs):
        raise BadInput([Problem(need.field, "", message) for need, message in problems])


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"
