"""The README's example schedule is what `default` resolves to on SmolLM2's 30 layers, field for
field, so the page a user reads first says what the server runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

from shared.contract import preset


def test_the_readme_schedule_is_the_default_preset():
    readme = (Path(__file__).parents[3] / "README.md").read_text()
    block = re.search(r"A schedule \(this one is `default`\):\s*```json\n(.*?)```", readme, re.S)
    assert block, "the README's example schedule is gone"
    shown = json.loads(block.group(1))
    resolved = preset("default", 30).model_dump(mode="json")
    assert shown == {name: resolved[name] for name in shown}
    assert set(resolved) - set(shown) == set(), f"fields the example leaves out: {set(resolved) - set(shown)}"
