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

A row far longer than max_length is cut before it is rendered: tokenizing a
50 MB row whole took 7 GB and a minute to keep its first few thousand
tokens. `content_budget` says how many characters of message content can
hold the first max_length tokens; the messages are cut to that many, the cut
rendering is tokenized, and what is kept is checked to lie well before the
point where the cut rendering stops matching the whole one (see `_cut_is_safe`).
Rows within the budget are rendered and tokenized whole, as always.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from mtptrain.data.conversations import BadRow


@dataclass
class TokenizedConversation:
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]; 1 = assistant token
    truncated: bool


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def prompt_ids(tokenizer, messages: list[dict], limit: int | None = None) -> list[int]:
    """Token ids of `messages` rendered with the generation prompt: what the target answers.

    With a `limit`, a prompt too long in characters to have `limit` tokens or fewer is cut before it is
    tokenized, and only its first limit + 1 tokens come back: enough to see that it is over the limit."""
    # Offsets, which the check of a cut needs, come from fast tokenizers only; a slow one tokenizes whole.
    budget = content_budget(tokenizer, limit) if limit is not None and getattr(tokenizer, "is_fast", False) else None
    while budget is not None:
        cut = _cut_messages(messages, budget)
        if cut is None:
            break
        kept, _ = cut
        text = render(tokenizer, kept)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if _cut_is_safe(tokenizer, kept, text, encoded["offset_mapping"], limit + 1):
            return list(encoded["input_ids"][:limit + 1])
        budget *= 2
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
    """The conversation's first max_length tokens and their loss mask (BadRow if it cannot be a sample).

    A conversation with more than `content_budget` characters of content is cut to that many before it is
    rendered: only its first max_length tokens are kept, and they lie well inside the cut."""
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("loss masks need a fast (Rust) tokenizer with offset mapping")
    budget = content_budget(tokenizer, max_length)
    while (cut := _cut_messages(messages, budget)) is not None:
        kept, cut_answer = cut
        text, spans = assistant_spans(tokenizer, kept, unfinished if cut_answer is None else unfinished | {cut_answer})
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoded["offset_mapping"]
        if _cut_is_safe(tokenizer, kept, text, offsets, max_length + 1):
            # Its first max_length + 1 tokens are the whole row's: the row is over max_length.
            if overlong == "skip":
                raise BadRow("over-long", f"more than max_length {max_length} tokens "
                             f"({sum(len(m['content']) for m in messages):,} characters)")
            ids = np.asarray(encoded["input_ids"][:max_length], dtype=np.int32)
            mask = _mask_from_offsets(offsets[:max_length], spans)
            if not mask.any():
                raise BadRow("over-long", f"no assistant token within the first {max_length} tokens")
            return TokenizedConversation(ids, mask, True)
        budget *= 2  # not shown to match the whole row (see _cut_is_safe): cut later, at worst not at all
    return _tokenize_whole(tokenizer, messages, max_length, overlong, unfinished)


def _tokenize_whole(tokenizer, messages: list[dict], max_length: int, overlong: str,
                    unfinished: frozenset[int]) -> TokenizedConversation:
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


# Tokens kept from a cut rendering must end this far before the point where it stops matching the whole
# rendering. Tokenizing is local: a pre-tokenizer splits on a character or two of context and BPE merges
# inside one word, so only the last tokens before the cut can differ; SAFETY_TOKENS of the longest token
# are many times that. SAFETY_CHARS covers text a template puts between the generation prompt and an answer
# (such as an empty think block), where a short cut answer could be found too early.
SAFETY_TOKENS = 16
SAFETY_CHARS = 256
_longest_token: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer) -> int:
    """Characters of the longest vocabulary entry, special tokens included, computed once per tokenizer.

    An entry is written in the model's own alphabet, never shorter than the text it covers: one character
    per byte for byte-level BPE, the word marker standing for a space in SentencePiece, "<0xNN>" for one
    byte, "##" before WordPiece continuations. So no token covers more characters of the rendering, short
    of a normalizer that merges characters (NFKC composing a letter and its accent) or drops them; what
    that breaks, `_cut_is_safe` notices."""
    size = len(tokenizer)
    known = _longest_token.get(tokenizer)
    if known is None or known[0] != size:  # tokens added since are counted too
        known = (size, max(map(len, tokenizer.get_vocab()), default=1))
        _longest_token[tokenizer] = known
    return known[1]


def content_budget(tokenizer, max_length: int) -> int:
    """Characters of message content that a conversation may have and still be rendered and tokenized whole.

    The first max_length + 1 tokens of a rendering cover at most (max_length + 1) * longest characters, the
    template only adds to the content before the cut, and the safety margin follows, so a conversation cut
    to this many characters still holds all of them (`_cut_is_safe` checks it)."""
    longest = longest_token_chars(tokenizer)
    return (max_length + 1 + SAFETY_TOKENS) * longest + SAFETY_CHARS


def _cut_messages(messages: list[dict], budget: int) -> tuple[list[dict], int | None] | None:
    """The messages cut to `budget` characters of content, and the number (among the answers) of an answer
    that was cut; None if the conversation is within the budget.

    The message that crosses the budget is cut there and the ones after it dropped, so the list stays a
    valid conversation: a prefix of it, possibly ending with the user turn the answer would follow."""
    used = 0
    answers = 0
    for i, message in enumerate(messages):
        content = message["content"]
        if used + len(content) > budget:
            if used == budget:  # the budget ends with the message before (never the first: budget > 0)
                return messages[:i], None
            cut = {**message, "content": content[:budget - used]}
            return messages[:i] + [cut], answers if message["role"] == "assistant" else None
        used += len(content)
        answers += message["role"] == "assistant"
    return None


def _cut_is_safe(tokenizer, kept: list[dict], text: str, offsets, needed: int) -> bool:
    """Whether the first `needed` tokens of `text`, the rendering of the cut messages, are those of the whole
    conversation: there are that many, and they end SAFETY margin before the point where the rendering
    stops matching the whole one.

    That point is found by rendering the cut messages again with one more character at the end of the last
    content (a NUL, which no template writes there): the two renderings agree up to where the cut content
    ends. The whole conversation agrees with them up to there as well, since a template writes each message
    the same way whatever follows it (the prefix property `assistant_spans` relies on). When the check
    fails (a tokenizer that drops characters, a template that drops content) the caller cuts later, and at
    worst renders the row whole."""
    if len(offsets) < needed or not kept:
        return False
    marked = kept[:-1] + [{**kept[-1], "content": kept[-1]["content"] + "\0"}]
    try:
        other = render(tokenizer, marked)
    except Exception:  # a template that refuses the marked copy gives no proof; cut later
        return False
    margin = SAFETY_TOKENS * longest_token_chars(tokenizer) + SAFETY_CHARS
    return offsets[needed - 1][1] <= _common_prefix(text, other) - margin


def _common_prefix(a: str, b: str, block: int = 1 << 16) -> int:
    """Length of the common prefix of two strings, comparing blocks before characters."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i:i + block] == b[i:i + block]:
        i += block
    while i < n and a[i] == b[i]:
        i += 1
    return min(i, n)
