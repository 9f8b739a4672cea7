"""The runner's stages, each an adapter from a variant's job to its library code and back.

- `quantize`: reuse a cached checkpoint or make one with the variant's method (`quantlab.quantize`);
  `calibration`: the samples a method that needs them calibrates on.
- `evaluate`: lm-eval scores, token damage and paired statistics against the baseline (`quantlab.evaluate`).
- `measure`: the measured and modeled cost of the loaded variant (`quantlab.measure`).
"""
