"""Writes examples/long_context.jsonl: long-context requests built from the Python reference that
CPython ships (pydoc_data.topics). Run again to regenerate; the output is deterministic."""

import json
from pathlib import Path
from pydoc_data.topics import topics


def haystack(names: list[str], chars: int) -> str:
    text = "\n\n".join(topics[name] for name in names)
    return text[:chars]


def main() -> None:
    lines = []
    doc = haystack(["assignment", "augassign", "if", "while", "for", "try"], 7000)
    middle = len(doc) // 2
    needle = "\nThe pass key is 71432. Remember it.\n"
    lines.append(
        {
            "custom_id": "passkey-2k",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": [
                    {"role": "user", "content": doc[:middle] + needle + doc[middle:] + "\n\nWhat is the pass key?"}
                ],
                "max_tokens": 24,
                "temperature": 0,
            },
        }
    )
    doc = haystack(["with", "function", "class", "async", "lambda", "import", "raise", "return"], 12000)
    lines.append(
        {
            "custom_id": "with-statement-3k",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": [
                    {"role": "system", "content": "Answer from the document in one sentence."},
                    {
                        "role": "user",
                        "content": doc
                        + "\n\nWhich statement is used to wrap a block with methods defined by a context manager?",
                    },
                ],
                "max_tokens": 32,
                "temperature": 0,
            },
        }
    )
    doc = haystack(["numbers", "strings", "lists", "dict", "typesseq"], 5000)
    lines.append(
        {
            "custom_id": "completion-1k",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": doc + "\n\nIn short, a Python list is", "max_tokens": 24, "temperature": 0},
        }
    )
    path = Path(__file__).with_name("long_context.jsonl")
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main()
