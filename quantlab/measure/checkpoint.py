"""Facts about a saved checkpoint from its safetensors headers (an 8-byte little-endian length, then JSON
with every tensor's dtype, shape and byte range), without loading a tensor."""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

# Decoder blocks of HF causal LMs live under `...layers.<index>.` (Llama, Mistral, Qwen, Gemma, Phi-3).
_DECODER_LAYER = re.compile(r"(^|\.)layers\.\d+\.")


@dataclass(frozen=True)
class TensorFact:
    name: str
    dtype: str  # safetensors spelling: BF16, F8_E4M3, I32, ...
    shape: tuple[int, ...]
    nbytes: int

    @property
    def module(self) -> str:
        return self.name.rpartition(".")[0]

    @property
    def attribute(self) -> str:
        return self.name.rpartition(".")[2]


@dataclass(frozen=True)
class CheckpointFacts:
    file_sizes: tuple[tuple[str, int], ...]  # (file name, bytes on disk) of every *.safetensors
    tensors: tuple[TensorFact, ...]

    @classmethod
    def from_dir(cls, checkpoint_dir: Path) -> CheckpointFacts:
        files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
        return cls(
            file_sizes=tuple((file.name, file.stat().st_size) for file in files),
            tensors=tuple(tensor for file in files for tensor in read_safetensors_header(file)),
        )

    @property
    def file_bytes(self) -> int:
        """Bytes on disk: what a download or a copy moves (headers included)."""
        return sum(size for _, size in self.file_sizes)

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data: what a server that keeps the stored format holds in memory."""
        return sum(tensor.nbytes for tensor in self.tensors)

    def linear_weight_bytes(self) -> int:
        """Bytes of the decoder blocks' linear layers: every `weight*` tensor (weight, packed
        weight, scales, zero points) of a module in a decoder layer that stores a 2-D weight.
        Norms (1-D) and activation scales (`input_scale`) are not linear weights."""
        linear_modules = {
            tensor.module
            for tensor in self.tensors
            if _DECODER_LAYER.search(tensor.name)
            and tensor.attribute in ("weight", "weight_packed")
            and len(tensor.shape) == 2
        }
        weights = [tensor for tensor in self.tensors if tensor.attribute.startswith("weight")]
        return sum(tensor.nbytes for tensor in weights if tensor.module in linear_modules)

    def input_embedding_bytes(self) -> int:
        """Bytes of the input embedding table (0 when none is recognised)."""
        return sum(tensor.nbytes for tensor in self.tensors if tensor.name.endswith("embed_tokens.weight"))


def read_safetensors_header(path: Path) -> list[TensorFact]:
    with open(path, "rb") as file:
        (header_length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(header_length))
    return [
        TensorFact(name, entry["dtype"], tuple(entry["shape"]), entry["data_offsets"][1] - entry["data_offsets"][0])
        for name, entry in header.items()
        if name != "__metadata__"
    ]
