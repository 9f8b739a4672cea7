"""Serving engines by recipe name (`serving.engine`). A new engine is one file here plus one line below."""

from quantlab.serving.engines.base import Engine, InstallSpec, Launch, Support
from quantlab.serving.engines.transformers_serve import TransformersServe
from quantlab.serving.engines.vllm import VLLM

ENGINES: dict[str, Engine] = {
    "transformers": TransformersServe(),
    "vllm": VLLM(),
}

__all__ = ["ENGINES", "Engine", "InstallSpec", "Launch", "Support"]
