"""The head families: one per recipe kind, each building a head that trains, drafts exactly and survives its
checkpoint; the registry's refusal of an unknown kind; the export formats agreeing with the families; and no
code outside them branching on a kind's name."""

import ast
import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Literal, get_args

import pytest
import torch
from conftest import make_tiny_llama

from mtptrain.config import HEAD_CONFIGS, HeadConfig, HeadKind, Recipe, _section_classes
from mtptrain.engine.generate import generate
from mtptrain.runtime.runner import open_runner
from mtptrain.export.formats import FORMATS
from mtptrain.heads import FrozenTarget
from mtptrain.heads.checkpoint import load_head, save_head
from mtptrain.heads.objective import step_weights
from mtptrain.heads.spec import FAMILIES, HeadSpec, UnknownHeadKind, family_of
from mtptrain.runtime.capture import LayerCapture

ROOT = Path(__file__).resolve().parents[2]
IDENTITY = {"name": "tiny", "fingerprint": "aaa", "tokenizer_fingerprint": "ttt"}
MANIFEST = {"layers": [0, 1, 2, 3], "last_layer": 3, "target": {"vocab_size": 400}}
OWN_SETTINGS = {"eagle3": {"ttt_steps": 2, "draft_vocab_size": 200}}


def test_every_kind_a_recipe_names_has_a_family_and_no_family_is_out_of_reach():
    assert set(get_args(HeadKind)) == set(FAMILIES)
    assert HeadConfig.model_fields["kind"].annotation == HeadKind
    assert all(family.kind == kind for kind, family in FAMILIES.items())
    assert set(HEAD_CONFIGS) == set(FAMILIES)
    assert all(issubclass(section, HeadConfig) and section.model_fields["kind"].annotation == Literal[kind]
               for kind, section in HEAD_CONFIGS.items())
    assert _section_classes(Recipe.model_fields["head"].annotation) == HEAD_CONFIGS  # the recipe chooses by kind


def test_an_unknown_kind_is_refused_with_the_known_ones():
    for refuse in (lambda: family_of("dflash"), lambda: HeadSpec("dflash")):
        with pytest.raises(UnknownHeadKind, match="unknown head kind 'dflash': the known kinds are eagle, eagle3, mtp"):
            refuse()


def _states(model, ids: torch.Tensor, layers: list[int]) -> dict[int, torch.Tensor]:
    capture = LayerCapture(model.model.layers, layers)
    with torch.no_grad():
        model(ids)
    capture.close()
    return capture.take()


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_each_family_builds_a_head_that_trains_drafts_exactly_and_loads_back(kind, tmp_path):
    model = make_tiny_llama(400, seed=3, initializer_range=0.2)
    frozen = FrozenTarget.of(model)
    spec = HeadSpec.of(HEAD_CONFIGS[kind](**OWN_SETTINGS.get(kind, {})), MANIFEST)
    family = spec.family
    assert spec.kind == kind and family is FAMILIES[kind]
    ids = torch.randint(0, 400, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    head = family.build(spec, frozen, family.draft_vocab(spec, ids.tolist(), 400))

    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "hidden": _states(model, ids, spec.layers)}
    result = family.objective(head, batch, spec, step_weights("auto", spec.draft_positions), 0.1, 64)
    result.loss.backward()
    assert torch.isfinite(result.loss) and len(result.positions) == spec.draft_positions
    assert all(p.grad is not None for p in head.parameters() if p.requires_grad)

    prompt = ids[0, :6].tolist()
    reference = generate(open_runner(model), prompt, 16).tokens
    drafters = [family.chain(head, spec)]
    if family.no_tree is None:
        drafters.append(family.tree(head, spec, 2, 3, 5))
    else:
        with pytest.raises(ValueError, match=re.escape(family.no_tree)):
            family.tree(head, spec, 2, 3, 5)
    limit = family.chain_limit(spec)
    for drafter in drafters:
        drafted = generate(open_runner(model, capture=spec.layers), prompt, 16, drafter, k=3)
        assert drafted.tokens == reference and sum(drafted.stats.proposed) > 0
        assert limit is None or len(drafted.stats.proposed) <= limit.tokens
    assert set(family.draft_layers(spec)) <= set(spec.layers)

    save_head(tmp_path, head, spec, IDENTITY)
    assert json.loads((tmp_path / "config.json").read_text())["head"] == json.loads(json.dumps(asdict(spec)))
    loaded, loaded_spec = load_head(tmp_path, frozen, IDENTITY)
    assert loaded_spec == spec
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_the_export_formats_and_the_families_agree():
    for kind, family in FAMILIES.items():
        assert family.export_formats and set(family.export_formats) <= set(FORMATS), kind
    for name, form in FORMATS.items():
        assert form.kinds and all(name in FAMILIES[kind].export_formats for kind in form.kinds), name


def _kind_like(node: ast.AST) -> bool:
    """`kind`, `x.kind`, `head_kind`, `x["kind"]`: where a head's kind is read."""
    if isinstance(node, ast.Name):
        return node.id == "kind" or node.id.endswith("_kind")
    if isinstance(node, ast.Attribute):
        return node.attr == "kind" or node.attr.endswith("_kind")
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "kind"


def _names_a_kind(node: ast.AST) -> bool:
    """A literal naming a head family ("eagle3"), alone or in a tuple, list or set."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_kind(element) for element in node.elts)
    return isinstance(node, ast.Constant) and node.value in FAMILIES


def kind_branches(source: str) -> list[int]:
    """Lines that compare a head's kind with a family's name, or match it against one."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(map(_kind_like, sides)) and any(map(_names_a_kind, sides)):
                lines.append(node.lineno)
        elif isinstance(node, ast.Match) and _kind_like(node.subject):
            if any(isinstance(case.pattern, ast.MatchValue) and _names_a_kind(case.pattern.value)
                   for case in node.cases):
                lines.append(node.lineno)
    return lines


def test_the_scan_finds_every_way_of_branching_on_a_kind():
    branches = ['spec.kind == "eagle3"', '"mtp" != head.kind', 'kind in ("eagle", "eagle3")', 'c["kind"] == "mtp"',
                'head_kind not in ["mtp"]', 'match spec.kind:\n    case "eagle":\n        pass']
    for source in branches:
        assert kind_branches(source) == [1], source
    for source in ('kind == "propose"', 'spec.norms == "restored"', 'FAMILIES[spec.kind]', 'x == "eagle"'):
        assert kind_branches(source) == [], source


def test_no_code_branches_on_a_kind_name():
    """Whatever depends on a head's kind is asked of its family (mtptrain/heads/family.py)."""
    paths = [*(ROOT / "mtptrain").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "scripts").glob("*.py")]
    found = [f"{path.relative_to(ROOT)}:{line}" for path in paths for line in kind_branches(path.read_text())]
    assert not found, "compares a head kind with a family's name; ask spec.family instead:\n" + "\n".join(found)
