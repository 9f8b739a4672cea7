"""Where a model comes from (hub id, local directory, GGUF file, packaged file) and how it loads.

A GGUF model is dequantized once into a checkpoint directory (`materialize`): for the embedded
SmolLM2 default that dequantized Q4_1 model *is* the "BF16 baseline".
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from quantlab import cache
from quantlab.errors import bad_input
from quantlab.quantize import METHODS

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from quantlab.recipe import CalibrationSettings, ModelSpec, RuntimeSettings, VariantSpec

    LoadedModel = tuple[PreTrainedModel, PreTrainedTokenizerBase]

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
PACKAGE_PREFIX = "pkg://"


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["hub", "local_dir", "gguf"]
    location: str  # hub id, or an absolute directory
    gguf_file: str | None
    revision: str | None
    trust_remote_code: bool
    identity: str  # content identity: what the checkpoint cache keys on

    @property
    def display(self) -> str:
        return f"{self.location}/{self.gguf_file}" if self.gguf_file else self.location


def _packaged_file(source: str) -> Path:
    package, _, file = source.removeprefix(PACKAGE_PREFIX).partition("/")
    # find_spec locates the package without importing (and so without running) it.
    spec = importlib.util.find_spec(package) if package else None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"Python package '{package}' is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / file


def _local_path(source: str, base_dir: Path) -> Path:
    if source.startswith(PACKAGE_PREFIX):
        return _packaged_file(source)
    return (base_dir / Path(source).expanduser()).resolve()


def source_problem(source: str, base_dir: Path) -> str | None:
    """Why a model source cannot be used, or None. No network, no hashing."""
    try:
        path = _local_path(source, base_dir)
    except FileNotFoundError as error:
        return str(error)
    if path.suffix == ".gguf":
        return None if path.is_file() else f"no such GGUF file: {path}"
    if path.is_dir():
        return None if (path / "config.json").is_file() else f"{path} has no config.json"
    if source.startswith(PACKAGE_PREFIX) or path.exists():
        return f"{path} is neither a checkpoint directory nor a .gguf file"
    return None if HUB_ID.match(source) else f"'{source}' is not a local path, a .gguf file, or a hub id (org/name)"


def resolve_source(spec: ModelSpec, base_dir: Path) -> ModelSource:
    if (message := source_problem(spec.source, base_dir)) is not None:
        raise bad_input("", "model.source", message)
    path = _local_path(spec.source, base_dir)
    common = dict(revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    if path.suffix == ".gguf":
        return ModelSource("gguf", str(path.parent), path.name, identity=_gguf_identity(path), **common)
    if path.is_dir():
        return ModelSource("local_dir", str(path), None, identity=f"dir:{_directory_fingerprint(path)}", **common)
    return ModelSource("hub", spec.source, None, identity=f"hub:{spec.source}@{spec.revision or 'main'}", **common)


def checkpoint_identity(source: ModelSource, variant: VariantSpec, calibration: CalibrationSettings | None) -> dict:
    """Everything that decides a variant's checkpoint's bytes, and nothing that does not (e.g. its name): the
    source's identity, the method and its params, the calibration when the method calibrates, the library versions.
    The checkpoint cache keys on it (the plan, the quantize stage and the sensitivity probe alike)."""
    calibrated = calibration is not None and METHODS[variant.method].needs_calibration
    return {
        "model": source.identity,
        "method": variant.method,
        "params": variant.params.model_dump(),
        "calibration": calibration.model_dump() if calibrated else None,
        "versions": cache.library_versions(),
    }


def _gguf_identity(path: Path) -> str:
    """The GGUF file's name and content hash, computed once per process while the file is unchanged (same size,
    modification time and inode): a sweep resolves its source when it checks the recipe and when it plans, and
    hashing takes minutes for a 40 GB file."""
    status = path.stat()
    return _hashed_gguf(path, status.st_size, status.st_mtime_ns, status.st_ino)


@functools.lru_cache(maxsize=16)
def _hashed_gguf(path: Path, size: int, modified_ns: int, inode: int) -> str:
    return f"gguf:{path.name}:sha256={cache.file_sha256(path)}"


@functools.lru_cache(maxsize=16)
def _directory_fingerprint(path: Path) -> str:
    """Config and tokenizer contents plus weight file sizes: cheap, and changes when weights do."""
    digest = hashlib.sha256()
    for file in sorted(path.iterdir()):
        if file.suffix in (".json", ".txt", ".model"):
            digest.update(file.name.encode() + file.read_bytes())
        elif file.suffix in (".safetensors", ".bin"):
            digest.update(f"{file.name}:{file.stat().st_size}".encode())
    return digest.hexdigest()


def _from_pretrained_args(source: ModelSource) -> tuple[str, dict]:
    optional = {"gguf_file": source.gguf_file, "revision": source.revision}
    return source.location, {"trust_remote_code": source.trust_remote_code} | {k: v for k, v in optional.items() if v}


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether this machine can reach the model hub now (HF_HUB_OFFLINE says no without asking).

    One TCP connection answers at once what huggingface_hub's retries take about 40 s to say.
    """
    import socket
    import urllib.parse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    endpoint = urllib.parse.urlsplit(constants.ENDPOINT)
    try:
        with socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def in_local_cache(source: ModelSource) -> bool:
    """Whether a hub model's config is already in the local Hugging Face cache."""
    from transformers import AutoConfig

    location, kwargs = _from_pretrained_args(source)
    try:
        AutoConfig.from_pretrained(location, local_files_only=True, **kwargs)
    except Exception:  # noqa: BLE001 - any failure means "not usable offline"
        return False
    return True


def widths_identity(source: ModelSource) -> dict[str, str]:
    """What decides `linear_input_widths`: the model's content and the transformers that builds it."""
    return _config_fact_identity("widths_of", source)


def _config_fact_identity(fact: str, source: ModelSource) -> dict[str, str]:
    """A fact read from the model's config on the meta device, under its own key: the model's content and the
    transformers that builds it."""
    from importlib.metadata import version

    return {
        fact: source.identity,
        "trust_remote_code": str(source.trust_remote_code),
        "transformers": version("transformers"),
    }


def linear_input_widths(source: ModelSource) -> dict[str, int]:
    """Input width of every nn.Linear except lm_head, from the config alone (meta device, no weights)."""
    import torch

    return {
        name: module.in_features
        for name, module in _meta_model(source).named_modules()
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")
    }


def _meta_model(source: ModelSource) -> torch.nn.Module:
    """The model as its config builds it, on the meta device: its modules' names and shapes, no weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    location, kwargs = _from_pretrained_args(source)
    try:
        config = AutoConfig.from_pretrained(location, **kwargs)
    except Exception as error:  # noqa: BLE001 - any failure here is the user's source being unusable
        raise bad_input("", "model.source", f"cannot read the model config of {source.display}: {error}") from None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=source.trust_remote_code)


def module_classes_identity(source: ModelSource) -> dict[str, str]:
    """What decides `module_classes`: as `widths_identity`, under a key of its own (another fact, another file)."""
    return _config_fact_identity("module_classes_of", source)


def module_classes(source: ModelSource) -> dict[str, list[str]]:
    """Every module's name (the root is "") -> the names of the nn.Module classes in its MRO, from the config alone
    (meta device, no weights): what llm-compressor's `ignore` and `targets` patterns are matched against (a name,
    or a class name such as "Linear"). A tied lm_head is still a module of its own here, as when it is loaded."""
    import torch

    return {
        name: [cls.__name__ for cls in type(module).__mro__ if issubclass(cls, torch.nn.Module)]
        for name, module in _meta_model(source).named_modules()
    }


def pick_device(runtime: RuntimeSettings) -> str:
    import torch

    if runtime.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if runtime.device == "cuda" and not torch.cuda.is_available():
        raise bad_input("", "runtime.device", "cuda was asked for but no CUDA device is available")
    return runtime.device


def pick_dtype(runtime: RuntimeSettings, device: str) -> torch.dtype:
    """bfloat16 on CUDA; float32 on CPU, where bf16 matmuls are emulated and slow (exact upcast)."""
    import torch

    if runtime.dtype == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, runtime.dtype)


def materialize(source: ModelSource, cache_root: Path) -> ModelSource:
    """A GGUF source as a checkpoint directory (float32, exact dequantization), made once: llm-compressor
    and every later stage want config.json. Other sources pass through."""
    if source.kind != "gguf":
        return source
    import torch
    from transformers import AutoModelForCausalLM

    identity, target = _conversion(source, cache_root)
    if not cache.is_complete(target):
        location, kwargs = _from_pretrained_args(source)
        dequantized, tokenizer = _load(location, torch.float32, "cpu", kwargs, kwargs)
        # A GGUF-loaded model refuses save_pretrained; a fresh one from its config, minus the
        # GGUF quantization_config (the weights are dequantized now), does not.
        settings = {k: v for k, v in dequantized.config.to_dict().items() if k != "quantization_config"}
        config = type(dequantized.config).from_dict(settings)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(dequantized.state_dict())
        model.generation_config = dequantized.generation_config
        with cache.writing(target, identity) as scratch:
            model.save_pretrained(scratch)
            tokenizer.save_pretrained(scratch)
    return _converted(source, target)


def materialized(source: ModelSource, cache_root: Path) -> ModelSource:
    """`materialize`'s result when the cache already holds it, else `source` itself: reading a GGUF's
    config means parsing its whole metadata (about 11 s for the embedded model), a config.json does not."""
    if source.kind != "gguf":
        return source
    _, target = _conversion(source, cache_root)
    return _converted(source, target) if cache.is_complete(target) else source


def _conversion(source: ModelSource, cache_root: Path) -> tuple[dict[str, str], Path]:
    identity = {"source": source.identity, "dtype": "float32"}
    return identity, cache_root / "sources" / cache.cache_key(identity)


def _converted(source: ModelSource, directory: Path) -> ModelSource:
    return replace(source, kind="local_dir", location=str(directory), gguf_file=None)


def load_source_model(source: ModelSource, dtype: torch.dtype, device: str) -> LoadedModel:
    """The recipe's model from a checkpoint directory or the hub (GGUF: `materialize` first)."""
    if source.kind == "gguf":
        raise ValueError("materialize() a GGUF source before loading it")
    location, kwargs = _from_pretrained_args(source)
    return _load(location, dtype, device, kwargs, kwargs)


def load_checkpoint(checkpoint: Path, dtype: torch.dtype, device: str) -> LoadedModel:
    """A saved variant (plain or compressed-tensors), spread over the GPUs on CUDA.

    On CUDA, FP8 compressed-tensors weights stay FP8 and run FP8 matmuls (SM 8.9+) instead of being
    dequantized; quantlab.measure.provenance reports which path ran (no FP8 matmuls: a warned fallback)."""
    import json

    config = json.loads((checkpoint / "config.json").read_text())
    fast = {}
    if device == "cuda" and (config.get("quantization_config") or {}).get("quant_method") == "compressed-tensors":
        from transformers.utils.quantization_config import CompressedTensorsConfig

        fast = {"quantization_config": CompressedTensorsConfig(use_optimized_inference=True)}
    return _load(checkpoint, dtype, device, {}, fast)


def _load(location: str | Path, dtype: torch.dtype, device: str, tokenizer_args: dict, model_args: dict) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(location, **tokenizer_args)
    # device_map="auto" lets Accelerate spread a model larger than one GPU over several.
    placement = {"device_map": "auto"} if device == "cuda" else {}
    model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **placement, **model_args)
    return model.eval(), tokenizer
