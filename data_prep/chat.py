"""Rendering a conversation with the target's chat template, and its loss mask.

The mask marks what the assistant writes: from the end of the generation
prompt through the answer and the end-of-turn special token right after it
(so a head learns when a turn ends). Nothing of the prompt, the system text,
the role headers or a template's closing footer is marked.

It is found in character space, so it holds for any chat template without
knowing its markup: the rendering of messages[:i] with the generation prompt
is a prefix of the whole conversation and ends where answer i starts; the
answer's text is then located from there. Templates that rewrite earlier
answers (so the text no longer appears) make the row a bad row, never a
wrong mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data_prep.conversations import BadRow


@dataclass
class TokenizedConversation:
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]; 1 = assistant token
    truncated: bool


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` rendered with the generation prompt: what the target answers."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def stop_tokens(tokenizer, model) -> set[int]:
    """Token ids that end an answer: the tokenizer's EOS and the model's generation-config EOS ids."""
    stops = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    stops.update(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    return stops


def assistant_spans(tokenizer, messages: list[dict],
                    unfinished: frozenset[int] = frozenset()) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character span of every assistant answer.

    A span ends after the end-of-turn marker, except for the answers numbered in `unfinished` (0-based,
    counting assistant turns): answers cut by a length limit, whose marker the model never wrote."""
    try:
        full = render(tokenizer, messages)
    except Exception as exc:  # jinja raises TemplateError, or a template's own raise_exception
        raise BadRow("chat template rejected it", str(exc)) from None
    end_markers = _special_strings(tokenizer)
    spans: list[tuple[int, int]] = []
    cursor = 0
    answer = -1
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        answer += 1
        before = render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        start = len(before) if full.startswith(before) and len(before) >= cursor else cursor
        text = message["content"].strip()  # templates may trim the answer
        found = full.find(text, start)
        if found < 0:
            raise BadRow("template rewrites answers", f"assistant turn {i} does not appear verbatim in the "
                         "rendered conversation, so its tokens cannot be found")
        end = found + len(text)
        marker = next((m for m in end_markers if full.startswith(m, end)), "")
        spans.append((start if start == len(before) else found, end + (0 if answer in unfinished else len(marker))))
        cursor = end + len(marker)
    return full, spans


def _special_strings(tokenizer) -> list[str]:
    """Text of the tokenizer's special tokens, longest first (end-of-turn markers are among them)."""
    specials = set(tokenizer.all_special_tokens)
    specials.update(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)
    return sorted((s for s in specials if s), key=len, reverse=True)


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int, overlong: str = "truncate",
                          unfinished: frozenset[int] = frozenset()) -> TokenizedConversation:
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("loss masks need a fast (Rust) tokenizer with offset mapping")
    text, spans = assistant_spans(tokenizer, messages, unfinished)
    # The template already wrote any BOS it wants; adding special tokens again would double it.
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoded["input_ids"], dtype=np.int32)
    mask = _mask_from_offsets(encoded["offset_mapping"], spans)
    truncated = len(ids) > max_length
    if truncated:
        if overlong == "skip":
            raise BadRow("over-long", f"{len(ids)} tokens > max_length {max_length}")
        ids, mask = ids[:max_length], mask[:max_length]
    if not mask.any():
        raise BadRow("over-long", f"no assistant token within the first {max_length} tokens")
    return TokenizedConversation(ids, mask, truncated)


def _mask_from_offsets(offsets, spans: list[tuple[int, int]]) -> np.ndarray:
    starts = np.asarray([s for s, _ in offsets], dtype=np.int64)
    ends = np.asarray([e for _, e in offsets], dtype=np.int64)
    mask = np.zeros(len(starts), dtype=np.uint8)
    for span_start, span_end in spans:
        mask |= ((starts < span_end) & (ends > span_start)).astype(np.uint8)
    return mask
