"""Where a model comes from (hub id, local directory, GGUF file, packaged file) and how it loads.

A GGUF model is dequantized once into a checkpoint directory (`materialize`): for the embedded
SmolLM2 default that dequantized Q4_1 model *is* the "BF16 baseline".
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from quantlab import cache, fake_quant
from quantlab.errors import bad_input
from quantlab.quantize.cpu_loading import cpu_decompression, upcast_decompressed

if TYPE_CHECKING:
    import torch
    from gguf import GGUFReader
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
    calibrated = calibration is not None and variant.needs_calibration
    return {
        "model": source.identity,
        "method": variant.method,
        "params": variant.params.model_dump(),
        "calibration": calibration.model_dump() if calibrated else None,
        "versions": cache.library_versions(),
    } | ({"kv_cache": variant.kv_cache.model_dump()} if variant.kv_cache is not None else {})  # keys without: as before


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
    """Input width of every nn.Linear except lm_head, from the config alone: read off a plain Llama's config
    (`_llama_widths`: a checkpoint directory's config.json, or a GGUF file's metadata), else from the model built on
    the meta device (no weights)."""
    if (widths := _llama_widths(source)) is not None:
        return widths
    import torch

    return {
        name: module.in_features
        for name, module in _meta_model(source).named_modules()
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")
    }


# The Llama config.json fields that decide its Linear layers' input widths; each must be written in the file, so that
# no class default (which another model type, or another transformers, may set otherwise) is guessed at.
_LLAMA_WIDTH_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Where a GGUF file of the llama architecture keeps those fields (and head_dim): transformers' own mapping
# (transformers.integrations.ggml.GGUF_CONFIG_MAPPING["llama"]), written out because importing that module costs about
# 2 s; tests/test_models.py holds the widths read through it to the meta build of the same file.
_GGUF_LLAMA_FIELDS = {
    "llama.embedding_length": "hidden_size",
    "llama.feed_forward_length": "intermediate_size",
    "llama.block_count": "num_hidden_layers",
    "llama.attention.head_count": "num_attention_heads",
    "llama.rope.dimension_count": "head_dim",
}


def _llama_widths(source: ModelSource) -> dict[str, int] | None:
    """The widths `linear_input_widths` reads off the meta model, in its order, for a plain Llama
    (LlamaForCausalLM: attention q/k/v/o and MLP gate/up/down per layer); None for anything else (another model type,
    remote code, a quantization config, a field left to its default), which is built on the meta device instead.
    Saves importing transformers and torch in a sweep's own process, which needs neither otherwise (and, for a GGUF,
    the config transformers builds from its whole metadata). tests/test_models.py holds both ways to the same answer."""
    config = _llama_config(source)
    if (
        not isinstance(config, dict)
        or config.get("model_type") != "llama"
        or config.get("architectures", ["LlamaForCausalLM"]) != ["LlamaForCausalLM"]
        or any(key in config for key in ("auto_map", "quantization_config"))
    ):
        return None
    sizes = [config.get(key) for key in _LLAMA_WIDTH_FIELDS]
    head_dim = config.get("head_dim")  # absent or null: hidden_size // num_attention_heads, as LlamaConfig sets it
    if not all(_positive_int(size) for size in sizes) or not (head_dim is None or _positive_int(head_dim)):
        return None
    hidden, intermediate, layers, heads = sizes
    per_layer = {
        "self_attn.q_proj": hidden,
        "self_attn.k_proj": hidden,
        "self_attn.v_proj": hidden,
        "self_attn.o_proj": heads * (head_dim or hidden // heads),
        "mlp.gate_proj": hidden,
        "mlp.up_proj": hidden,
        "mlp.down_proj": intermediate,
    }
    return {f"model.layers.{layer}.{name}": width for layer in range(layers) for name, width in per_layer.items()}


def _llama_config(source: ModelSource) -> object:
    """The config fields `_llama_widths` reads: a checkpoint directory's config.json, or a local GGUF file's metadata
    of the llama architecture as transformers maps it; None where neither applies (a hub model, another GGUF
    architecture, a file that cannot be read: the meta build reads it again and says why it cannot)."""
    if source.kind == "local_dir":
        try:
            return json.loads((Path(source.location) / "config.json").read_text())
        except (OSError, ValueError):
            return None
    if source.kind != "gguf" or source.gguf_file is None:
        return None
    try:
        fields = gguf_reader(Path(source.location) / source.gguf_file).fields
    except Exception:  # noqa: BLE001 - any unreadable file: the meta build reads it again and says why it cannot
        return None
    if (architecture := fields.get("general.architecture")) is None or architecture.contents() != "llama":
        return None
    found = {name: fields[key].contents() for key, name in _GGUF_LLAMA_FIELDS.items() if key in fields}
    return {"model_type": "llama"} | found


def _positive_int(value: object) -> bool:
    return type(value) is int and value > 0


def _meta_model(source: ModelSource) -> torch.nn.Module:
    """The model as its config builds it, on the meta device: its modules' names and shapes, no weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    location, kwargs = _from_pretrained_args(source)
    try:
        with gguf_parsed_once():
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
    """bfloat16 on CUDA and on a CPU with BF16 matmul instructions (the precision a GPU computes in, at half the
    bytes per weight); float32 on other CPUs, where BF16 matmuls are emulated and slower than float32's."""
    import torch

    return getattr(torch, compute_dtype_name(runtime, device))


def compute_dtype_name(runtime: RuntimeSettings, device: str) -> str:
    """`pick_dtype`'s choice by name, found without importing torch (`validate` checks it against the engine's
    kernels)."""
    return default_dtype_name(device) if runtime.dtype == "auto" else runtime.dtype


def default_dtype(device: str) -> torch.dtype:
    import torch

    return getattr(torch, default_dtype_name(device))


def default_dtype_name(device: str) -> str:
    return "bfloat16" if device == "cuda" or (device == "cpu" and cpu_has_bf16_matmuls()) else "float32"


def cpu_has_bf16_matmuls() -> bool:
    """Whether this CPU multiplies BF16 in hardware (x86's AVX512-BF16 or AMX-BF16), where oneDNN's BF16 matmuls
    outrun float32's (benchmarks/cpu_dtype.py measures both). Elsewhere torch emulates them."""
    import torch

    capabilities = torch.cpu.get_capabilities()
    return bool(capabilities.get("avx512_bf16") or capabilities.get("amx_bf16"))


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
        with gguf_parsed_once():
            dequantized, tokenizer = _load(location, torch.float32, "cpu", kwargs, kwargs)
        # A GGUF-loaded model refuses save_pretrained; a fresh one from its config, minus the
        # GGUF quantization_config (the weights are dequantized now), does not. Made on the meta device: its
        # random initialization (about 1 s for the embedded model) would be overwritten at once.
        settings = {k: v for k, v in dequantized.config.to_dict().items() if k != "quantization_config"}
        config = type(dequantized.config).from_dict(settings)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(dequantized.state_dict(), assign=True)
        model.tie_weights()
        model.generation_config = dequantized.generation_config
        with cache.writing(target, identity) as scratch:
            model.save_pretrained(scratch)
            tokenizer.save_pretrained(scratch)
    return _converted(source, target)


def gguf_reader(path: Path) -> GGUFReader:
    """The GGUF file's reader, made once per process for each version of the file (`gguf_parsed_once`)."""
    stat = path.stat()
    return _gguf_reader(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _gguf_reader(path: str, size: int, modified_ns: int) -> GGUFReader:
    from gguf.gguf_reader import GGUFReader  # its own module's: `gguf.GGUFReader` is replaced in gguf_parsed_once

    return GGUFReader(path)  # read-only: it maps the file and parses its metadata, which no caller changes


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """transformers reads a GGUF file's whole metadata again for its config, its tokenizer (twice) and its model;
    inside this block each is read once. Measured on the embedded model (a 135M Llama, 49k-token vocabulary):
    - every read-only parse of a file reuses `gguf_reader`'s (about 3 s each: the reader builds the vocabulary and
      merges item by item);
    - each field value is decoded once (`_gguf_parse_value`, about 1 s per metadata read), the reader's parts being
      the same objects each time;
    - gguf's tensor-name table is built once per architecture and depth (`get_tensor_name_map`; transformers builds
      it again for each of the model's 400 modules, about 8 s in all).
    transformers imports the reader class and the table from `gguf` at each call, and calls the value parser by its
    module's global name, so replacing those attributes for the block reaches every caller."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as gguf_loading

    previous = gguf.GGUFReader, gguf.get_tensor_name_map, gguf_loading._gguf_parse_value
    library_reader, library_name_map, library_parse = previous
    parsed: dict[int, tuple[object, object]] = {}  # id(part) -> (part, value): the part kept alive, so its id holds

    def reused(path: str | Path, mode: str = "r") -> GGUFReader:
        return gguf_reader(Path(path)) if mode == "r" else library_reader(path, mode)

    def parsed_once(part: object, types: object) -> object:
        if (found := parsed.get(id(part))) is None:
            found = parsed[id(part)] = (part, library_parse(part, types))
        return found[1]

    gguf.GGUFReader = reused
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(library_name_map)
    gguf_loading._gguf_parse_value = parsed_once
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map, gguf_loading._gguf_parse_value = previous


def materialized(source: ModelSource, cache_root: Path) -> ModelSource:
    """`materialize`'s result when the cache already holds it, else `source` itself: reading a GGUF's
    config means parsing its whole metadata (about 3 s for the embedded model), a config.json does not."""
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
    dequantized; quantlab.measure.provenance reports which path ran (no FP8 matmuls: a warned fallback).
    On a CPU the activations' fake quantization goes through `fake_quant` (the same values, faster)."""
    import json

    config = json.loads((checkpoint / "config.json").read_text())
    if (config.get("quantization_config") or {}).get("quant_method") != "compressed-tensors":
        return _load(checkpoint, dtype, device, {}, {})
    if device == "cuda":
        from transformers.utils.quantization_config import CompressedTensorsConfig

        fast = CompressedTensorsConfig(use_optimized_inference=rowwise_fp8(config["quantization_config"]))
        return _load(checkpoint, dtype, device, {}, {"quantization_config": fast})
    fake_quant.install()
    model, tokenizer = _load(checkpoint, dtype, device, {}, cpu_decompression())
    upcast_decompressed(model, dtype)
    return model, tokenizer


def rowwise_fp8(quantization_config: dict) -> bool:
    """Whether transformers' FP8 kernel (`use_optimized_inference`) can run this checkpoint: it takes any group with
    8-bit float weights, and reshapes their scales to one per output row, so per-group (MXFP8) or per-block
    (FP8_BLOCK) scales would be misread. Only per-channel or per-tensor FP8 weights (FP8_DYNAMIC, FP8) go there."""
    weights = [group.get("weights") or {} for group in (quantization_config.get("config_groups") or {}).values()]
    fp8 = [w for w in weights if w.get("type") == "float" and w.get("num_bits") == 8]
    return bool(fp8) and all(w.get("strategy") in ("channel", "tensor") for w in fp8)


def _load(location: str | Path, dtype: torch.dtype, device: str, tokenizer_args: dict, model_args: dict) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(location, **tokenizer_args)
    # device_map="auto" lets Accelerate spread a model larger than one GPU over several.
    placement = {"device_map": "auto"} if device == "cuda" else {}
    model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **placement, **model_args)
    return model.eval(), tokenizer
