"""A head over a target split across devices (target.gpus_per_rank: the 70B recipe's eval, and a training rank
that loads the whole target): the embedding sits with the first decoder layers, the final norm and an untied LM
head with the last, the head with the embedding. Every use of a frozen part goes through `FrozenTarget`, which
brings the input to that part's device and the result back (`across`)."""

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from mtptrain.heads.common import across

HEADS = Path(__file__).resolve().parents[2] / "mtptrain" / "heads"
FROZEN_PARTS = {"embed", "final_norm", "lm_head"}


class Recorder(nn.Module):
    """Doubles its input, recording the device it computed on."""

    def __init__(self, device: str):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1, device=device))
        self.seen: list[torch.device] = []

    def forward(self, x):
        self.seen.append(x.device)
        return x * 2 * self.weight


def test_a_frozen_part_computes_on_its_device_and_hands_the_result_back():
    module = Recorder("meta")  # the far GPU, on a machine with one device
    x = torch.ones(3, device="meta")
    assert across(module, x).device.type == "meta" and module.seen == [torch.device("meta")]
    near = Recorder("cpu")
    out = across(near, torch.arange(3.0))
    assert out.device.type == "cpu" and torch.equal(out, torch.tensor([0.0, 2.0, 4.0]))


def _frozen_part_calls(tree: ast.AST) -> list[str]:
    """`x.frozen.lm_head(...)`, `frozen.final_norm(...)`, `self.embed(...)` on a frozen part: calls of a part's
    module (or its weight used in a product) written outside FrozenTarget's methods."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FROZEN_PARTS:
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and owner.attr == "frozen" or \
                    isinstance(owner, ast.Name) and owner.id == "frozen":
                found.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_heads_use_the_targets_frozen_parts_only_through_frozen_target():
    """A direct call hands the part a tensor on the head's device: on a split target, a device mismatch on the
    main training rank (the whole target loaded for train.engine_eval) and in an EAGLE/MTP head's drafting."""
    offenders = {}
    for path in sorted(HEADS.glob("*.py")):
        tree = ast.parse(path.read_text())
        for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "FrozenTarget"]:
            cls.body = []  # its own methods are where the moves are made
        calls = _frozen_part_calls(tree)
        if calls:
            offenders[path.name] = calls
    assert not offenders, offenders


@pytest.mark.parametrize("tied", [True, False])
def test_the_frozen_parts_give_the_same_logits_through_frozen_target(tied):
    from conftest import make_tiny_llama
    from mtptrain.heads import FrozenTarget

    model = make_tiny_llama(400, seed=1, initializer_range=0.2)
    if not tied:
        model.lm_head = nn.Linear(64, 400, bias=False)
    frozen = FrozenTarget.of(model)
    hidden = torch.randn(5, 64)
    expected = model.lm_head(model.model.norm(hidden))
    torch.testing.assert_close(frozen.target_logits(hidden), expected)
    torch.testing.assert_close(frozen.head_logits(hidden), model.lm_head(hidden))
