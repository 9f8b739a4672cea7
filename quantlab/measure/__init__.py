"""The cost of a variant: `cost.measure_cost` (measured in its own process, plus modeled), `modeled.modeled_cost`
(from a config and checkpoint alone) and `settings.MeasureSettings` (the recipe's `measure` section)."""
