"""How far the tokens a head is trained on differ from the tokens it drafts when serving.

    python benchmarks/retokenization.py [--prompts 80] [--turns 2] [--new-tokens 64] [--model DIR]

Serving, the head drafts the target's own decoded token ids. Training, it reads the conversation as precompute
stores it: the answers' text rendered with the chat template and tokenized again (data/chat.py). A tokenizer
may split decoded text otherwise than the model wrote it (SmolLM2 writes "\\n\\n" as one token that the
tokenizer, reading the text, makes two of), so at such places the head is trained on a token stream the target
never serves. This measures how many: the target answers MT-bench greedily (every turn, each answer at most
--new-tokens tokens, as eval runs it); the conversation is then tokenized as precompute does, and each answer's
decoded ids are aligned with the ids of its stored span (difflib). Printed: per turn, the answers, their decoded
tokens, the answers whose stored ids differ, and the decoded tokens missing from the stored span; then the
pieces that differ most often (decoded -> stored).
"""

from __future__ import annotations

import argparse
import collections
import difflib

from mtptrain.config import load_recipe
from mtptrain.data.chat import _mask_from_offsets, assistant_spans, prompt_ids, stop_tokens
from mtptrain.engine.generate import generate
from mtptrain.eval.prompts import load_prompts
from mtptrain.machine import describe_cpu
from mtptrain.runtime.runner import open_runner, runtime_description, runtime_for
from mtptrain.target import load_target


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=80, help="MT-bench questions (the first n)")
    parser.add_argument("--turns", type=int, default=2, help="turns of each question answered")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens of each answer at most")
    parser.add_argument("--top", type=int, default=10, help="differing pieces listed")
    parser.add_argument("--model", help="target.model (default: the embedded target)")
    return parser.parse_args()


def stored_answers(tokenizer, messages: list[dict], unfinished: frozenset[int]) -> list[list[int]]:
    """Each answer's token ids as precompute stores the conversation: the tokens of the rendering that its loss
    mask marks for that answer (data/chat.py), the end-of-turn marker dropped. An empty answer gives []."""
    text, spans = assistant_spans(tokenizer, messages, unfinished)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    specials = set(tokenizer.all_special_ids)
    answers = []
    for span in spans:  # the loss mask's own rule, one answer's span at a time
        marked = _mask_from_offsets(encoded["offset_mapping"], [span])
        ids = [token for token, on in zip(encoded["input_ids"], marked.tolist()) if on]
        while ids and ids[-1] in specials:
            ids.pop()
        answers.append(ids)
    return answers


def main() -> None:
    args = parse_args()
    recipe = load_recipe(None, [f"target.model={args.model}"] if args.model else [])
    target = load_target(recipe.target)
    tok = target.tokenizer
    stops = stop_tokens(tok, target.model)
    runner = open_runner(runtime_for(target.model))
    print(f"target {target.name}, {args.prompts} MT-bench questions x {args.turns} turns x up to {args.new_tokens} "
          f"tokens, greedy; {runtime_description(runner)}")
    print(f"CPU: {describe_cpu()}")
    counts = [collections.Counter() for _ in range(args.turns)]
    pieces: collections.Counter = collections.Counter()
    for question in load_prompts("mtbench", args.prompts):
        messages: list[dict] = []
        decoded: list[list[int]] = []
        unfinished = set()
        for turn, text in enumerate(question.turns[:args.turns]):
            messages.append({"role": "user", "content": text})
            tokens = generate(runner, prompt_ids(tok, messages), args.new_tokens, eos=stops,
                              reuse_prefix=True).tokens
            answer = [t for t in tokens if t not in stops]
            if len(answer) == len(tokens):  # no end of turn: cut at the token budget
                unfinished.add(turn)
            decoded.append(answer)
            messages.append({"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)})
        for turn, (answer, stored) in enumerate(zip(decoded, stored_answers(tok, messages, frozenset(unfinished)))):
            match = difflib.SequenceMatcher(a=answer, b=stored, autojunk=False)
            missing = len(answer) - sum(block.size for block in match.get_matching_blocks())
            counts[turn].update(answers=1, tokens=len(answer), differing=missing > 0, missing=missing)
            for op, a0, a1, b0, b1 in match.get_opcodes():
                if op != "equal":
                    pieces[(repr(tok.decode(answer[a0:a1])), len(answer[a0:a1]), len(stored[b0:b1]))] += 1
    print("\n| turn | answers | decoded tokens | answers that differ | decoded tokens missing from the stored span |")
    print("|---|---|---|---|---|")
    for turn, c in enumerate(counts, 1):
        share = c["missing"] / c["tokens"] if c["tokens"] else 0.0
        print(f"| {turn} | {c['answers']} | {c['tokens']:,} | {c['differing']} | {c['missing']:,} ({share:.2%}) |")
    print(f"\nmost frequent differences (text, decoded tokens -> stored tokens), of {sum(pieces.values())}:")
    for (text, written, stored), n in pieces.most_common(args.top):
        print(f"  {n} x {text}: {written} -> {stored}")


if __name__ == "__main__":
    main()
