"""Quality of a variant: lm-eval tasks, and its damage against the baseline."""
