"""The runner's stages, each an adapter from a variant's job to its library code and back: quantize
(and the calibration samples it needs), evaluate (lm-eval, token damage, paired statistics), measure."""
