"""The offline long-context suite: LongBench-style tasks generated from text every CPython ships.

Retrieval tasks end in a cue the answer completes ("The pass key is"), through /v1/completions:
asked as a chat question, SmolLM2-135M-Instruct found the fact in 2 of 5 passkey and 0 of 5
multikey cases at 4k tokens unpruned, and a task the model fails unpruned measures nothing.

Haystacks come from `pydoc_data.topics` (the language reference); code comes from the standard
library's own sources. Every case is a pure function of (task, target length, depth, seed): the
same arguments give the same prompt on any machine with the same Python. A case records where its
answer sits in the prompt (`answer_offset`, characters into the user message) so tests can check
that the answer really is there.
"""

from __future__ import annotations

import random
import re
import sysconfig
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from bench.common import reference_text

TASKS = ("passkey", "multikey", "multidoc", "fewshot", "code", "summary")
# Tasks with one right answer; code and summary are scored against the truth and the unpruned output.
ANSWER_TASKS = ("passkey", "multikey", "multidoc", "fewshot")
# What `lazyserve eval` runs unless told: answer tasks the unpruned model solves in at least 60% of
# 4k cases (calibrated on dev: passkey 3/4, multikey 3/4, fewshot 5/5; multidoc 0/4, so it measures
# nothing on this model and is left out), plus code. Summary fidelity is what teacher-forced
# agreement measures more cheaply.
DEFAULT_TASKS = ("passkey", "multikey", "fewshot", "code")
DEPTHS = (0.1, 0.5, 0.9)
LENGTH_TOLERANCE = 0.05


@dataclass(frozen=True)
class Case:
    id: str
    task: str
    split: str  # "dev" (tune on it) or "test" (report on it)
    target_tokens: int
    depth: float  # where the answer sits, as a fraction of the context
    url: str  # /v1/chat/completions or /v1/completions
    content: str  # the user message (chat) or the prompt (completions)
    answer: str
    answer_offset: int  # character offset of the answer's evidence in `content`; -1 if none
    max_tokens: int
    scorer: str  # "contains" | "label" | "edit_similarity" | "rouge_vs_full"
    labels: tuple[str, ...] = field(default=())

    def body(self) -> dict:
        base = {"max_tokens": self.max_tokens, "temperature": 0}
        if self.url == "/v1/completions":
            return base | {"prompt": self.content}
        return base | {"messages": [{"role": "user", "content": self.content}]}


def _words(rng: random.Random, count: int) -> list[str]:
    pool = sorted(set(re.findall(r"\b[a-z]{5,9}\b", reference_text()[:60000])))
    return rng.sample(pool, count)


def _haystack(rng: random.Random, chars: int) -> str:
    text = reference_text()
    start = rng.randrange(0, len(text) - chars - 1)
    start = text.find(" ", start) + 1
    return text[start : start + chars]


def _at_sentence(text: str, depth: float) -> int:
    """An insertion point near `depth` of text, just after a sentence or line end."""
    target = int(len(text) * depth)
    for offset in range(0, len(text)):
        for i in (target + offset, target - offset):
            if 0 < i < len(text) and text[i - 1] in ".\n":
                return i
    return target


def _insert(haystack: str, depth: float, needle: str) -> tuple[str, int]:
    """Put `needle` in a paragraph of its own near `depth`; return the text and the needle's offset."""
    at = _at_sentence(haystack, depth)
    return haystack[:at] + "\n\n" + needle + "\n\n" + haystack[at:], at + 2


# Each builder takes (rng, chars, depth) and returns (content, answer, answer_offset).


def _passkey(rng, chars, depth):
    key = str(rng.randrange(10000, 99999))
    content, at = _insert(_haystack(rng, chars), depth, f"The pass key is {key}. Remember it. {key} is the pass key.")
    return content + "\n\nThe pass key is", key, at


def _multikey(rng, chars, depth):
    haystack = _haystack(rng, chars)
    names = _words(rng, 6)
    values = [str(rng.randrange(1000, 9999)) for _ in names]
    asked = rng.randrange(len(names))
    # The asked fact goes at `depth`; the distractors spread evenly elsewhere.
    others = [i for i in range(len(names)) if i != asked]
    pieces, offset_of_asked = haystack, -1
    for rank, i in enumerate(others):
        pieces, _ = _insert(pieces, (rank + 0.5) / len(others), f"The value of key {names[i]} is {values[i]}.")
    pieces, offset_of_asked = _insert(pieces, depth, f"The value of key {names[asked]} is {values[asked]}.")
    return pieces + f"\n\nThe value of key {names[asked]} is", values[asked], offset_of_asked


def _multidoc(rng, chars, depth):
    from pydoc_data.topics import topics

    titles = rng.sample(sorted(topics), 16)
    code_words = _words(rng, len(titles))
    per_doc = max(chars // len(titles), 60)
    target = min(int(depth * len(titles)), len(titles) - 1)
    docs, offset = [], 0
    for i, title in enumerate(titles):
        body = topics[title][:per_doc]
        if i == target:
            body, at = _insert(body, 0.5, f"The code word of this document is {code_words[i]}.")
        header = f"Document {i + 1}: {title}\n"
        if i == target:
            answer_offset = offset + len(header) + at
        docs.append(header + body + "\n\n")
        offset += len(docs[-1])
    question = f"The code word of the document titled '{titles[target]}' is"
    return "".join(docs) + question, code_words[target], answer_offset


_POSITIVE = "excellent wonderful delightful superb splendid marvelous brilliant lovely charming pleasant".split()
_NEGATIVE = "terrible awful dreadful horrible dismal wretched lousy appalling atrocious miserable".split()


def _fewshot(rng, chars, depth):
    nouns = _words(rng, 400)
    query_label = rng.choice(("positive", "negative"))
    query_adjective = rng.choice(_POSITIVE if query_label == "positive" else _NEGATIVE)
    examples, size, evidence_index = [], 0, -1
    while size < chars:
        label = rng.choice(("positive", "negative"))
        pool = [a for a in (_POSITIVE if label == "positive" else _NEGATIVE) if a != query_adjective]
        line = f"Review: The {rng.choice(nouns)} was {rng.choice(pool)}.\nSentiment: {label}\n"
        examples.append(line)
        size += len(line)
    # The one example with the query's own adjective sits at `depth`.
    evidence_index = min(int(depth * len(examples)), len(examples) - 1)
    examples[evidence_index] = f"Review: The {rng.choice(nouns)} was {query_adjective}.\nSentiment: {query_label}\n"
    offset = sum(len(e) for e in examples[:evidence_index])
    content = "".join(examples) + f"Review: The {rng.choice(nouns)} was {query_adjective}.\nSentiment:"
    return content, query_label, offset


@lru_cache(maxsize=1)
def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.glob("*.py")) if 20_000 < p.stat().st_size < 400_000]
    return files


def _code(rng, chars, depth):
    files = _stdlib_files()
    for _ in range(50):
        source = rng.choice(files).read_text(encoding="utf-8", errors="replace")
        lines = source.splitlines(keepends=True)
        # A line inside a function body, far enough into the file to fill the context.
        candidates = [
            i
            for i, line in enumerate(lines)
            if i > 0
            and line.startswith("        ")
            and len(line.strip()) > 12
            and not line.strip().startswith("#")
            and sum(len(x) for x in lines[:i]) > chars
        ]
        if candidates:
            break
    i = rng.choice(candidates)
    before = "".join(lines[:i])
    context = before[-chars:]
    context = context[context.find("\n") + 1 :]
    return context, lines[i].strip(), len(context)


def _summary(rng, chars, depth):
    return _haystack(rng, chars) + "\n\nSummarize the text above in two sentences.", "", -1


_BUILDERS = {
    "passkey": (_passkey, "/v1/completions", 16, "contains"),
    "multikey": (_multikey, "/v1/completions", 16, "contains"),
    "multidoc": (_multidoc, "/v1/completions", 16, "contains"),
    "fewshot": (_fewshot, "/v1/completions", 3, "label"),
    "code": (_code, "/v1/completions", 24, "edit_similarity"),
    "summary": (_summary, "/v1/chat/completions", 32, "rouge_vs_full"),
}


def _count(tokenizer, case_url: str, content: str) -> int:
    if case_url == "/v1/completions" or tokenizer.chat_template is None:  # a base model: a plain prompt
        return len(tokenizer(content).input_ids)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def make_case(tokenizer, task: str, target_tokens: int, depth: float, seed: int) -> Case:
    """Build one case whose prompt is within 5% of target_tokens (tokens as the model counts them)."""
    build, url, max_tokens, scorer = _BUILDERS[task]
    chars = target_tokens * 4
    for _ in range(8):
        content, answer, offset = build(random.Random(f"{task}:{target_tokens}:{depth}:{seed}"), chars, depth)
        tokens = _count(tokenizer, url, content)
        if abs(tokens - target_tokens) <= LENGTH_TOLERANCE * target_tokens * 0.5:
            break
        chars = int(chars * target_tokens / tokens)
    split = "dev" if seed % 2 == 0 else "test"
    labels = ("positive", "negative") if task == "fewshot" else ()
    return Case(
        id=f"{task}-{target_tokens}-d{depth}-s{seed}",
        task=task,
        split=split,
        target_tokens=target_tokens,
        depth=depth,
        url=url,
        content=content,
        answer=answer,
        answer_offset=offset,
        max_tokens=max_tokens,
        scorer=scorer,
        labels=labels,
    )


def make_suite(tokenizer, tasks, lengths, split: str, limit: int) -> list[Case]:
    """`limit` cases per (task, length) of the split, with depths cycled across them.

    Dev cases have even seeds, test cases odd: the two never share a prompt.
    """
    cases = []
    first_seed = {"dev": 0, "test": 1}[split]
    for task in tasks:
        for length in lengths:
            for i in range(limit):
                depth = DEPTHS[i % len(DEPTHS)]
                cases.append(make_case(tokenizer, task, length, depth, first_seed + 2 * i))
    return cases
