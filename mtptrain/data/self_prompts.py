"""User requests written by the target itself, for it to answer in `mtptrain regenerate`.

An instruction-tuned model, given its chat template up to the start of a user
turn and nothing else, continues with a user request drawn from what it was
tuned on (Magpie: Xu et al., arXiv:2406.08464). Those requests sit closer to
the target's own instruction data than a fixed chat corpus does, and they cost
a few dozen sampled tokens each. `mtptrain self-prompts` samples
`self_prompts.count` of them and keeps the ones that read as a request: ended
by the target's end-of-turn token within `max_new_tokens`, at least
`min_chars` long, and not a repeat of one already kept (compared without case
or spacing). The output is a JSONL data source of single-turn conversations
(`{"id", "messages"}`), which `mtptrain regenerate` then answers like any
other source.

Resuming works as in regenerate: requests are sampled in groups of 8 batches,
each request from its own seeded stream; after each group the kept requests
are appended and fsynced and the state file (`<output>.state.json`) records
the group count and the file's length. A rerun cuts the file back to that
length, rebuilds the set of kept requests from it, and goes on with the next
group, on the dtype and kernels the run began with, so a killed job ends with
the file an uninterrupted one writes.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from tqdm import tqdm

from mtptrain.config import Recipe
from mtptrain.data.chat import render, stop_tokens
from mtptrain.data.engines import decoding, generation_stops, recorded_runtime, sampler, turn_seed
from mtptrain.data.resumable import (GROUP_BATCHES, RegenerateError, append_lines, check_written, load_state,
                                     state_path, truncate_to)
from mtptrain.engine.verify import Sampling
from mtptrain.io import atomic_write_json, load_json
from mtptrain.runtime.batch import Request, decode_stream
from mtptrain.runtime.runner import source_record
from mtptrain.target import load_target

log = logging.getLogger(__name__)
VERSION = 1
MARK = "\u2063SELF-PROMPT\u2063"  # stands in for the request while the template is rendered


def request_prefix(tokenizer) -> list[int]:
    """The ids of the chat template up to where a user request's text begins (the template's default system
    prompt included, where it has one): rendered around a marker and cut before it."""
    text = render(tokenizer, [{"role": "user", "content": MARK}])
    if text.count(MARK) != 1:
        raise RegenerateError("the target's chat template does not render a user turn's text once as it is given: "
                              "self-prompts needs a chat template that places the user's words verbatim")
    return tokenizer(text[: text.index(MARK)], add_special_tokens=False)["input_ids"]


def normal_form(text: str) -> str:
    return " ".join(text.lower().split())


def settings_of(recipe: Recipe) -> dict:
    """What the file depends on: every self_prompts setting but the output's path (the batch size too, as it cuts
    the groups, and so the order in which repeats are found)."""
    return {"version": VERSION, **recipe.self_prompts.model_dump(mode="json", exclude={"output"})}


def _state(output: Path, settings: dict, identity: dict) -> dict:
    fresh = {"settings": settings, "target": identity, "groups_done": 0, "bytes": 0, "complete": False,
             "counts": {"sampled": 0, "kept": 0, "dropped": {}}}
    state = load_state(output, fresh, "self_prompts.output", "self-prompts")
    if state is fresh:
        return fresh
    if state["settings"] != settings:
        before = state["settings"]
        changed = ", ".join(f"{k}: {before.get(k)!r} -> {settings.get(k)!r}"
                            for k in sorted(set(settings) | set(before)) if settings.get(k) != before.get(k))
        raise RegenerateError(f"{output} was written with other settings ({changed}); keep them to resume, or set "
                              "self_prompts.output to a new path")
    check_written(state, output, identity, "self_prompts.output")
    return state


def _kept_so_far(output: Path, size: int) -> set[str]:
    """The normal forms of the requests already written (the first `size` bytes of the file)."""
    with open(output, "rb") as fh:
        lines = fh.read(size).decode("utf-8", errors="replace").splitlines()
    kept = set()
    for number, line in enumerate(lines, start=1):
        try:
            kept.add(normal_form(load_json(line)["messages"][0]["content"]))
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise RegenerateError(f"{output}:{number} is not a request self-prompts wrote: the file was changed "
                                  "outside mtptrain; delete it and its state file to start over") from None
    return kept


def run_self_prompts(recipe: Recipe, show_progress: bool = True) -> dict:
    cfg = recipe.self_prompts
    if not cfg.output:
        raise RegenerateError("self_prompts.output is not set: give the output file, e.g. "
                              "--set self_prompts.output=runs/NAME/self-prompts.jsonl")
    output = Path(cfg.output)
    recorded = recorded_runtime(output, recipe.target.dtype, "self_prompts.output")
    target = load_target(recipe.target if recorded is None else
                         recipe.target.model_copy(update={"dtype": recorded["dtype"]}))
    tokenizer, model = target.tokenizer, target.model
    state = _state(output, settings_of(recipe), target.identity())
    counts = state["counts"]
    groups = -(-cfg.count // (cfg.batch_size * GROUP_BATCHES))
    if state["complete"]:
        log.info("self-prompts: %s is complete; nothing to do", output)
        return {"output": str(output), **counts, "tokens_this_run": 0, "seconds_this_run": 0.0}
    truncate_to(output, state["bytes"])
    seen = _kept_so_far(output, state["bytes"])
    prefix = request_prefix(tokenizer)
    stops = stop_tokens(tokenizer, model) | generation_stops(recipe.target)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops, default=0)
    sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p)
    size = cfg.batch_size * GROUP_BATCHES
    progress = tqdm(total=cfg.count, initial=min(cfg.count, state["groups_done"] * size), desc="self-prompts",
                    unit=" req", disable=not show_progress)
    tokens_now, started = 0, time.perf_counter()

    def sampled(request: Request) -> None:  # a request is one turn: nothing follows it in its row
        progress.update(1)

    with decoding(recipe, "runtime", model, output, state.get("runtime")) as source:
        if "runtime" not in state:
            state["runtime"] = source_record(source)
        for g in range(state["groups_done"], groups):
            numbers = range(g * size, min(cfg.count, (g + 1) * size))
            requests = []
            for n in numbers:
                seed = turn_seed(cfg.seed, f"self-{n}", 0)
                requests.append(Request(list(prefix), cfg.max_new_tokens, sampler(sampling, seed), seed))
            decode_stream(source, requests, sampled, cfg.batch_size, stops, pad_id, recipe.target.runtime)
            lines = []
            for n, request in zip(numbers, requests):
                tokens_now += len(request.tokens)
                text = tokenizer.decode(request.tokens, skip_special_tokens=True).strip()
                why = ("cut by max_new_tokens" if not request.stopped else
                       "shorter than min_chars" if len(text) < cfg.min_chars else
                       "a repeat" if normal_form(text) in seen else None)
                if why is not None:
                    counts["dropped"][why] = counts["dropped"].get(why, 0) + 1
                    continue
                seen.add(normal_form(text))
                lines.append(json.dumps({"id": f"self-{n}", "messages": [{"role": "user", "content": text}]},
                                        ensure_ascii=False) + "\n")
            counts["sampled"] += len(numbers)
            counts["kept"] += len(lines)
            state["bytes"] = append_lines(output, lines)
            state["groups_done"] = g + 1
            atomic_write_json(state_path(output), state)
    progress.close()
    state["complete"] = True
    atomic_write_json(state_path(output), state)
    summary = {"output": str(output), **counts, "tokens_this_run": tokens_now,
               "seconds_this_run": time.perf_counter() - started}
    log.info("self-prompts: %s", summary)
    return summary


def format_summary(summary: dict) -> str:
    dropped = ", ".join(f"{n} {why}" for why, n in sorted(summary["dropped"].items())) or "none"
    rate = summary["tokens_this_run"] / summary["seconds_this_run"] if summary["seconds_this_run"] else 0.0
    return (f"kept {summary['kept']:,} of {summary['sampled']:,} sampled requests (dropped: {dropped})\n"
            f"this run: {summary['tokens_this_run']:,} tokens at {rate:.0f} tok/s\n"
            f"output: {summary['output']} (a data.source for `mtptrain regenerate`)")
