"""`quantlab sensitivity`: which layers a variant's quantization damages most, one group of layers at a time.

groups: which modules form a group, the ranking, and the recipe that keeps the worst groups in BF16 (pure).
probe: the measurement (two models in memory, one group of the quantized model's modules swapped in at a time).
command: the run in MLflow, resumable, with its chart and ranking.
"""
