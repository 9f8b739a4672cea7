"""quantlab: which precision should we ship? Quantize, score, measure and log model variants."""

__version__ = "0.1.0"
