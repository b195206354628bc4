"""Loss masks: exactly the assistant answers and their end-of-turn marker, on several templates."""

import numpy as np
import pytest
from conftest import CHATML, LLAMA3, make_tokenizer

from data_prep.chat import tokenize_conversation
from data_prep.conversations import BadRow

CONVERSATION = [
    {"role": "user", "content": "the word is hot"},
    {"role": "assistant", "content": "you see a long day"},
    {"role": "user", "content": "and what of water"},
    {"role": "assistant", "content": "people come back, 42 times!"},
]


def masked_runs(tokenizer, ids, mask) -> list[str]:
    """Decoded text of each maximal run of masked tokens."""
    runs, current = [], []
    for token, m in zip(ids.tolist(), mask.tolist()):
        if m:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


@pytest.mark.parametrize("template, end_of_turn", [(CHATML, "<|im_end|>"), (LLAMA3, "<|eot_id|>")],
                         ids=["chatml", "llama3"])
def test_mask_is_exactly_each_answer_and_its_end_of_turn(template, end_of_turn):
    tok = make_tokenizer(template)
    out = tokenize_conversation(tok, CONVERSATION, max_length=1000)
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert masked_runs(tok, out.input_ids, out.loss_mask) == [a + end_of_turn for a in answers]
    # Nothing of the prompt side is masked; the whole rendering round-trips.
    full = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert tok.decode(out.input_ids) == full
    assert not out.truncated


@pytest.mark.parametrize("template, end_of_turn", [(CHATML, "<|im_end|>"), (LLAMA3, "<|eot_id|>")],
                         ids=["chatml", "llama3"])
def test_an_unfinished_answer_leaves_its_end_of_turn_out_of_the_mask(template, end_of_turn):
    tok = make_tokenizer(template)
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    out = tokenize_conversation(tok, CONVERSATION, max_length=1000, unfinished=frozenset({0}))
    assert masked_runs(tok, out.input_ids, out.loss_mask) == [answers[0]] + [a + end_of_turn for a in answers[1:]]
    assert tok.decode(out.input_ids) == tok.apply_chat_template(CONVERSATION, tokenize=False)  # same tokens


def test_llama3_template_bos_is_not_doubled():
    tok = make_tokenizer(LLAMA3)
    out = tokenize_conversation(tok, CONVERSATION, max_length=1000)
    assert int((out.input_ids == tok.bos_token_id).sum()) == 1


def test_truncation_and_overlong_policies():
    tok = make_tokenizer()
    full = tokenize_conversation(tok, CONVERSATION, max_length=1000)
    first_answer = int(np.argmax(full.loss_mask))
    keep = first_answer + 3
    cut = tokenize_conversation(tok, CONVERSATION, max_length=keep)
    assert cut.truncated and len(cut.input_ids) == keep
    assert np.array_equal(cut.input_ids, full.input_ids[:keep]) and np.array_equal(cut.loss_mask, full.loss_mask[:keep])
    with pytest.raises(BadRow, match="over-long"):
        tokenize_conversation(tok, CONVERSATION, max_length=keep, overlong="skip")
    with pytest.raises(BadRow, match="no assistant token"):
        tokenize_conversation(tok, CONVERSATION, max_length=first_answer)


def test_template_that_raises_is_a_bad_row():
    tok = make_tokenizer("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(BadRow) as bad:
        tokenize_conversation(tok, CONVERSATION, max_length=100)
    assert bad.value.reason == "chat template rejected it" and "alternate" in bad.value.detail


FOOTER = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|im_end|>{% endfor %}"
          "{% if add_generation_prompt %}<assistant>{% else %}[end]{% endif %}")


def test_a_closing_footer_is_not_masked():
    tok = make_tokenizer(FOOTER)
    out = tokenize_conversation(tok, CONVERSATION, max_length=1000)
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert masked_runs(tok, out.input_ids, out.loss_mask) == [a + "<|im_end|>" for a in answers]


def test_an_answer_repeating_the_question_is_masked_in_the_answer():
    tok = make_tokenizer(FOOTER)
    conversation = [{"role": "user", "content": "the word is hot"}, {"role": "assistant", "content": "hot"},
                    {"role": "user", "content": "hot or not"}, {"role": "assistant", "content": "hot"}]
    out = tokenize_conversation(tok, conversation, max_length=1000)
    text = tok.decode(out.input_ids)
    assert masked_runs(tok, out.input_ids, out.loss_mask) == ["hot<|im_end|>", "hot<|im_end|>"]
    first_masked = int(out.loss_mask.argmax())
    assert tok.decode(out.input_ids[:first_masked]) == text[: text.index("<assistant>hot") + len("<assistant>")]


def test_template_rewriting_earlier_answers_is_a_bad_row_not_a_wrong_mask():
    template = ("{% for m in messages %}<{{ m['role'] }}>{% if m['role'] == 'assistant' and not loop.last %}"
                "{{ m['content'] | upper }}{% else %}{{ m['content'] }}{% endif %}</s>{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok = make_tokenizer(template)
    with pytest.raises(BadRow) as bad:
        tokenize_conversation(tok, CONVERSATION + [{"role": "user", "content": "day"}], max_length=1000)
    assert bad.value.reason == "template rewrites answers"


@pytest.mark.real_model
def test_mask_on_the_real_smollm2_template():
    from mtptrain.config import TargetConfig
    from mtptrain.target import load_tokenizer

    tok = load_tokenizer(TargetConfig())
    out = tokenize_conversation(tok, CONVERSATION, max_length=1000)
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert masked_runs(tok, out.input_ids, out.loss_mask) == [a + "<|im_end|>" for a in answers]
    assert tok.decode(out.input_ids).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
