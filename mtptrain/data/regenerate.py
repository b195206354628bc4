"""Self-distillation data: the training conversations with every answer rewritten by the target.

A draft head is scored by how often its guesses match what the target itself
would write, so it learns best from the target's own outputs rather than from
the answers of whatever model wrote the dataset (EAGLE, Medusa and HASS all
report gains from regenerated data). `mtptrain regenerate` keeps the user
turns (and any system prompt) of each conversation of `data.source` and asks
the target for every assistant turn in order, so later questions follow the
target's own earlier answers, as they will when it is served.

Output: `data.regenerated`, a JSONL file of `{"id", "messages", "meta"}`
rows, with the source's ids (so the train/validation split is the same as
for the original answers), and a state file next to it (`<output>.state.json`)
with the settings, the target's identity and how far the job got.

Decoding is batched on the target's runtime (mtptrain/runtime/batch.py), with
`regenerate.batch_size` rows that are kept busy: when an answer ends, its row
takes the conversation's next turn at once (prefilling only what the turn
adds to the cached conversation), or else the next conversation.

Resuming. Conversations are cut into groups of 8 batches in a fixed order
(source order, sorted by first prompt length inside a group). After each
group its conversations are appended in that order and fsynced, then the
state records the group count and the file's byte length
(data/resumable.py). A rerun cuts the file back to that length and goes on
with the next group, which it decodes in the same order as an uninterrupted
run would, on the kernels the run began with; sampling draws from one
seeded generator per conversation and turn (data/engines.py). A killed job
therefore finishes with the same file as an uninterrupted one. Output
written with other settings, by another target or by another version of
this stage is refused, never mixed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from mtptrain.data.chat import prompt_ids, stop_tokens, tokenize_conversation
from mtptrain.data.conversations import BadRow, normalise, unique_key
from mtptrain.data.engines import decoding, generation_stops, pick_engine, recorded_runtime, sampler, turn_seed
from mtptrain.data.kept_states import entry_fits, kept_dtype, new_entry, on_disk, states_dir, valid_entry, write_group
from mtptrain.data.readers import read_rows
from mtptrain.data.resumable import (GROUP_BATCHES, RegenerateError, append_lines, check_written, load_state,
                                     state_path, truncate_to)
from mtptrain.data.samples import NoUsableData, RowStats
from mtptrain.config import Recipe
from mtptrain.dist import DistInfo
from mtptrain.engine.verify import Sampling
from mtptrain.io import atomic_write_json, load_json
from mtptrain.runtime.batch import Request, decode_stream
from mtptrain.runtime.model import FastDecoder
from mtptrain.runtime.runner import source_record
from mtptrain.serving.vllm_engine import stream_requests
from mtptrain.target import load_identified_parts, load_target, tokenizer_fingerprint
from mtptrain.target.layers import resolve_layers

log = logging.getLogger(__name__)
HOW = ("version", "batch_size")  # settings that change how the work is cut, not what is asked of the target
STATE_VERSION = 3  # 3: rows with user turns only are answered (a self-prompts file), no longer skipped


@dataclass
class Job:
    """One conversation being regenerated."""
    id: str
    ref: str
    system: list[dict]  # a leading system message, if any
    questions: list[str]  # the user turns, in order
    messages: list[dict] = field(default_factory=list)  # regenerated so far
    stopped: str | None = None  # why no further turn is asked
    new_tokens: list[int] = field(default_factory=list)  # per answer
    finished: list[bool] = field(default_factory=list)  # per answer: ended with a stop token
    sample_ids: list[int] | None = None  # the conversation as precompute tokenizes it, once asked for its states
    states: torch.Tensor | None = None  # [len(sample_ids), layers, H], where the decoder kept them
    tops: torch.Tensor | None = None  # the target's greedy next token after each, -1 where not computed


@dataclass
class Keep:
    """What to keep while decoding (regenerate.keep_states): the states after `layers`, in `dtype`."""
    layers: tuple[int, ...]
    dtype: torch.dtype


DATA_KEYS = ("source", "format", "dataset_split", "dataset_config", "messages_column", "max_conversations",
             "max_length")


def settings_of(recipe: Recipe, engine: str = "runtime") -> dict:
    """What the output depends on, `engine` the one that decodes (regenerate.engine resolved): the engines'
    kernels break near-ties apart and draw from other streams. cpu_matmul is left out: it changes float rounding,
    not the method."""
    settings = {"version": STATE_VERSION, **{k: getattr(recipe.data, k) for k in DATA_KEYS},
                **{k: v for k, v in recipe.regenerate.model_dump(mode="json").items()
                   if k not in ("cpu_matmul", "engine", "keep_states")}, "engine": engine}
    if engine == "vllm":
        settings["vllm_dtype"] = recipe.vllm.dtype
    return settings


def read_jobs(recipe: Recipe, tokenizer, stats: RowStats) -> list[tuple[Job, int]]:
    """Usable conversations of the source with the length of their first prompt, in source order."""
    d = recipe.data
    jobs = []
    seen: Counter = Counter()  # ids in use -> repeats so far (renamed id#1, id#2 as precompute does)
    for row in read_rows(d.source, split=d.dataset_split, config=d.dataset_config, limit=d.max_conversations):
        stats.rows += 1
        if row.problem is not None:
            stats.skip(row.ref, *row.problem)
            continue
        try:
            conversation = normalise(row.value, row.ref, d.format, d.messages_column, answered=False)
        except BadRow as bad:
            stats.skip(row.ref, bad.reason, bad.detail)
            continue
        key = unique_key(conversation.id, seen)
        messages = conversation.messages
        system = [messages[0]] if messages[0]["role"] == "system" else []
        questions = [m["content"] for m in messages if m["role"] == "user"]
        if not questions:
            stats.skip(row.ref, "no user turn", "nothing to answer")
            continue
        job = Job(key, row.ref, system, questions)
        # A first prompt too long in characters to fit max_length is not tokenized whole: its length counts
        # as max_length + 1, which sorts it after every prompt that fits (all of it is skipped as over-long).
        first = prompt_ids(tokenizer, system + [{"role": "user", "content": questions[0]}], limit=d.max_length)
        jobs.append((job, len(first)))
    short = stats.ran_out(d.max_conversations, d.source)
    if short:
        log.warning("regenerate: %s", short)
    return jobs


def make_groups(jobs: list[tuple[Job, int]], batch_size: int) -> list[list[Job]]:
    """Fixed groups of GROUP_BATCHES x batch_size conversations in source order, sorted by first prompt length
    inside (rows decoding together then hold sequences of similar length, which the batch's attention reads to
    the longest of)."""
    groups = []
    size = batch_size * GROUP_BATCHES
    for start in range(0, len(jobs), size):
        chunk = sorted(jobs[start:start + size], key=lambda pair: pair[1])  # stable: ties keep source order
        groups.append([job for job, _ in chunk])
    return groups


def plan_digest(groups: list[list[Job]]) -> list[str]:
    """One digest per group of its conversations (ids and questions, in order): what a resume must find again."""
    return [hashlib.sha256(json.dumps([[j.id, j.system, j.questions] for j in group]).encode()).hexdigest()[:16]
            for group in groups]


def regenerate_jobs(source, tokenizer, group: list[Job], recipe: Recipe, stops: set[int],
                    finished: Callable[[Job], None] = lambda job: None, keep: Keep | None = None) -> int:
    """Answer every turn of a group of conversations, `regenerate.batch_size` rows at a time, on `source` (the
    target's batched decoder, or its model: runtime/batch.py's `decode_stream`; or a list of vLLM workers, each
    keeping that many rows): a conversation's next turn is asked as soon as its answer ends. `finished(job)` is
    called as each conversation ends. With `keep` (the native decoder only), a conversation's row then takes in
    the conversation as precompute tokenizes it (what its cache holds is kept, so mostly the end-of-turn tail),
    and the job gets the states of every position (`Job.states`). Returns the number of new tokens."""
    r, max_length = recipe.regenerate, recipe.data.max_length
    sampling = Sampling(r.temperature, r.top_k, r.top_p)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops, default=0)
    asking: dict[int, tuple[Job, int]] = {}  # id(request) -> its conversation and turn
    total = 0

    def ask(job: Job, turn: int) -> Request | None:
        """The request for `turn` of `job`, or None when the conversation is over (finished is then called)."""
        if job.stopped is None and turn < len(job.questions) and (r.max_turns is None or turn < r.max_turns):
            asked = job.system + job.messages + [{"role": "user", "content": job.questions[turn]}]
            prompt = prompt_ids(tokenizer, asked, limit=max_length)  # a huge question: only enough to see it is over
            room = max_length - len(prompt) - 1  # the end-of-turn token after the answer
            if room >= r.min_answer_tokens:
                seed = turn_seed(r.seed, job.id, turn)
                request = Request(prompt, min(r.max_new_tokens, room), sampler(sampling, seed), seed)
                asking[id(request)] = (job, turn)
                return request
            job.stopped = "context full"
        tail = states_request(job) if keep is not None else None
        if tail is not None:
            asking[id(tail)] = (job, None)
            return tail
        finished(job)
        return None

    def states_request(job: Job) -> Request | None:
        """A last request for the row of a finished conversation: the whole conversation as precompute's sample,
        whose every position's states the decoder hands over (one token is drawn and dropped)."""
        if not job.messages:
            return None
        unfinished = frozenset(i for i, done in enumerate(job.finished) if not done)
        try:
            sample = tokenize_conversation(tokenizer, job.system + job.messages, max_length, recipe.data.overlong,
                                           unfinished)
        except BadRow:  # precompute leaves it out too
            return None
        if len(sample.input_ids) < 2:
            return None
        job.sample_ids = [int(t) for t in sample.input_ids]
        return Request(job.sample_ids, 1, keep_states=True)

    def answered(request: Request) -> Request | None:
        nonlocal total
        job, turn = asking.pop(id(request))
        if turn is None:  # the states of the whole conversation: it is over
            if request.states is not None and request.states.shape[0] == len(job.sample_ids):
                job.states, job.tops = request.states, request.tops
            finished(job)
            return None
        total += len(request.tokens)
        text = tokenizer.decode(request.tokens, skip_special_tokens=True).strip()
        if not text:  # an empty answer cannot be a training turn; the conversation ends before it
            job.stopped = "empty answer"
        else:
            job.messages += [{"role": "user", "content": job.questions[turn]}, {"role": "assistant", "content": text}]
            job.new_tokens.append(len(request.tokens))
            job.finished.append(request.stopped)
            if not request.stopped:
                job.stopped = ("answer cut at max_new_tokens" if request.budget == r.max_new_tokens else
                               "context full")
        return ask(job, turn + 1)

    firsts = (request for request in (ask(job, 0) for job in group) if request is not None)
    if isinstance(source, list):  # vLLM's workers (mtptrain/serving/vllm_engine.py)
        stream_requests(source, firsts, answered, r.batch_size, stops, r.temperature, r.top_k, r.top_p)
    else:
        decode_stream(source, firsts, answered, r.batch_size, stops, pad_id, recipe.target.runtime,
                      *((keep.layers, keep.dtype) if keep is not None else ()))
    return total


def run_regenerate(recipe: Recipe, show_progress: bool = True) -> dict:
    if not recipe.data.regenerated:
        raise RegenerateError("data.regenerated is not set: give the output file, e.g. "
                              "--set data.regenerated=runs/NAME/regenerated.jsonl")
    if DistInfo.from_env().world_size > 1:
        raise RegenerateError("regenerate runs as one process (all ranks would append to the same file): start "
                              "it without torchrun / srun -n N")
    output = Path(recipe.data.regenerated)
    engine = pick_engine(recipe)
    if engine == "vllm":  # vLLM holds the weights: here only the parts that identify the target, off its GPUs
        target, identity = load_identified_parts(recipe.target.model_copy(update={"device": "cpu"}))
    else:
        recorded = recorded_runtime(output, recipe.target.dtype)
        target = load_target(recipe.target if recorded is None else
                             recipe.target.model_copy(update={"dtype": recorded["dtype"]}))
        identity = target.identity()
    tokenizer, model = target.tokenizer, target.model
    settings = settings_of(recipe, engine)
    state = _resume_state(output, settings, identity)
    if state["complete"] and state["settings"] != settings:
        log.info("regenerate: %s is complete (written with %s); nothing to do", output,
                 ", ".join(f"{k}={state['settings'].get(k)!r}" for k in HOW))
        return {"output": str(output), "groups": 0, **state["counts"], "read": state.get("read", {}),
                "tokens_this_run": 0, "seconds_this_run": 0.0}

    stats = RowStats()
    jobs = read_jobs(recipe, tokenizer, stats)
    if not jobs:
        raise NoUsableData(f"no usable conversation in {recipe.data.source}:\n{stats.report()}")
    groups = make_groups(jobs, recipe.regenerate.batch_size)
    digests = plan_digest(groups)
    done = state["groups_done"]
    if state.get("plan", [])[:done] != digests[:done]:
        raise RegenerateError(f"{output}: the source no longer yields the conversations of the {done} groups "
                              "already written (the file, dataset or chat template changed); write to a new "
                              "data.regenerated path")
    truncate_to(output, state["bytes"])
    if "states" in state and not valid_entry(state["states"]):
        log.warning("regenerate: %s: its record of the states kept for precompute is not one mtptrain wrote; "
                    "dropped (precompute computes those conversations)", state_path(output))
        del state["states"]
    state["plan"], state["complete"] = digests, done == len(groups)
    stops = stop_tokens(tokenizer, model) | generation_stops(recipe.target)
    counts = state["counts"]
    conversations_done = sum(len(g) for g in groups[:done])
    progress = tqdm(total=len(jobs), initial=conversations_done, desc="regenerating", unit=" conv",
                    disable=not show_progress)
    tokens_now = 0

    def finished(job: Job) -> None:
        progress.update(1)

    with decoding(recipe, engine, model, output, state.get("runtime")) as source:
        if engine == "runtime" and "runtime" not in state:
            state["runtime"] = source_record(source)
        keep = _keeping(recipe, source, target, state)
        started = time.perf_counter()  # decoding only: a vLLM engine's start is not its throughput
        for g in range(done, len(groups)):
            group = groups[g]
            tokens_now += regenerate_jobs(source, tokenizer, group, recipe, stops, finished, keep)
            if "states" in state:
                state["states"]["groups"].pop(str(g), None)
            kept = [job for job in group if job.states is not None] if keep is not None else []
            if kept:
                state["states"]["groups"][str(g)] = write_group(
                    states_dir(output), g, [job.id for job in kept],
                    [np.asarray(job.sample_ids, dtype=np.int32) for job in kept], [job.states for job in kept],
                    [job.tops for job in kept], list(keep.layers))
                for job in kept:
                    job.states = job.tops = None  # the group's file holds them now
            lines = []
            for job in group:
                if not job.messages:
                    reason = _reason(job)
                    counts["skipped"][reason] = counts["skipped"].get(reason, 0) + 1
                    continue
                counts["conversations"] += 1
                counts["answers"] += len(job.new_tokens)
                counts["answer_tokens"] += sum(job.new_tokens)
                counts["unfinished_answers"] += job.finished.count(False)
                lines.append(json.dumps({"id": job.id, "messages": job.system + job.messages,
                                         "meta": {"source": job.ref, "new_tokens": job.new_tokens,
                                                  "finished": job.finished}}, ensure_ascii=False) + "\n")
            state["bytes"] = append_lines(output, lines)
            state["groups_done"] = g + 1
            atomic_write_json(state_path(output), state)
            progress.set_postfix_str(f"{tokens_now / (time.perf_counter() - started):.0f} tok/s")
    progress.close()
    state["complete"] = True
    state["read"] = stats.to_dict()
    atomic_write_json(state_path(output), state)
    summary = {"output": str(output), "groups": len(groups), **counts, "read": stats.to_dict(),
               "tokens_this_run": tokens_now, "seconds_this_run": time.perf_counter() - started}
    kept_groups = list(state.get("states", {}).get("groups", {}).values())
    if kept_groups:
        summary["kept_states"] = on_disk(output, kept_groups)
    log.info("regenerate: %s", summary)
    return summary


def _keeping(recipe: Recipe, source, target, state: dict) -> Keep | None:
    """What to keep while decoding for `mtptrain precompute` (regenerate.keep_states), with the state's record of
    it started anew where it was kept another way (other layers, precision or runtime); None where nothing is
    kept: the setting is off, the target decodes on vLLM or transformers' forward, or training computes its
    states itself (train.online)."""
    if not recipe.regenerate.keep_states or not isinstance(source, FastDecoder) or recipe.train.online:
        return None
    layers = resolve_layers(recipe.precompute.layers, target.num_layers)
    dtype = kept_dtype(recipe.precompute.dtype)
    if not entry_fits(state.get("states"), layers, dtype, state["runtime"]):
        state["states"] = new_entry(layers, dtype, state["runtime"])
    return Keep(tuple(layers), getattr(torch, dtype))


def _reason(job: Job) -> str:
    return "prompt over-long" if job.stopped == "context full" else (job.stopped or "no answer")


def _resume_state(output: Path, settings: dict, identity: dict) -> dict:
    fresh = {"settings": settings, "target": identity, "groups_done": 0, "bytes": 0, "complete": False,
             "counts": {"conversations": 0, "answers": 0, "answer_tokens": 0, "unfinished_answers": 0,
                        "skipped": {}}}
    # the first state format counted batches, not groups: a finished file of it stands (below)
    state = load_state(output, fresh, "data.regenerated", "regenerate", optional=("groups_done",))
    if state is fresh:
        return fresh
    before = {"engine": "runtime", **state["settings"]}  # written before regenerate.engine: the runtime
    changed = [k for k in sorted(set(settings) | set(before)) if settings.get(k) != before.get(k)]
    kept = state.get("complete") and set(changed) <= set(HOW)  # finished: however its work was cut, it stands
    if changed and not kept:
        if "version" in changed and set(changed) <= set(HOW):
            raise RegenerateError(f"{output} is unfinished and was written by another version of `mtptrain "
                                  f"regenerate` (state format {before.get('version')}, this one's "
                                  f"{settings['version']}): finish it with that version, or set data.regenerated to "
                                  "a new path")
        detail = ", ".join(f"{k}: {before.get(k)!r} -> {settings.get(k)!r}" for k in changed)
        raise RegenerateError(f"{output} was written with other settings ({detail}); keep the old settings to "
                              "resume, or set data.regenerated to a new path")
    if not kept and ("groups_done" not in state or not isinstance(state.get("plan", []), list)):
        raise RegenerateError(f"{state_path(output)} is not a state mtptrain wrote; delete it and {output} to start "
                              "over")
    check_written(state, output, identity, "data.regenerated")
    return state


def check_complete(path: Path, data, tokenizer) -> None:
    """Refuse to train on a regeneration that has not finished, or that was made from other data or by
    another tokenizer than the recipe's. A file with no state (made elsewhere) is taken as it is."""
    state_file = state_path(path)
    if not path.is_file():
        raise RegenerateError(f"data.regenerated {path} does not exist: run `mtptrain regenerate` with the same "
                              "recipe first, or unset data.regenerated to use the original answers")
    if not state_file.is_file():
        return
    try:
        state = load_json(state_file.read_text())
    except (OSError, ValueError):
        state = None
    if not isinstance(state, dict) or not isinstance(state.get("settings", {}), dict) or \
            not isinstance(state.get("target", {}), dict):
        raise RegenerateError(f"{state_file} is not a state `mtptrain regenerate` wrote: rerun `mtptrain regenerate` "
                              f"to a new data.regenerated path (or delete {state_file.name} to take {path.name} as "
                              "it is)")
    if not state.get("complete"):
        raise RegenerateError(f"{path} is unfinished ({state.get('groups_done', 0)} groups of conversations so far): rerun "
                              "`mtptrain regenerate` with the same recipe to finish it")
    made = state.get("settings", {})
    changed = [k for k in DATA_KEYS if made.get(k) != getattr(data, k)]
    if changed:
        detail = ", ".join(f"data.{k}: {made.get(k)!r} there, {getattr(data, k)!r} here" for k in changed)
        raise RegenerateError(f"{path} was regenerated from other data ({detail}): rerun `mtptrain regenerate` "
                              "to a new data.regenerated path, or restore those settings")
    if state.get("target", {}).get("tokenizer_fingerprint") != tokenizer_fingerprint(tokenizer):
        raise RegenerateError(f"{path} was regenerated by another target ({state.get('target', {}).get('name')}) "
                              "with another tokenizer: regenerate with this recipe's target")


def format_summary(summary: dict) -> str:
    skipped = ", ".join(f"{n} x {why}" for why, n in summary["skipped"].items()) or "none"
    rate = summary["tokens_this_run"] / max(summary["seconds_this_run"], 1e-9)
    return (f"regenerated {summary['conversations']} conversations, {summary['answers']} answers, "
            f"{summary['answer_tokens']:,} answer tokens ({summary['unfinished_answers']} cut by a length limit)\n"
            f"skipped: {skipped}; source: {summary['read']['rows']} rows read, "
            f"{sum(summary['read']['skipped'].values())} unusable\n"
            f"this run: {summary['tokens_this_run']:,} tokens at {rate:.0f} tok/s\n"
            f"output: {summary['output']}" + kept_line(summary.get("kept_states")))


def kept_line(kept: dict | None) -> str:
    if not kept:
        return ""
    missing = kept["missing_files"]
    if not kept["conversations"]:
        return (f"\nthe states kept for `mtptrain precompute` are no longer in {kept['directory']} ({missing} "
                f"file{'s' if missing != 1 else ''} gone): a store not yet built from this output computes them")
    gone = (f"; {missing} of its files are gone, and precompute computes their conversations" if missing else "")
    return (f"\nstates kept for `mtptrain precompute`: {kept['conversations']:,} conversations, {kept['tokens']:,} "
            f"tokens, {kept['bytes'] / 2**30:.2f} GiB in {kept['directory']} (delete it once the store is complete)"
            + gone)
