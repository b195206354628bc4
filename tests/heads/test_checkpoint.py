from collections import Counter

import pytest
import torch
from conftest import make_tiny_llama
from safetensors.torch import load_file

from mtptrain.heads import FrozenTarget
from mtptrain.heads.checkpoint import HeadCheckpointError, load_head, save_head
from mtptrain.heads.spec import HeadSpec
from mtptrain.heads.eagle3 import DraftVocab

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
