"""The embedded default end to end: real SmolLM2-135M-Instruct over real ShareGPT rows."""

import json

import pytest
import torch
from helpers import reference_hidden

from mtptrain.config import load_recipe
from mtptrain.features.precompute import run_precompute
from mtptrain.features.store import FeatureStore
from mtptrain.target import embedded_gguf_path, load_target

pytestmark = pytest.mark.real_model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stored_states_equal_a_fresh_forward_of_smollm2(tmp_path, dtype):
    """The runtime's states, stored in bfloat16, against transformers' forward of the same target. Computed in
    float32, they are its states rounded once. Computed in bfloat16, they are as close to the float32 states as
    transformers' own bfloat16 forward is (two bfloat16 forwards round in different orders through 30 layers,
    so they are compared through the float32 truth)."""
    recipe = load_recipe("recipes/quickstart.yaml", ["data.max_conversations=8", "data.max_length=96",
                                                     f"precompute.output_dir={tmp_path}", f"target.dtype={dtype}"])
    summary = run_precompute(recipe, show_progress=False)
    assert summary["complete"] and summary["rows"]["rows"] == 8
    target = load_target(recipe.target)
    truth = load_target(recipe.target.model_copy(update={"dtype": "float32"})) if dtype == "bfloat16" else target
    store = FeatureStore(tmp_path, "train", target=target, layers=[1, 14, 26, 29])
    assert len(store) >= 4
    for i in range(len(store)):
        sample = store[i]
        ref = reference_hidden(truth.model, sample["input_ids"], store.layers)
        theirs = reference_hidden(target.model, sample["input_ids"], store.layers) if dtype == "bfloat16" else None
        for layer in store.layers:
            stored, expected = sample["hidden"][layer].float(), ref[layer].to(torch.bfloat16).float()
            if dtype == "float32":  # bf16 storage: relative error of one bf16 rounding (2^-8) on each element
                assert torch.allclose(stored, expected, rtol=2**-7, atol=2**-7 * ref[layer].abs().mean().item()), \
                    (i, layer)
            else:
                def error(states):
                    return float((states.float() - ref[layer].float()).norm() / ref[layer].float().norm())
                assert error(stored) <= 1.1 * error(theirs[layer]) + 2**-8, (i, layer, error(stored))


def test_gguf_conversion_keeps_the_logits():
    """The copy holds the GGUF's weights rounded once to bfloat16 (its matrices are quantised: target/source.py
    says why), and computes in float32 what the GGUF model computes over those weights, bit for bit."""
    from transformers import AutoModelForCausalLM

    from mtptrain.config import TargetConfig
    from mtptrain.target.source import converted_gguf_dir, gguf_copy_dtype

    gguf = embedded_gguf_path()
    original = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    assert gguf_copy_dtype(gguf) == torch.bfloat16
    assert json.loads((converted_gguf_dir(gguf) / "config.json").read_text())["dtype"] == "bfloat16"
    with torch.no_grad():
        for parameter in original.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).float())
    converted = load_target(TargetConfig(dtype="float32"))
    assert converted.model.lm_head.weight.data_ptr() == converted.decoder().embed_tokens.weight.data_ptr()
    ids = converted.tokenizer("The feature store keeps hidden states.", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(original(ids).logits, converted.model(ids).logits)


def test_a_gguf_path_and_gguf_file_in_a_directory_load_the_same_target():
    from mtptrain.config import TargetConfig

    gguf = embedded_gguf_path()
    embedded = load_target(TargetConfig())
    by_path = load_target(TargetConfig(model=str(gguf)))
    by_dir = load_target(TargetConfig(model=str(gguf.parent), gguf_file=gguf.name))
    assert embedded.fingerprint == by_path.fingerprint == by_dir.fingerprint
    assert embedded.tokenizer_fingerprint == by_path.tokenizer_fingerprint == by_dir.tokenizer_fingerprint
