"""Turning raw rows of any supported layout into one normalised conversation.

Supported layouts (detected per row when the format is "auto"):

* ShareGPT: {"id": ..., "conversations": [{"from": "human"|"gpt"|..., "value": str}]}
* messages: {"messages": [{"role": "user"|"assistant"|"system", "content": str}]}
  (UltraChat-200k and most chat datasets on the hub)
* UltraChat (original): {"id": ..., "data": [user, assistant, user, ...]}
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

ROLE_NAMES = {
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system",
}


class BadRow(ValueError):
    """A row that cannot become a training sample; `reason` is a short category."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass
class Conversation:
    id: str
    messages: list[dict[str, str]]  # [{"role": ..., "content": ...}], roles normalised


def normalise(row: Any, ref: str, fmt: str = "auto", messages_column: str | None = None,
              answered: bool = True) -> Conversation:
    """One row as a conversation of role/content messages. `answered` False takes rows with user turns only (what
    `mtptrain regenerate` answers, such as `mtptrain self-prompts`' requests); training needs an answer."""
    if not isinstance(row, dict):
        raise BadRow("wrong type", f"row is a {type(row).__name__}, expected an object")
    layout = fmt if fmt != "auto" else _detect(row, messages_column)
    if layout == "sharegpt":
        turns = [_turn(t, "from", "value") for t in _list_field(row, "conversations")]
    elif layout == "messages":
        turns = [_turn(t, "role", "content") for t in _list_field(row, messages_column or "messages")]
    elif layout == "ultrachat":
        turns = [("user" if i % 2 == 0 else "assistant", _text(t)) for i, t in enumerate(_list_field(row, "data"))]
    else:
        raise BadRow("unknown layout", f"keys {sorted(row)[:6]}: expected conversations, messages or data")
    # A conversation that opens with the assistant (common in ShareGPT dumps
    # cut from longer chats) has nothing to answer: drop those opening turns.
    while turns and turns[0][0] == "assistant":
        turns.pop(0)
    if not any(role == "user" for role, _ in turns):
        raise BadRow("no user turn", "only assistant or system turns: nothing was asked")
    if answered and not any(role == "assistant" for role, _ in turns):
        raise BadRow("no assistant turn")
    conv_id = row.get("id") or row.get("prompt_id") or ref
    return Conversation(str(conv_id), [{"role": r, "content": c} for r, c in turns])


def unique_key(conversation_id: str, seen: Counter) -> str:
    """A key no earlier row took: repeated ids become id#1, id#2, ... (skipping any already in use).

    Called for every row that normalises, before any later check can skip it, so the original and the
    regenerated conversations (`mtptrain regenerate`) get the same keys, hence the same split."""
    key = conversation_id
    while key in seen:
        seen[conversation_id] += 1
        key = f"{conversation_id}#{seen[conversation_id]}"
    seen[key] += 0
    return key


def _detect(row: dict, messages_column: str | None) -> str:
    if messages_column and messages_column in row:
        return "messages"
    if "conversations" in row:
        return "sharegpt"
    if "messages" in row:
        return "messages"
    if "data" in row:
        return "ultrachat"
    return "unknown"


def _list_field(row: dict, key: str) -> list:
    value = row.get(key)
    if not isinstance(value, list):
        raise BadRow("wrong type", f"'{key}' is {type(value).__name__}, expected a list of turns")
    if not value:
        raise BadRow("empty conversation", f"'{key}' is empty")
    return value


def _turn(turn: Any, role_key: str, text_key: str) -> tuple[str, str]:
    if not isinstance(turn, dict):
        raise BadRow("wrong type", f"a turn is a {type(turn).__name__}, expected an object")
    role = turn.get(role_key)
    if not isinstance(role, str) or role.lower() not in ROLE_NAMES:
        raise BadRow("unknown role", f"{role_key}={role!r}")
    return ROLE_NAMES[role.lower()], _text(turn.get(text_key))


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise BadRow("wrong type", f"turn text is {type(value).__name__}, expected a string")
    if not value.strip():
        raise BadRow("empty turn")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRow("non-UTF-8 text", f"undecodable byte near character {exc.start}") from None
    return value
