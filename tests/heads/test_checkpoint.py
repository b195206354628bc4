import json
import logging
import re
from collections import Counter

import pytest
import torch
from conftest import make_tiny_llama
from safetensors.torch import load_file, save_file

from mtptrain.config import FLAT_HEAD_DEFAULTS, HEAD_CONFIGS, Eagle3HeadConfig, flat_head, load_recipe, validate_recipe
from mtptrain.heads import FrozenTarget
from mtptrain.heads.checkpoint import HEAD_FORMAT, PRETRAINED_HEAD, HeadCheckpointError, load_head, read_head, save_head
from mtptrain.heads.spec import HeadSpec
from mtptrain.heads.vocab import DraftVocab

IDENTITY = {"name": "tiny", "fingerprint": "aaa", "tokenizer_fingerprint": "ttt"}


@pytest.mark.parametrize("spec", [HeadSpec("eagle", last_layer=3), HeadSpec("eagle", norms="stripped", last_layer=3),
                                  HeadSpec("mtp", last_layer=3, mtp_depths=2),
                                  HeadSpec("eagle3", last_layer=3, feature_layers=[0, 1, 2], ttt_steps=2,
                                           draft_vocab_size=50)], ids=["eagle", "stripped", "mtp", "eagle3"])
def test_saved_head_loads_back_identical_and_refuses_another_target(spec, tmp_path):
    frozen = FrozenTarget.of(make_tiny_llama(400))
    torch.manual_seed(0)
    vocab = DraftVocab.from_counts(Counter({i: 400 - i for i in range(0, 400, 3)}), 50, 400)
    head = spec.family.build(spec, frozen, vocab if spec.kind == "eagle3" else None)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # not the initial values
    save_head(tmp_path, head, spec, IDENTITY)
    stored = load_file(tmp_path / "model.safetensors")
    assert not any(t.dim() == 2 and t.shape[0] == 400 for t in stored.values())  # no embedding / LM head
    loaded, loaded_spec = load_head(tmp_path, frozen, IDENTITY)
    assert loaded_spec == spec
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    with pytest.raises(HeadCheckpointError, match="trained for target 'tiny'"):
        load_head(tmp_path, frozen, {**IDENTITY, "name": "other", "fingerprint": "bbb"})


EAGLE3 = HeadSpec("eagle3", last_layer=3, feature_layers=[0, 1, 2], ttt_steps=2, draft_vocab_size=50)


def saved_eagle3(directory):
    """A tiny eagle3 head saved as training saves it, and the frozen target it drafts for."""
    frozen = FrozenTarget.of(make_tiny_llama(400))
    vocab = DraftVocab.from_counts(Counter({i: 400 - i for i in range(0, 400, 3)}), 50, 400)
    save_head(directory, EAGLE3.family.build(EAGLE3, frozen, vocab), EAGLE3, IDENTITY)
    return frozen


def test_a_config_edited_after_training_is_refused_and_a_reformatted_one_is_not(tmp_path):
    frozen = saved_eagle3(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(dict(reversed(config.items())), indent=4))  # the same content, laid out anew
    assert load_head(tmp_path, frozen, IDENTITY)[1] == EAGLE3
    config["head"]["feature_layers"] = [0, 2, 1]  # layer ids the weights were not trained on
    path.write_text(json.dumps(config, indent=2))
    with pytest.raises(HeadCheckpointError, match=rf"{re.escape(str(path))}: the head's config was changed after "
                                                  r"training .* Undo the edit .* or train the head again"):
        load_head(tmp_path, frozen, IDENTITY)


def test_weights_replaced_after_training_are_refused(tmp_path):
    frozen = saved_eagle3(tmp_path)
    weights = tmp_path / "model.safetensors"
    state = load_file(weights)
    name = next(k for k, v in state.items() if v.is_floating_point())
    state[name] = state[name] + 1
    save_file(state, weights)
    with pytest.raises(HeadCheckpointError, match=rf"{re.escape(str(weights))} was changed after training"):
        load_head(tmp_path, frozen, IDENTITY)


def test_a_head_written_before_digests_loads_with_one_warning(tmp_path, caplog):
    frozen = saved_eagle3(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    del config["sha256"]
    path.write_text(json.dumps(config, indent=2))
    with caplog.at_level(logging.WARNING, logger="mtptrain.heads.checkpoint"):
        assert load_head(tmp_path, frozen, IDENTITY)[1] == EAGLE3
    assert [r.getMessage() for r in caplog.records] == [
        f"{path} records no sha256 of the head (written before mtptrain recorded one): it is used unchecked; "
        "train the head again to have edits after training caught"]


@pytest.mark.parametrize("text", ['{"format": "mtptrain-head/1", "head": {', "[1, 2]", "[" * 100_000, "\udcff"],
                         ids=["cut-short", "a-list", "nested-past-the-parser", "not-utf8"])
def test_a_head_config_that_does_not_read_back_is_refused_with_the_fix(text, tmp_path):
    frozen = saved_eagle3(tmp_path)
    path = tmp_path / "config.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    refusal = (rf"{re.escape(str(path))} does not read as a {re.escape(repr(HEAD_FORMAT))} file \(.+\): it was cut "
               r"short .* Restore it, or write it again")
    with pytest.raises(HeadCheckpointError, match=refusal):
        load_head(tmp_path, frozen, IDENTITY)


def test_the_shipped_head_records_the_digests_of_its_files(caplog):
    with caplog.at_level(logging.WARNING):
        config, state = read_head(PRETRAINED_HEAD)
    assert set(config["sha256"]) == {"config", "weights"} and state and not caplog.records


def test_the_shipped_head_reads_back_as_its_recorded_recipe_trains_it():
    config, _ = read_head(PRETRAINED_HEAD)  # its digests verified
    recorded = config["train"]["recipe"]["head"]  # its family's fields, as the trainer wrote the recipe
    section = validate_recipe({"head": recorded}).head
    assert isinstance(section, Eagle3HeadConfig) and section == load_recipe("recipes/reference.yaml").head
    assert section.model_dump(mode="json") == recorded
    # a head written before the family sections recorded the flat layout (every family's fields): it reads back
    assert validate_recipe({"head": flat_head(section)}).head == section
    manifest = {"layers": config["features"]["layers"], "last_layer": config["head"]["last_layer"],
                "target": config["target"]}
    assert HeadSpec.of(section, manifest) == HeadSpec(**config["head"])


@pytest.mark.real_model
def test_the_shipped_head_loads_on_its_target():
    from mtptrain.config import TargetConfig
    from mtptrain.target import load_target

    target = load_target(TargetConfig())
    head, spec = load_head(PRETRAINED_HEAD, FrozenTarget.of(target.model), target.identity())
    assert spec == HeadSpec(**json.loads((PRETRAINED_HEAD / "config.json").read_text())["head"])
    assert spec.kind == "eagle3" and len(head.fc_norm) == len(spec.feature_layers) == 3


@pytest.mark.parametrize("kind", sorted(HEAD_CONFIGS))
def test_a_head_recording_a_flat_recipe_loads_and_its_recipe_reads_back(kind, tmp_path):
    """A head whose config records the resolved recipe with the flat head section (every family's fields)."""
    own = {"eagle": {"norms": "stripped"}, "eagle3": {"ttt_steps": 2, "draft_vocab_size": 50},
           "mtp": {"mtp_depths": 3, "mtp_input": "raw"}}[kind]
    flat = {**FLAT_HEAD_DEFAULTS, "kind": kind, **own}
    recipe = {**load_recipe(None).model_dump(mode="json"), "head": flat}
    manifest = {"layers": [0, 1, 2, 3], "last_layer": 3, "target": {"vocab_size": 400}}
    spec = HeadSpec.of(HEAD_CONFIGS[kind](**own), manifest)
    frozen = FrozenTarget.of(make_tiny_llama(400))
    vocab = DraftVocab.from_counts(Counter({i: 400 - i for i in range(0, 400, 3)}), 50, 400)
    save_head(tmp_path, spec.family.build(spec, frozen, vocab if spec.draft_vocab_size else None), spec, IDENTITY,
              {"train": {"steps": 1, "recipe": recipe}})
    config, _ = read_head(tmp_path)
    assert config["train"]["recipe"]["head"] == flat and load_head(tmp_path, frozen, IDENTITY)[1] == spec
    section = validate_recipe(config["train"]["recipe"]).head
    assert section == HEAD_CONFIGS[kind](**own) and HeadSpec.of(section, manifest) == spec
