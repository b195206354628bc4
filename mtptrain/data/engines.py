"""What decodes the target's answers for `mtptrain regenerate` and `mtptrain self-prompts`.

The engine (`regenerate.engine`): the runtime's batched decoder (runtime/batch.py), the target's transformers
model under the runtime's fallback, or vLLM's workers, one per data-parallel engine (serving/vllm_engine.py). A
resumed run decodes with the kernels and dtype its state recorded when it began, because they decide the
near-ties of greedy decoding. Each turn draws from a generator seeded by the run's seed, the conversation and the
turn, so a resumed or reordered run draws the same tokens; and a target whose model was not loaded whole still
stops at the end-of-turn ids of its generation_config.json.
"""

from __future__ import annotations

import hashlib
import logging
from contextlib import contextmanager
from pathlib import Path

import torch

from mtptrain.config import Recipe
from mtptrain.data.resumable import RegenerateError, state_path
from mtptrain.engine.verify import Sampling, distribution, draw
from mtptrain.io import load_json
from mtptrain.runtime.linears import fast_linears, product_for
from mtptrain.runtime.runner import invalid_record, runtime_for
from mtptrain.serving.vllm_engine import (VllmError, VllmWorker, close_all, data_parallel_devices, engine_args, on_gpu,
                                          vllm_python)
from mtptrain.target import TargetError, resolve_local_dir

log = logging.getLogger(__name__)


def pick_engine(recipe: Recipe) -> str:
    """regenerate.engine, with auto resolved: the runtime on CPU, where it decodes about twice as fast as vLLM's
    CPU build (docs/benchmarks.md); vLLM on GPUs where its environment is found (the runtime otherwise)."""
    choice = recipe.regenerate.engine
    if choice != "auto":
        return choice
    if not on_gpu():
        return "runtime"
    try:
        vllm_python(recipe.vllm.python)
    except VllmError as missing:
        log.info("regenerate.engine auto: vLLM's environment is missing (%s); decoding on the runtime",
                 str(missing).split(":")[0])
        return "runtime"
    return "vllm"


def recorded_runtime(output: Path, dtype: str, setting: str = "data.regenerated") -> dict | None:
    """The runtime an unfinished regeneration into `output` started with (its state's "runtime"), where the rest
    must decode with it too: the kernels and the dtype decide near-ties of greedy decoding, so an answer written
    after a resume (on a requeued node, or after the machine's choice was measured again) would not be the one
    an uninterrupted run writes. None for a new or a finished file, or one whose state predates the record."""
    path = state_path(output)
    try:
        state = load_json(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: _resume_state says what to do
        return None
    if not isinstance(state, dict) or state.get("complete") or "runtime" not in state:
        return None
    record = state["runtime"]
    why = invalid_record(record)
    if why is not None:
        raise RegenerateError(f"{path}: its \"runtime\" entry is not one mtptrain wrote ({why}); delete "
                              f"{path.name} and {output.name} to start over")
    if dtype not in ("auto", record["dtype"]):
        raise RegenerateError(f"{output} was begun in {record['dtype']} and this run would decode in {dtype}: one "
                              f"file is written in one precision; set target.dtype={record['dtype']} (or auto) to "
                              f"finish it, or set {setting} to a new path")
    return record


@contextmanager
def decoding(recipe: Recipe, engine: str, model, output: Path, recorded: dict | None = None):
    """What decodes, for the whole run: the runtime's batched decoder (or the model, under the transformers
    fallback), with the kernels the run `recorded` when it began where the runtime runs the model, or vLLM's
    workers, one per data-parallel engine, each logging beside the output."""
    if engine == "vllm":
        cfg = recipe.vllm
        source_dir = resolve_local_dir(recipe.target)[0]
        workers = []
        try:
            for i, devices in enumerate(data_parallel_devices(cfg)):
                workers.append(VllmWorker(cfg, output.with_name(f"{output.name}.vllm-{i}.log"), devices))
            for worker in workers:  # they load at once
                worker.open_begin(engine_args(cfg, source_dir, recipe.data.max_length,
                                              max_num_seqs=recipe.regenerate.batch_size, prefix_caching=True))
            for worker in workers:
                worker.open_end()
            yield workers
        finally:
            close_all(workers)
        return
    # The transformers fallback only (the native runtime has its own products): up to 8 rows the swap is faster on
    # CPU; wider decoding batches are compute-bound and keep torch's GEMM.
    product = product_for(recipe.regenerate.cpu_matmul, model)
    source = runtime_for(model, recipe.target.runtime, batched=True, record=recorded)
    with fast_linears(model, product=product, max_rows=8, enabled=source is model):
        yield source


def generation_stops(cfg) -> set[int]:
    """The end-of-turn ids of the target's generation_config.json, for a target whose model was not loaded whole
    (its config is then transformers' default)."""
    from transformers import GenerationConfig  # lazy: transformers takes ~1 s to import, which a resume need not pay

    directory = resolve_local_dir(cfg)[0]
    try:
        configured = GenerationConfig.from_pretrained(directory).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's EOS stands
        return set()
    except RecursionError:  # transformers reads it with json.load, which recurses
        raise TargetError(f"{Path(directory) / 'generation_config.json'} is nested past the JSON parser's depth, "
                          "which no saved model's is: download or save the model again") from None
    return set(configured if isinstance(configured, list) else [configured] if configured is not None else [])


def turn_seed(seed: int, conversation_id: str, turn: int) -> int:
    digest = hashlib.sha256(f"{seed}:{conversation_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def sampler(sampling: Sampling, seed: int):
    """A request's `pick` (runtime/batch.py): None for greedy decoding, else a draw from the distribution that
    `sampling` makes of the logits, with its own seeded CPU generator: verify.draw reads one uniform from it and
    draws on the logits' device, so a seed gives the same tokens on any device."""
    if sampling.greedy:
        return None
    generator = torch.Generator().manual_seed(seed)

    def pick(logits: torch.Tensor) -> int:
        return draw(distribution(logits, sampling), generator)
    return pick

