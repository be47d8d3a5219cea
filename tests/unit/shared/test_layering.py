"""Layering: the router runs without torch, shared/ has no import circle, and the torch-free text
side reads a model exactly as transformers' Auto classes do."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from shared.contract import ModelSpec
from shared.models.catalog import TINY_MODELS, default_model_folder
from shared.models.text import load_text_model, load_tokenizer
from shared.models.weights import build_tiny

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("shared", "services", "bench", "proto")


def test_the_gateway_runs_without_torch():
    """Its whole module tree, and the text model it loads at start, in a fresh interpreter."""
    default_model_folder()  # the one-time GGUF conversion (which needs torch) happens here, not there
    script = (
        "import sys\n"
        "import services.router.main\n"
        "from shared.models.text import load_text_model\n"
        "load_text_model('SmolLM2-135M-Instruct')\n"
        "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def _imports(path: Path) -> set[str]:
    """Our modules that `path` imports anywhere in it (module-level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.split(".")[0] in PACKAGES}


def _module_graph() -> dict[str, set[str]]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            modules[name] = path
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def test_no_import_circle():
    graph = _module_graph()
    assert len(graph) > 50
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name, path):
        state[name] = 1
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt] if nxt in path else [name, nxt]
                pytest.fail(f"import circle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_contract_and_router_stay_on_their_side():
    graph = _module_graph()
    heavy = ("shared.engine", "shared.transfer", "shared.models.weights", "shared.api.llm")
    for name, imports in graph.items():
        # shared.api.llm is the in-process model (run-batch): the one module of api/ that runs the engine.
        light = name.startswith(
            ("shared.contract", "services.router", "shared.api", "shared.net", "shared.models.text")
        )
        if light and name != "shared.api.llm":
            assert not [m for m in imports if m.startswith(heavy)], (name, imports)


def test_torch_free_text_side_reads_the_model_as_the_auto_classes_do(tmp_path):
    folder = default_model_folder()
    ours, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    texts = ["hello world", "def f(x):\n    return x  # ünïcødé ✓", " leading space", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert ours(text).input_ids == auto(text).input_ids
        assert ours.decode(auto(text).input_ids, skip_special_tokens=True) == auto.decode(
            auto(text).input_ids, skip_special_tokens=True
        )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == auto.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert ModelSpec.from_config_file(folder / "config.json") == ModelSpec.from_config(
        AutoConfig.from_pretrained(folder)
    )
    text = load_text_model("SmolLM2-135M-Instruct")
    assert text.stop_token_ids == (2,) and text.spec.num_layers == 30
    for kind in TINY_MODELS:
        build_tiny(kind).config.save_pretrained(tmp_path / kind)
        spec = ModelSpec.from_config_file(tmp_path / kind / "config.json")
        assert spec == ModelSpec.from_config(AutoConfig.from_pretrained(tmp_path / kind))
