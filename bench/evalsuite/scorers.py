"""Scores for the suite's outputs, each in [0, 1]."""

from __future__ import annotations

import difflib


def contains(output: str, answer: str) -> float:
    return float(answer in output)


def label(output: str, answer: str, labels: tuple[str, ...]) -> float:
    """1 when the first label word in the output is the right one."""
    lowered = output.lower()
    found = [(lowered.find(name), name) for name in labels if name in lowered]
    return float(bool(found) and min(found)[1] == answer)


def same_answer(output: str, reference: str) -> float:
    """1 when two outputs give the same answer: their first words, case and surrounding
    punctuation aside. First-token agreement counts `" negative"` against `"negative"` (a leading
    space) as a disagreement; this does not."""

    def first_word(text: str) -> str:
        words = text.split()
        return words[0].strip(".,;:!?\"'()").lower() if words else ""

    return float(first_word(output) == first_word(reference))


def edit_similarity(output: str, answer: str) -> float:
    """Similarity of the first non-empty generated line to the true next line (difflib's ratio)."""
    first = next((line.strip() for line in output.splitlines() if line.strip()), "")
    return difflib.SequenceMatcher(None, first, answer.strip()).ratio()


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 over whitespace tokens.

    Written here (an LCS table) rather than taken from `rouge-score`, which would bring nltk and
    absl along for these fifteen lines.
    """
    a, b = candidate.split(), reference.split()
    if not a or not b:
        return float(a == b)
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    lcs = previous[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(a), lcs / len(b)
    return 2 * precision * recall / (precision + recall)


def prefix_agreement(tokens: list[int], reference: list[int], first: int = 16) -> float:
    """Share of the reference's first tokens that the output reproduces before its first divergence."""
    reference = reference[:first]
    if not reference:
        return float(not tokens)
    same = 0
    for x, y in zip(tokens, reference):
        if x != y:
            break
        same += 1
    return same / len(reference)


def score(scorer: str, output: str, answer: str, labels: tuple[str, ...], full_output: str) -> float:
    if scorer == "contains":
        return contains(output, answer)
    if scorer == "label":
        return label(output, answer, labels)
    if scorer == "edit_similarity":
        return edit_similarity(output, answer)
    if scorer == "rouge_vs_full":
        return rouge_l(output, full_output)
    raise ValueError(f"unknown scorer {scorer!r}")
