"""Both scoring paths feed the model the same tokens: lm-eval's in-process HFLM and its local-completions against a
server encode every (context, continuation) pair alike, BOS included where the tokenizer adds one (Llama 3's
does; SmolLM2's, the tiny model's, does not: the BOS tokenizer here is SmolLM2's with a BOS template added)."""

from __future__ import annotations

import pytest
from tiny import with_bos_template

from quantlab.evaluate.lm_eval_runner import adds_bos, served_language_model
from quantlab.serving.engines import ENGINES

PAIRS = [("The capital of France is", " Paris"), ("Question: 2 + 2 =", " 4"), ("def f(x):\n    return", " x")]


@pytest.mark.parametrize("bos", [True, False])
def test_served_scoring_encodes_every_pair_as_the_reference_does(tmp_path, tiny_llama, bos):
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = with_bos_template(tiny_llama.path, tmp_path / "bos") if bos else tiny_llama.path
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    assert adds_bos(tokenizer) is bos
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    reference = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, add_bos_token=adds_bos(tokenizer))
    # Built as the served stage builds it; nothing is sent to the (absent) server to encode.
    served = served_language_model(ENGINES["vllm"], "http://127.0.0.1:9", str(checkpoint), checkpoint, 1, 256, 1)
    for context, continuation in PAIRS:
        sent = served._encode_pair(context, continuation)
        assert sent == reference._encode_pair(context, continuation)
        assert (sent[0][0] == tokenizer.bos_token_id) is bos
    # lm-eval's own default for local-completions sends no BOS: with a BOS tokenizer it would differ.
    if bos:
        from lm_eval.models.openai_completions import LocalCompletionsAPI

        default = LocalCompletionsAPI(
            base_url="http://127.0.0.1:9/v1/completions",
            model=str(checkpoint),
            tokenizer_backend="huggingface",
            tokenizer=str(checkpoint),
        )
        assert default._encode_pair(*PAIRS[0]) != reference._encode_pair(*PAIRS[0])
