"""Answer-start data: every conversation's first request and the first tokens of the target's answer to it.

    python benchmarks/first_turns.py runs/answer-start/regenerated.jsonl runs/answer-start/first-turns.jsonl

MT-bench scores 64-token answers, whose first tokens draft worst; a regenerated answer runs to 192 tokens. Cut to
their first CUT tokens, the same training tokens hold about three times as many answer starts
(docs/reference-run.md, "Answer starts"). The input is a file written by `mtptrain regenerate`; conversations
without an assistant turn are left out; the output is written whole or not at all (a `.tmp` beside it, renamed at
the end), so a killed run leaves nothing half-written to be trained on. The answer-start arm and the levers' store
(benchmarks/answer_start_arm.sh, benchmarks/levers_as5k.sh) are built with it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mtptrain.config import load_recipe
from mtptrain.data.readers import read_jsonl
from mtptrain.target.loading import load_tokenizer


def first_turns(source: Path, out: Path, tokenizer, cut: int) -> int:
    """Write `out` from `source`; the number of conversations written. A line that is not a conversation is named
    by file and line and stops the run."""
    tmp = out.with_name(out.name + ".tmp")
    try:
        kept = _write(source, tmp, tokenizer, cut)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(out)
    return kept


def _write(source: Path, tmp: Path, tokenizer, cut: int) -> int:
    kept = 0
    with tmp.open("w") as w:
        for row in read_jsonl(source):  # a damaged line is named by file and line, never guessed at
            if row.problem:
                sys.exit(f"error: {row.ref}: {row.problem[0]} ({row.problem[1]}); give a file written by mtptrain "
                         "regenerate")
            messages = row.value.get("messages") if isinstance(row.value, dict) else None
            if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                         for m in messages):
                sys.exit(f"error: {row.ref}: not a conversation (a line with a list of role/content messages)")
            first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
            if first is None:
                continue
            ids = tokenizer(messages[first]["content"], add_special_tokens=False)["input_ids"][:cut]
            answer = {"role": "assistant", "content": tokenizer.decode(ids)}
            w.write(json.dumps({"id": row.value.get("id", row.ref), "messages": messages[:first] + [answer]}) + "\n")
            kept += 1
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a JSONL file written by `mtptrain regenerate`")
    parser.add_argument("out", type=Path, help="the JSONL file to write (a data.source for precompute)")
    parser.add_argument("--cut", type=int, default=64, help="answer tokens kept (default 64, MT-bench's length)")
    parser.add_argument("--recipe", default="recipes/reference.yaml", help="whose target's tokenizer cuts")
    args = parser.parse_args()
    if args.cut < 1:
        parser.error("--cut: at least 1 token")
    tokenizer = load_tokenizer(load_recipe(args.recipe).target)
    kept = first_turns(args.source, args.out, tokenizer, args.cut)
    print(f"{kept} first turns, answers cut at {args.cut} tokens -> {args.out}")


if __name__ == "__main__":
    main()
