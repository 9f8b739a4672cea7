"""Both scoring paths score lm-eval's requests in the same windows: one max_length, chosen once per variant, makes
HFLM (in process) and local-completions (through the server) cut rolling perplexity windows, (context,
continuation) pairs and generation contexts at the same tokens. lm-eval's own methods build each path's requests
here; nothing runs the model or reaches a server."""

from __future__ import annotations

import pytest
import torch
from tiny import with_bos_template

from quantlab.evaluate.lm_eval_runner import (
    SERVED_MAX_LENGTH_MARGIN,
    adds_bos,
    model_context,
    scoring_max_length,
    served_language_model,
)
from quantlab.recipe import Recipe
from quantlab.serving.engines import ENGINES
from quantlab.stages.evaluate import evaluation_max_length
from recipes import tiny_recipe

WINDOW = 48  # short windows, so that a short text spans several
TEXT = " ".join(f"Sentence {i} of a long document, which lm-eval scores window by window." for i in range(40))


@pytest.mark.parametrize(
    ("context", "server_max_model_len", "expected"),
    [
        (131072, None, 131072),  # in process only: the model's own context, as lm-eval's HFLM takes it
        (131072, 4096, 4094),  # Llama 3 through a server at quantlab's default cap
        (8192, 4096, 4094),  # SmolLM2 likewise
        (8192, 8192, 8190),  # a server at the model's own context
        (2048, 8192, 2048),  # a server that accepts more than the model: the model's context
        (4096, 4098, 4096),  # room for exactly the served request's extra tokens
        (1024, 3, 1),  # the shortest server that still scores a token
    ],
)
def test_one_max_length_for_both_paths(context, server_max_model_len, expected):
    assert scoring_max_length(context, server_max_model_len) == expected


def test_a_server_too_short_to_score_a_token_is_refused():
    with pytest.raises(ValueError, match="no token to score"):
        scoring_max_length(1024, SERVED_MAX_LENGTH_MARGIN)


@pytest.mark.parametrize(
    ("engine", "serving", "expected"),
    [
        ("reference", {"enabled": False}, 1024),  # the tiny model's max_position_embeddings
        ("both", {"enabled": False}, 1024 - SERVED_MAX_LENGTH_MARGIN),  # its server: the model's own 1024
        ("served", {"enabled": False, "max_model_len": 512}, 512 - SERVED_MAX_LENGTH_MARGIN),
        ("both", {"enabled": False, "max_model_len": 512}, 512 - SERVED_MAX_LENGTH_MARGIN),
        ("reference", {"enabled": False, "max_model_len": 512}, 1024),  # a server that scores nothing: no limit
    ],
)
def test_a_variant_is_scored_within_what_its_server_accepts(tiny_llama, engine, serving, expected):
    model, tokenizer = tiny_llama.load()
    base = tiny_recipe(tiny_llama.path)
    recipe = Recipe.model_validate(base | {"evals": base["evals"] | {"engine": engine}, "serving": serving})
    assert model_context(model, tokenizer) == 1024
    assert evaluation_max_length(model, tokenizer, recipe, tiny_llama.path) == expected


@pytest.fixture(scope="module", params=[False, True], ids=["no-bos", "bos"])
def both_paths(request, tmp_path_factory, tiny_llama):
    """The reference's HFLM and the served path's local-completions, each given the shared max_length as the
    evaluate stage gives it (a tokenizer that adds BOS, as Llama 3's does, and one that adds none)."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = (
        with_bos_template(tiny_llama.path, tmp_path_factory.mktemp("bos") / "bos") if request.param else tiny_llama.path
    )
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    reference = HFLM(
        pretrained=model, tokenizer=tokenizer, batch_size=1, add_bos_token=adds_bos(tokenizer), max_length=WINDOW
    )
    served = served_language_model(ENGINES["vllm"], "http://127.0.0.1:9", str(checkpoint), checkpoint, 1, WINDOW, 1)
    return reference, served, checkpoint


def _rolling_windows(language_model, monkeypatch) -> list[tuple]:
    """The (context, continuation) token windows `language_model`'s own loglikelihood_rolling scores TEXT in."""
    from lm_eval.api.instance import Instance

    windows: list[tuple] = []

    def record(requests, **kwargs):
        windows.extend(requests)
        return [(0.0, True)] * len(requests)

    monkeypatch.setattr(language_model, "_loglikelihood_tokens", record)
    language_model.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (TEXT,), 0)], disable_tqdm=True)
    return windows


def test_rolling_perplexity_windows_are_the_same_tokens_on_both_paths(both_paths, monkeypatch):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    reference, served, checkpoint = both_paths
    windows = _rolling_windows(reference, monkeypatch)
    assert len(windows) > 3
    assert _rolling_windows(served, monkeypatch) == windows
    assert all(len(continuation) <= WINDOW for _, _, continuation in windows)
    assert len(windows[0][2]) == WINDOW  # full windows of the shared length
    # Given the same figure as HFLM, as quantlab did before, lm-eval's local-completions cuts shorter windows.
    as_before = LocalCompletionsAPI(
        base_url="http://127.0.0.1:9/v1/completions",
        model=str(checkpoint),
        tokenizer_backend="huggingface",
        tokenizer=str(checkpoint),
        add_bos_token=reference.add_bos_token,
        max_length=WINDOW,
    )
    assert len(_rolling_windows(as_before, monkeypatch)[0][2]) == WINDOW - SERVED_MAX_LENGTH_MARGIN


def test_loglikelihood_pairs_are_cut_at_the_same_token_on_both_paths(both_paths, monkeypatch):
    reference, served, _ = both_paths
    context, continuation = served._encode_pair(TEXT, " the end")
    assert len(context) > WINDOW  # left-truncated on both paths
    fed: list[list[int]] = []

    def record(inputs, **kwargs):
        fed.extend(inputs.tolist())
        return torch.zeros(*inputs.shape, reference.model.config.vocab_size)

    monkeypatch.setattr(reference, "_model_call", record)
    reference._loglikelihood_tokens([((TEXT, " the end"), context, continuation)], disable_tqdm=True)
    (sent,), (not_scored,), _ = served.batch_loglikelihood_requests([[((TEXT, " the end"), context, continuation)]])
    # HFLM feeds all but the last scored token (the logits before it score it); the server is sent it too.
    assert sent == fed[0] + continuation[-1:]
    assert sent[not_scored:] == continuation
    assert len(sent) + 1 <= WINDOW + SERVED_MAX_LENGTH_MARGIN  # with its one generated token, within the server


def test_generation_contexts_are_cut_at_the_same_token_on_both_paths(both_paths, monkeypatch):
    from lm_eval.api.instance import Instance

    reference, served, _ = both_paths
    generate = {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False}
    request = Instance("generate_until", {}, (TEXT, generate), 0)
    contexts: dict[str, list[int]] = {}

    def reference_generate(context, **kwargs):
        contexts["reference"] = context[0].tolist()
        return torch.cat([context, context[:, -1:]], dim=1)

    def served_call(messages, **kwargs):
        contexts["served"] = list(messages[0])
        return {"choices": [{"index": 0, "text": " x"}]}

    monkeypatch.setattr(reference, "_model_generate", reference_generate)
    monkeypatch.setattr(served, "model_call", served_call)
    reference.generate_until([request], disable_tqdm=True)
    served.generate_until([request], disable_tqdm=True)
    assert len(contexts["reference"]) == WINDOW - generate["max_gen_toks"]  # cut: the text is longer
    assert contexts["served"] == contexts["reference"]
    assert served.max_length == WINDOW + SERVED_MAX_LENGTH_MARGIN - 1  # loglikelihood's limit again afterwards
