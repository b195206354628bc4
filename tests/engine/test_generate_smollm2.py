"""Exactness on the real embedded target, in float32, for every proposer: speculative output equals plain
greedy decoding, or differs first at a near-tie that batched verification may break the other way."""

import pytest
import torch

from mtptrain.eval.prompts import load_prompts
from mtptrain.config import TargetConfig
from mtptrain.engine.draft_model import DraftModelProposer, truncated_target
from mtptrain.engine.generate import generate
from mtptrain.engine.head_chain import HeadChainProposer
from mtptrain.engine.head_tree import HeadTreeProposer
from mtptrain.engine.mtp_chain import MTPChainProposer
from mtptrain.engine.ngram import NgramProposer
from mtptrain.runtime.runner import open_runner
from mtptrain.engine.suffix_index import SuffixIndexProposer
from mtptrain.heads import FrozenTarget
from mtptrain.heads.spec import HeadSpec
from mtptrain.target import load_target

pytestmark = pytest.mark.real_model
NEAR_TIE = 1e-3  # top-2 logit gap of the baseline below which float32 batched verification may flip
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def smollm2():
    return load_target(TargetConfig(dtype="float32"))


@pytest.fixture(scope="module")
def requests(smollm2):
    """Two MT-bench first turns and the baseline's greedy answers (checked against transformers' generate)."""
    tok = smollm2.tokenizer
    eos = {tok.convert_tokens_to_ids("<|im_end|>")}
    runner = open_runner(smollm2.model)
    out = []
    for prompt in load_prompts("mtbench", limit=2):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt.turns[0]}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        plain = generate(runner, ids, NEW_TOKENS, eos=eos)
        assert plain.stats.tau == 1.0
        out.append((prompt.id, ids, plain.tokens))
    ids = out[0][1]
    reference = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                       eos_token_id=list(eos), pad_token_id=0)[0, len(ids):].tolist()
    assert out[0][2] == reference  # the engine's baseline is the target's own greedy decoding
    return eos, out


def _random_head(model, spec):
    torch.manual_seed(0)
    return spec.family.build(spec, FrozenTarget.of(model))  # eagle3: the draft vocabulary is ids 0..2047


def _proposers(model):
    eagle3 = HeadSpec("eagle3", last_layer=29, feature_layers=[1, 14, 26], ttt_steps=2, draft_vocab_size=2048)
    mtp = HeadSpec("mtp", last_layer=29, mtp_depths=2)
    return {
        "ngram": (lambda: NgramProposer(1, 3), 4, []),
        "draft-model": (lambda: DraftModelProposer(truncated_target(model, 24)), 4, []),
        "head-chain": (lambda: HeadChainProposer(_random_head(model, eagle3), eagle3), 3, [1, 14, 26, 29]),
        "head-tree": (lambda: HeadTreeProposer(_random_head(model, eagle3), eagle3, 3, 3, 10), 3, [1, 14, 26, 29]),
        "mtp-chain": (lambda: MTPChainProposer(_random_head(model, mtp), mtp), 2, [29]),
    }


@pytest.mark.parametrize("name", ["ngram", "suffix-index", "draft-model", "head-chain", "head-tree", "mtp-chain"])
def test_every_proposer_reproduces_greedy_decoding_up_to_near_ties(smollm2, requests, name):
    eos, cases = requests
    if name == "suffix-index":
        # an index over the answers themselves drafts whole runs: the deepest batched verifications
        proposer, k, capture = SuffixIndexProposer(background=False), 6, []
        for _, ids, tokens in cases:
            proposer.finish(ids + tokens)
    else:
        make, k, capture = _proposers(smollm2.model)[name]
        proposer = make()
    runner = open_runner(smollm2.model, capture=capture)
    drafted = accepted = 0
    for prompt_id, ids, plain in cases:
        spec = generate(runner, ids, NEW_TOKENS, proposer, k=k, eos=eos)
        drafted += sum(spec.stats.proposed)
        accepted += sum(spec.stats.accepted)
        if spec.tokens != plain:
            first = next((i for i, (a, b) in enumerate(zip(spec.tokens, plain)) if a != b), None)
            assert first is not None, (prompt_id, "same prefix, different length")
            with torch.no_grad():
                logits = smollm2.model(torch.tensor([ids + plain[:first]])).logits[0, -1]
            top2 = logits.topk(2).values
            assert float(top2[0] - top2[1]) < NEAR_TIE, (prompt_id, first, float(top2[0] - top2[1]))
    runner.close()
    assert drafted > 0
    if name in ("suffix-index", "draft-model", "ngram"):
        assert accepted > 0  # batched verification of accepted runs was exercised
