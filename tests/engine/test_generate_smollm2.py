"""Exactness on the real embedded target, in float32: speculative output equals plain greedy decoding,
or differs first at a near-tie that batched verification may break the other way."""

import pytest
import torch

from eval.prompts import load_prompts
from mtptrain.config import TargetConfig
from mtptrain.engine.generate import generate
from mtptrain.engine.ngram import NgramProposer
from mtptrain.engine.runner import TargetRunner
from mtptrain.target import load_target

pytestmark = pytest.mark.real_model
NEAR_TIE = 1e-3  # top-2 logit gap of the baseline below which float32 batched verification may flip


@pytest.fixture(scope="module")
def smollm2():
    return load_target(TargetConfig())


def test_greedy_speculative_output_equals_greedy_decoding_up_to_near_ties(smollm2):
    tok = smollm2.tokenizer
    runner = TargetRunner(smollm2.model)
    prompts = load_prompts("mtbench", limit=3)
    eos = {tok.convert_tokens_to_ids("<|im_end|>")}
    drafted = 0
    for prompt in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt.turns[0]}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        plain = generate(runner, ids, 64, eos=eos)
        reference = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                                           eos_token_id=list(eos), pad_token_id=0)[0, len(ids):].tolist()
        assert plain.tokens == reference  # the engine's baseline is the target's own greedy decoding
        spec = generate(runner, ids, 64, NgramProposer(1, 3), k=4, eos=eos)
        drafted += sum(spec.stats.proposed)
        if spec.tokens != plain.tokens:
            first = next(i for i, (a, b) in enumerate(zip(spec.tokens, plain.tokens)) if a != b)
            with torch.no_grad():
                logits = smollm2.model(torch.tensor([ids + plain.tokens[:first]])).logits[0, -1]
            top2 = logits.topk(2).values
            assert float(top2[0] - top2[1]) < NEAR_TIE, (prompt.id, first, float(top2[0] - top2[1]))
    assert drafted > 0
