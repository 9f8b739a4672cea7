"""Regenerate the bundled offline lm-eval data files (``evals/data/*.jsonl``).

Every source is something each machine already has, so anyone can check that the committed
files are exactly what this script makes:

- ``mmlu_dev``: the MMLU dev questions that lm-eval's own package ships inside its
  chain-of-thought few-shot prompts (``lm_eval/tasks/mmlu/flan_cot_fewshot/_cot_prompts.json``);
- ``pydoc_cloze``: sentence continuations from CPython's language-reference prose
  (``quantlab.corpora.paragraphs("eval")``), with distractor endings taken from other sentences;
- ``pydoc_recall``: the same prose, each passage cut before the last words of a sentence that repeat
  words from earlier in the passage, to be generated (exact match).

Usage (from anywhere): ``python evals/build.py`` rewrites the files; ``--check`` only compares.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

EVALS_DIR = Path(__file__).resolve().parent
DATA_DIR = EVALS_DIR / "data"

# Run as a plain script, Python puts evals/ (not the repository root) on sys.path.
if __package__ in (None, "") and str(EVALS_DIR.parent) not in sys.path:
    sys.path.insert(0, str(EVALS_DIR.parent))

from quantlab import corpora  # noqa: E402

Item = dict[str, object]
LETTERS = "ABCD"

# --------------------------------------------------------------------------- mmlu_dev

# One question of the chain-of-thought prompts: the question, exactly four lettered options
# (on one line or one per line), the worked answer, and its final letter.
_COT_QUESTION = re.compile(
    r"^(?P<question>.+?)\n"
    r"\(A\) (?P<A>.+?)\s\(B\) (?P<B>.+?)\s\(C\) (?P<C>.+?)\s\(D\) (?P<D>.+?)\n"
    r"A: .*?The answer is \((?P<answer>[ABCD])\)",
    re.DOTALL,
)


def lm_eval_cot_prompts_path() -> Path:
    import lm_eval

    return Path(lm_eval.__file__).parent / "tasks/mmlu/flan_cot_fewshot/_cot_prompts.json"


def mmlu_dev_items() -> list[Item]:
    """Every MMLU dev question in lm-eval's CoT prompts that parses as four-option A-D."""
    prompts: dict[str, str] = json.loads(lm_eval_cot_prompts_path().read_text(encoding="utf-8"))
    items: list[Item] = []
    for subject in sorted(prompts):
        # The first block is the "The following are multiple choice questions..." header.
        for block in prompts[subject].split("\n\nQ: ")[1:]:
            match = _COT_QUESTION.match(block)
            if match is None:  # five options, or an answer that never names its letter
                continue
            choices = [" ".join(match[letter].split()) for letter in LETTERS]
            if any("(E)" in choice for choice in choices):
                continue
            items.append(
                {
                    "subject": subject,
                    "subject_name": subject.replace("_", " "),
                    "question": match["question"].strip(),
                    "choices": choices,
                    "answer": LETTERS.index(match["answer"]),
                }
            )
    return items


# --------------------------------------------------------------------------- pydoc_cloze

CLOZE_SEED = 20250101
CLOZE_MIN_WORDS, CLOZE_MAX_WORDS = 10, 40
# A distractor ending is drawn among the endings whose length is closest to the true one, so
# that neither summed nor length-normalised log-likelihood can win on length alone.
CLOZE_DISTRACTOR_POOL = 12

_SENTENCE_BREAK = re.compile(r'(?<=[.!?])\s+(?=[A-Z"*(])')


def sentences(paragraph: str) -> list[str]:
    return _SENTENCE_BREAK.split(paragraph)


def _is_cloze_sentence(sentence: str) -> bool:
    return CLOZE_MIN_WORDS <= len(sentence.split()) <= CLOZE_MAX_WORDS and sentence.endswith(".")


def _shares_text_with(paragraph: str, other_text: str) -> bool:
    return any(len(s.split()) >= 6 and s in other_text for s in sentences(paragraph))


def pydoc_cloze_items() -> list[Item]:
    """One item per eval paragraph: its text up to the middle of a sentence, then 4 endings."""
    rng = random.Random(CLOZE_SEED)
    calibration_text = corpora.text("calibration")

    drafts: list[tuple[str, str]] = []  # (context, true ending)
    for paragraph in corpora.paragraphs("eval"):
        # Topics are disjoint between splits, yet boilerplate sentences repeat across topics.
        if _shares_text_with(paragraph, calibration_text):
            continue
        parts = sentences(paragraph)
        candidates = [i for i, s in enumerate(parts) if _is_cloze_sentence(s)]
        if not candidates:
            continue
        chosen = rng.choice(candidates)
        words = parts[chosen].split()
        cut = len(words) // 2
        context = " ".join([*parts[:chosen], *words[:cut]])
        drafts.append((context, " ".join(words[cut:])))

    endings = {ending for _, ending in drafts}  # a set: some endings recur across paragraphs
    items: list[Item] = []
    for context, ending in drafts:
        # Nearest in length first; ties broken by text so the pool is the same on every run.
        others = sorted(endings - {ending}, key=lambda e: (abs(len(e) - len(ending)), e))
        distractors = rng.sample(others[:CLOZE_DISTRACTOR_POOL], 3)
        answer = rng.randrange(4)
        choices = [*distractors[:answer], ending, *distractors[answer:]]
        items.append({"context": context, "choices": choices, "answer": answer})
    return items


# --------------------------------------------------------------------------- pydoc_recall

RECALL_SEED = 20250102
# Every prompt token is prefilled once per variant, so the passages are short: at most this many words before the
# words to recall (whole sentences kept from the end), and at least RECALL_MIN_CONTEXT_WORDS.
RECALL_MAX_CONTEXT_WORDS = 40
RECALL_MIN_CONTEXT_WORDS = 12
# The words to recall: the last 1-3 of a sentence, few characters, so that they fit the YAML's max_gen_toks; a single
# word must be a content word (not "the", "it", ...).
RECALL_MAX_TARGET_WORDS = 3
RECALL_MAX_TARGET_CHARS = 24
RECALL_MIN_WORD_CHARS = 5
# The YAML's `until`: a target holds none of them, or its generation would stop inside it.
RECALL_STOPS = (".", ",", ";", "\n")


def _occurs_as_words(phrase: str, text: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(phrase)}(?!\w)", text) is not None


def _recall_cut(parts: list[str], index: int) -> tuple[str, str] | None:
    """(passage, words to recall) for sentence `index` of a paragraph's sentences, the most words first; or None."""
    sentence = parts[index]
    if not sentence.endswith("."):
        return None
    words = sentence[:-1].split()
    for count in range(min(RECALL_MAX_TARGET_WORDS, len(words) - 2), 0, -1):
        target = " ".join(words[-count:])
        if len(target) > RECALL_MAX_TARGET_CHARS or any(stop in target for stop in RECALL_STOPS):
            continue
        if count == 1 and len(target) < RECALL_MIN_WORD_CHARS:
            continue
        before = parts[:index]
        while before and len([*" ".join(before).split(), *words[:-count]]) > RECALL_MAX_CONTEXT_WORDS:
            before = before[1:]
        context = " ".join([*before, *words[:-count]])
        if RECALL_MIN_CONTEXT_WORDS <= len(context.split()) <= RECALL_MAX_CONTEXT_WORDS and _occurs_as_words(
            target, context
        ):
            return context, target
    return None


def pydoc_recall_items() -> list[Item]:
    """One item per eval paragraph that has one: a passage ending where a sentence's last words repeat earlier words
    of the passage (the cut with the most such words, the first sentence on a tie), seeded order."""
    calibration_text = corpora.text("calibration")
    items: list[Item] = []
    for paragraph in corpora.paragraphs("eval"):
        if _shares_text_with(paragraph, calibration_text):
            continue
        parts = sentences(paragraph)
        cuts = [cut for index in range(len(parts)) if (cut := _recall_cut(parts, index)) is not None]
        if cuts:
            context, target = max(cuts, key=lambda cut: len(cut[1].split()))  # max keeps the first of equals
            items.append({"context": context, "target": target})
    # Spread over the topics: a task's `limit` takes the first documents.
    random.Random(RECALL_SEED).shuffle(items)
    return items


# --------------------------------------------------------------------------- files

DATASETS: dict[str, Callable[[], list[Item]]] = {
    "mmlu_dev": mmlu_dev_items,
    "pydoc_cloze": pydoc_cloze_items,
    "pydoc_recall": pydoc_recall_items,
}


def render_jsonl(items: Iterable[Item]) -> str:
    return "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items)


SOURCES_FILE = "sources.json"


def source_versions() -> dict[str, str]:
    """The versions whose packaged files the data comes from (pydoc_data, lm-eval's prompts)."""
    from importlib.metadata import version

    return {"python": platform.python_version(), "lm_eval": version("lm_eval")}


def build(out_dir: Path = DATA_DIR) -> dict[str, Path]:
    """Write every dataset as ``<name>.jsonl`` under ``out_dir``, and the source versions."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for name, make_items in DATASETS.items():
        path = out_dir / f"{name}.jsonl"
        path.write_text(render_jsonl(make_items()), encoding="utf-8")
        written[name] = path
    (out_dir / SOURCES_FILE).write_text(json.dumps(source_versions(), indent=2) + "\n", encoding="utf-8")
    return written


def recorded_source_versions(data_dir: Path = DATA_DIR) -> dict[str, str]:
    return json.loads((data_dir / SOURCES_FILE).read_text(encoding="utf-8"))


def stale_files(data_dir: Path = DATA_DIR) -> list[str]:
    """Names of the datasets whose file under ``data_dir`` differs from a fresh build."""
    return [
        name
        for name, make_items in DATASETS.items()
        if not (data_dir / f"{name}.jsonl").is_file()
        or (data_dir / f"{name}.jsonl").read_text(encoding="utf-8") != render_jsonl(make_items())
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"stale: {DATA_DIR / name}.jsonl (run python evals/build.py)")
        if stale and recorded_source_versions() != source_versions():
            print(f"built from {recorded_source_versions()}, this is {source_versions()}")
        return 1 if stale else 0
    for name, path in build().items():
        count = sum(1 for _ in path.open(encoding="utf-8"))
        print(f"{name}: {count} items -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
