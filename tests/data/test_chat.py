"""Loss masks: exactly the assistant answers and their end-of-turn marker, on several templates."""

import contextlib
import random

import numpy as np
import pytest
from conftest import CHATML, LLAMA3, WORDS, make_tokenizer

from mtptrain.data.chat import assistant_spans, prompt_ids, tokenize_conversation
from mtptrain.data.conversations import BadRow

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


def tokenize_whole(tokenizer, messages, max_length, unfinished=frozenset()):
    """The reference: the whole conversation rendered and tokenized, then cut to max_length.
    Returns (ids, mask, tokens in the whole conversation)."""
    text, spans = assistant_spans(tokenizer, messages, unfinished)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"][:max_length]
    mask = [int(any(s < end and e > start for start, end in spans)) for s, e in offsets]
    return encoded["input_ids"][:max_length], mask, len(encoded["input_ids"])


def words(rng: random.Random, chars: int) -> str:
    out, size = [], 0
    while size < chars:
        out.append(rng.choice(WORDS) + rng.choice([" ", " ", " ", ", ", ".\n", "\n\n", "  "]))
        size += len(out[-1])
    return "".join(out).strip()


def long_rows(rng: random.Random, long_chars: int) -> dict[str, list[dict]]:
    """Conversations whose long message sits in each place a character cut can fall."""
    def short():
        return words(rng, rng.randint(5, 60))

    big = words(rng, long_chars)
    return {
        "short": [{"role": "user", "content": short()}, {"role": "assistant", "content": short()}],
        "over max_length, under the bound": [m for _ in range(3) for m in (
            {"role": "user", "content": words(rng, 150)}, {"role": "assistant", "content": words(rng, 150)})],
        "long first answer": [{"role": "user", "content": short()}, {"role": "assistant", "content": big},
                              {"role": "user", "content": short()}, {"role": "assistant", "content": short()}],
        "long later answer": [{"role": "system", "content": short()}, {"role": "user", "content": short()},
                              {"role": "assistant", "content": short()}, {"role": "user", "content": short()},
                              {"role": "assistant", "content": big}],
        "long second question": [{"role": "user", "content": short()}, {"role": "assistant", "content": short()},
                                 {"role": "user", "content": big}, {"role": "assistant", "content": short()}],
        "long first question": [{"role": "user", "content": big}, {"role": "assistant", "content": short()}],
        "long system prompt": [{"role": "system", "content": big}, {"role": "user", "content": short()},
                               {"role": "assistant", "content": short()}],
    }


# Writes an empty think block between the generation prompt and each answer, as reasoning models' templates do.
THINK = ("{% for m in messages %}<{{ m['role'] }}>{% if m['role'] == 'assistant' %}<think>\n\n</think>\n\n{% endif %}"
         "{{ m['content'] }}<|im_end|>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


# Leaves system messages out: a cut inside one renders nothing, so the cut is refused and made later.
NO_SYSTEM = ("{% for m in messages %}{% if m['role'] != 'system' %}<{{ m['role'] }}>{{ m['content'] }}<|im_end|>"
             "{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.mark.parametrize("template", [CHATML, LLAMA3, FOOTER, THINK, NO_SYSTEM],
                         ids=["chatml", "llama3", "footer", "think", "no-system"])
@pytest.mark.parametrize("max_length", [96, 200, 400])
def test_a_cut_row_gives_the_tokens_and_mask_of_the_whole_row(template, max_length, longest_text):
    tok = make_tokenizer(template)
    for name, messages in long_rows(random.Random(max_length), 20_000).items():
        for unfinished in (frozenset(), frozenset({0})):
            ids, mask, total = tokenize_whole(tok, messages, max_length, unfinished)
            longest_text()
            if not any(mask):
                with pytest.raises(BadRow, match="no assistant token"):
                    tokenize_conversation(tok, messages, max_length, unfinished=unfinished)
                continue
            out = tokenize_conversation(tok, messages, max_length, unfinished=unfinished)
            assert out.input_ids.tolist() == ids, name
            assert out.loss_mask.tolist() == mask, name
            assert out.truncated == (total > max_length), name
            if total > max_length:
                with pytest.raises(BadRow, match=f"over-long: .*max_length {max_length}"):
                    tokenize_conversation(tok, messages, max_length, overlong="skip", unfinished=unfinished)


@pytest.mark.parametrize("template", [CHATML, LLAMA3, FOOTER], ids=["chatml", "llama3", "footer"])
def test_only_a_bounded_prefix_of_a_long_row_is_rendered_and_tokenized(template, longest_text):
    tok = make_tokenizer(template)
    for name, messages in long_rows(random.Random(1), 20_000).items():
        if not name.startswith("long"):
            continue
        sizes = []
        for factor in (1, 4):
            grown = [{**m, "content": m["content"] * factor} if len(m["content"]) > 10_000 else m for m in messages]
            longest_text()
            with contextlib.suppress(BadRow):  # rows with no answer within max_length are skipped either way
                tokenize_conversation(tok, grown, 64)
            sizes.append(longest_text())
        assert sizes[0] == sizes[1] < 5_000, (name, sizes)


def test_a_long_prompt_is_rendered_and_tokenized_only_up_to_the_limit(longest_text):
    tok = make_tokenizer()
    rng = random.Random(3)
    short = [{"role": "user", "content": words(rng, 600)}]
    assert len(prompt_ids(tok, short)) > 64
    assert prompt_ids(tok, short, limit=64) == prompt_ids(tok, short)  # within the bound: every token, as before
    for long in ([{"role": "user", "content": words(rng, 20_000)}],
                 [{"role": "system", "content": words(rng, 20_000)}, {"role": "user", "content": "hot"}]):
        whole = prompt_ids(tok, long)
        longest_text()
        assert prompt_ids(tok, long, limit=64) == whole[:65]  # the first limit + 1: enough to tell it is over
        assert longest_text() < 5_000
