"""The bundled long-context retrieval tasks `pydoc_passkey_{512,2k,8k}` (evals/pydoc_passkey_*.yaml, built by
evals/passkey_dataset.py): each document hides a pass key at a seeded depth of filler from the language reference, one
task per context length, so that every length gets its own paired verdict."""

from __future__ import annotations

import re
from types import ModuleType

import pytest
from test_evals import BUNDLED_EVALS_DIR, load_evals_module

from quantlab import corpora
from quantlab.evaluate.lm_eval_runner import TaskRequest, known_tasks, run_tasks
from quantlab.metrics import Scale

LENGTHS = {"pydoc_passkey_512": 512, "pydoc_passkey_2k": 2048, "pydoc_passkey_8k": 7680}  # the YAMLs' tokens
EMBEDDED_CONTEXT = 8192  # SmolLM2-135M's max_position_embeddings
MAX_GEN_TOKS = 8


def passkey_module() -> ModuleType:
    return load_evals_module("passkey_dataset.py")


def test_each_length_is_a_task_of_its_own_under_one_tag() -> None:
    known = known_tasks(BUNDLED_EVALS_DIR, defaults=False)
    assert set(LENGTHS) | {"pydoc_passkey"} <= known
    assert not any(name.endswith("_template_yaml") for name in known)  # the shared template is not a task


@pytest.mark.parametrize(("task", "tokens"), sorted(LENGTHS.items()))
def test_documents_hide_one_key_in_real_prose_at_the_length_named(task, tokens, tiny_llama) -> None:
    from transformers import AutoTokenizer

    passkey = passkey_module()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama.path)  # the embedded model's own
    rows = passkey.documents(tokens, 12, 0)
    assert rows == passkey.documents(tokens, 12, 0)  # seeded: the same documents on every machine
    eval_text = corpora.text("eval")
    for row in rows:
        key, context = row["target"], row["context"]
        assert re.fullmatch(r"\d{5}", key)
        needle = passkey.NEEDLE.format(key=key)
        assert context.count(key) == 2 and context.count(needle) == 1  # the key's one sentence holds it twice
        assert context.endswith(passkey.QUESTION)
        filler = context.removesuffix(passkey.QUESTION).replace(needle + " ", "")
        assert filler[:200] in eval_text and filler[-200:] in eval_text  # real prose around it
        length = len(tokenizer(context).input_ids)
        assert 0.85 * tokens <= length <= 1.15 * tokens, (task, length)
        assert length + MAX_GEN_TOKS <= EMBEDDED_CONTEXT  # nothing cut off on the embedded model
    depths = [row["depth"] for row in passkey.documents(tokens, 64, 0)]
    assert min(depths) < 0.2 and max(depths) > 0.8  # hidden near the start and near the end
    assert len({row["target"] for row in rows}) == len(rows)


def test_a_key_generated_is_an_exact_match_per_document(tiny_llama) -> None:
    """Through lm-eval's generate_until and its filter: 0 or 1 per document, greedy, so two runs pair."""
    model, tokenizer = tiny_llama.load()
    (scored,) = run_tasks(model, tokenizer, [TaskRequest("pydoc_passkey_512", limit=4)], BUNDLED_EVALS_DIR, 4)
    score = scored.primary
    assert score.key == "eval/pydoc_passkey_512/exact_match:remove_whitespace"
    assert score.scale is Scale.FRACTION and score.higher_is_better is True
    assert sorted(score.documents.values) == [0, 1, 2, 3] and set(score.documents.values.values()) <= {0.0, 1.0}
    passkey = passkey_module()
    assert [scored.answers[d, 0].gold for d in range(4)] == [row["target"] for row in passkey.documents(512, 4, 0)]
    assert (
        scored.settings.gen_kwargs["max_gen_toks"] == MAX_GEN_TOKS and scored.settings.gen_kwargs["do_sample"] is False
    )
