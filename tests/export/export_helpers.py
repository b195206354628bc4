"""Shared by the export tests: a tiny 6-layer target, and heads saved as `mtptrain train` saves them."""

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_llama, make_tokenizer

from mtptrain.heads import FrozenTarget
from mtptrain.heads.checkpoint import save_head
from mtptrain.heads.spec import HeadSpec
from mtptrain.heads.vocab import DraftVocab

EAGLE3 = HeadSpec("eagle3", last_layer=5, feature_layers=[1, 2, 4], ttt_steps=2, draft_vocab_size=64)
EAGLE31 = HeadSpec("eagle3", last_layer=5, feature_layers=[1, 2, 4], ttt_steps=2, draft_vocab_size=64, fc_norm=True,
                   norm_output=True)
SPECS = {
    "eagle3": EAGLE3,
    "speculators": EAGLE3,
    "eagle": HeadSpec("eagle", norms="stripped", last_layer=5),
    "deepseek-mtp": HeadSpec("mtp", last_layer=5, mtp_depths=2, mtp_input="normed"),
}


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory) -> Path:
    """A tiny 6-layer target whose greedy text varies (so drafts are compared over many different states)."""
    out = tmp_path_factory.mktemp("export-target")
    tok = make_tokenizer()
    make_tiny_llama(len(tok), seed=5, layers=6, initializer_range=0.2).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def target_model(target_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def identity(target_dir: Path) -> dict:
    from mtptrain.config import TargetConfig
    from mtptrain.target import load_target

    return load_target(TargetConfig(model=str(target_dir))).identity()


def eval_args(target_dir, head, prompts, out, *overrides):
    settings = [f"target.model={target_dir}", f"eval.head={head}", f"eval.prompts={prompts}", f"eval.output_dir={out}",
                "eval.max_new_tokens=24", "eval.k=[3]", "eval.tree.budgets=[6]", "eval.tree.depth=3",
                "eval.tree.branch=2", "eval.repeats=1", *overrides]
    return ["eval", "--no-progress", *[a for s in settings for a in ("--set", s)]]


def write_prompts(path: Path, n: int) -> Path:
    rows = [{"id": f"q{i}", "category": "writing", "turns": [f"the word is hot and you see {i}"]} for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def save_trained_like_head(target_dir: Path, out: Path, spec: HeadSpec, seed: int = 0) -> Path:
    """A head with weights away from their initial values (norms too), saved as `mtptrain train` saves one."""
    model = target_model(target_dir)
    counts = Counter({i: 1000 - i for i in range(0, model.config.vocab_size, 5)})
    vocab = DraftVocab.from_counts(counts, spec.draft_vocab_size, model.config.vocab_size) if spec.draft_vocab_size else None
    torch.manual_seed(seed)
    head = spec.family.build(spec, FrozenTarget.of(model), vocab)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    recipe = {"name": "tiny-export", "target": {"model": str(target_dir)}}
    save_head(out, head, spec, identity(target_dir), {"train": {"steps": 7, "recipe": recipe}})
    return out
