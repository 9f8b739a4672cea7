"""Serving cost under load: each variant behind a real OpenAI-compatible server (transformers or vLLM), driven by
guidellm. settings (the recipe section) -> launcher (the server) -> load (guidellm) -> levels (its report) ->
goodput and pricing (what it costs) -> chart."""
