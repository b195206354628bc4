"""The target with its KV cache, as the engine drives it: forward over new tokens, roll back to a prefix,
keep a tree's accepted path, and the states of chosen layers for drafters that read them.

`load_decoder(model)` reads a model into the runtime's decoder (`runtime/model.py`) when its architecture is
one the runtime runs; `open_runner(decoder or model, capture)` runs it, or transformers' own forward where the
runtime does not run the model (logged once, with the reason).
Both runners follow the same interface and capture the same states: the output of decoder layer i (0-based),
the last one before the final norm, as the feature store holds them.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import nn

from mtptrain.runtime import prefetch
from mtptrain.runtime.cache import KVCache
from mtptrain.runtime.choice import Choice, choose
from mtptrain.runtime.model import FastDecoder, unsupported
from mtptrain.runtime.products import usable_product
from mtptrain.runtime.transformers_runner import TransformersRunner

log = logging.getLogger(__name__)

INITIAL_CAPACITY = 1024
_REPORTED: set[str] = set()  # what was logged of which forward runs a target: each line once per process


class Runner(Protocol):
    """What the engine asks of the target: `FastRunner` and `TransformersRunner` both follow it."""

    hidden: dict[int, torch.Tensor]  # layer -> [n, H]: captured states of the latest forward's tokens
    tokens: list[int]  # the tokens whose keys and values the cache holds, in their positions' order

    @property
    def device(self) -> torch.device: ...

    @property
    def length(self) -> int: ...

    def reset(self) -> None: ...

    def forward(self, ids: list[int], last_only: bool = False) -> torch.Tensor: ...

    def forward_tree(self, pending: int, tree) -> torch.Tensor: ...

    def keep(self, length: int, rows: list[int]) -> None: ...

    def rollback(self, length: int) -> None: ...

    def close(self) -> None: ...


def decoder_choice(model: nn.Module) -> Choice:
    """The measured kernels `model` runs with in its own dtype: the machine's pick where the model is in the
    dtype the machine chose (reported as measured), each kernel replaced by what runs where it does not build
    here (`Choice.runnable`)."""
    weight = model.get_input_embeddings().weight
    choice = choose(model.config, weight.device)
    if choice.dtype != weight.dtype:
        choice = choose(model.config, weight.device, str(weight.dtype).removeprefix("torch."))
    return choice


def load_decoder(model: nn.Module, runtime: str = "auto", batched: bool = False,
                 record: dict | None = None) -> FastDecoder | None:
    """The runtime's decoder of `model` (its weights read into the runtime's own, runtime/weights.py), for
    target.runtime auto or native; None for transformers, or for auto on a model the runtime does not run (the
    reason logged once). `batched`: the decoder of many rows at once (regenerate, precompute), whose products are
    the measured batch product. `record`: the kernels an earlier run recorded (`Choice.record`, validated by the
    caller), run again instead of this machine's pick, in the model's dtype, which must be the record's. Each call
    reads the weights again: build one per stage and pass it on."""
    if runtime not in ("auto", "native", "transformers"):
        raise ValueError(f"target.runtime must be auto, native or transformers, not {runtime!r}")
    if runtime == "transformers":
        return None
    why = unsupported(model)
    if why is not None:
        if runtime == "native":
            raise ValueError(f"target.runtime=native cannot run this model ({why}): "
                             "set target.runtime=auto or transformers")
        _report(f"target runs on transformers' forward: {why}")
        return None
    if record is None:
        choice = decoder_choice(model)
    else:
        choice = Choice.from_record(record)
        if choice.dtype != model.get_input_embeddings().weight.dtype:
            raise ValueError(f"the recorded kernels compute in {record['dtype']}, the model is in "
                             f"{model.get_input_embeddings().weight.dtype}: load it in the recorded dtype")
    product = usable_product(choice.product_batch if batched else choice.product, choice.dtype)
    decoder = FastDecoder(model, choice, product)
    if prefetch.applies(decoder):  # batches (passes of up to 12 rows) keep the kernel's default, not timed here
        decoder.prefetch_from = prefetch.DEFAULT_FROM if batched else prefetch.prefetch_from(decoder)
    _report(f"target runs on mtptrain's runtime: {decoder.describe()}")
    return decoder


def measure_prefetch(model: nn.Module) -> tuple[int, str]:
    """Time the products' prefetch on `model`'s own forwards again (`mtptrain measure`), within
    prefetch.MEASURE_BUDGET_S: the rows it chose and how (runtime/prefetch.py's `measure`)."""
    why = unsupported(model)
    if why is not None:
        return prefetch.DEFAULT_FROM, f"not measured: the model runs on transformers' forward ({why})"
    choice = decoder_choice(model)
    return prefetch.measure(FastDecoder(model, choice, usable_product(choice.product, choice.dtype)))


def _report(line: str) -> None:
    if line not in _REPORTED:
        _REPORTED.add(line)
        log.info(line)


def runtime_for(model: nn.Module, runtime: str = "auto", batched: bool = False,
                record: dict | None = None) -> FastDecoder | nn.Module:
    """What runs `model` in a stage: its runtime decoder (built now) or, where transformers' forward runs it,
    the model itself; the functions that take a runner's source (`open_runner`, runtime/batch.py) take either.
    `record`: what an earlier run of the stage recorded (`source_record`, checked by `invalid_record`); a
    native one's kernels are run again instead of this machine's pick."""
    kernels = {k: v for k, v in record.items() if k != "runtime"} if record and record["runtime"] == "native" \
        else None
    return load_decoder(model, runtime, batched, kernels) or model


def source_record(source: FastDecoder | nn.Module) -> dict:
    """`runtime_record`'s form for a source `runtime_for` built: what a stage recorded computing with it."""
    if isinstance(source, FastDecoder):
        return {"runtime": "native", **source.choice.record()}
    return {"runtime": "transformers", "dtype": str(source.get_input_embeddings().weight.dtype).removeprefix("torch."),
            "attention": source.config._attn_implementation}


def invalid_record(record: object) -> str | None:
    """Why `record` (`runtime_record`'s form, read back from a file) cannot be computed with again, or None."""
    if not isinstance(record, dict):
        return "not an object"
    if record.get("runtime") == "transformers":
        if record.get("dtype") in ("float32", "bfloat16", "float16") and set(record) <= {"runtime", "dtype",
                                                                                        "attention"}:
            return None
        return "a transformers record holds a dtype and an attention"
    if record.get("runtime") != "native":
        return f"runtime {record.get('runtime')!r} is neither native nor transformers"
    try:
        Choice.from_record({k: v for k, v in record.items() if k != "runtime"})
    except ValueError as exc:
        return str(exc)
    return None


def open_runner(source: FastDecoder | nn.Module, capture=(), runtime: str = "auto") -> "Runner":
    """A runner for the engine: on a decoder (`load_decoder`, shared by the runners of one stage), or on a model,
    the runtime's decoder built for it where target.runtime allows, else transformers' forward."""
    if not isinstance(source, FastDecoder):
        source = runtime_for(source, runtime)
    return FastRunner(source, capture) if isinstance(source, FastDecoder) else TransformersRunner(source, capture)


def runtime_record(model: nn.Module, runtime: str = "auto") -> dict:
    """What runs `model` (as `load_decoder` picks it), as a store, a checkpoint or a head records it: the
    runtime's dtype and kernels, or transformers' forward and its attention."""
    why = unsupported(model)
    if runtime not in ("auto", "native", "transformers") or (runtime == "native" and why is not None):
        load_decoder(model, runtime)  # refuses, naming why
    if runtime == "transformers" or why is not None:
        return source_record(model)
    return {"runtime": "native", **decoder_choice(model).record()}


def runtime_description(runner) -> str:
    """One line for reports: which forward runs the target, its dtype and products."""
    if runner.runtime == "native":
        return "mtptrain runtime, " + runner.decoder.describe()
    return f"transformers {runner.attention} forward, {str(runner.dtype).removeprefix('torch.')}"


class FastRunner:
    """Batch 1, as the engine decodes; `runtime/batch.py` runs many rows at once."""

    runtime = "native"

    def __init__(self, decoder: FastDecoder, capture=()):
        self.decoder = decoder
        self.capture = tuple(capture)
        self.hidden: dict[int, torch.Tensor] = {}  # layer -> [n, H] for the tokens of the latest forward
        self.cache: KVCache | None = None
        self.tokens: list[int] = []  # what the cache holds (a later request may start from a shared prefix)

    @property
    def device(self) -> torch.device:
        return self.decoder.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.dtype

    @property
    def length(self) -> int:
        """Tokens whose keys and values are in the cache."""
        return 0 if self.cache is None else self.cache.length

    def close(self) -> None:
        self.hidden = {}

    def reset(self) -> None:
        """A new generation: the cache emptied (its tensors kept)."""
        if self.cache is None:
            d = self.decoder
            self.cache = KVCache(d.num_layers, 1, d.kv_heads, d.head_dim, INITIAL_CAPACITY, d.cache_dtype, d.device)
        self.cache.length = 0  # the tensors stay: the next generation writes over them
        self.tokens = []

    @torch.inference_mode()
    def forward(self, ids: list[int], last_only: bool = False) -> torch.Tensor:
        """Logits [n, V] for the next token after each of `ids` (only the last with `last_only`), appended after
        the cached prefix."""
        if self.cache is None:
            self.reset()
        start = self.cache.length
        positions = torch.arange(start, start + len(ids), device=self.device)[None]
        logits = self._run(torch.tensor([ids], device=self.device), positions, None, last_only)
        self.tokens[start:] = ids
        return logits

    @torch.inference_mode()
    def forward_tree(self, pending: int, tree) -> torch.Tensor:
        """Logits [N+1, V] for [pending, tree nodes] under the tree mask (see engine/tree.py)."""
        start = self.cache.length
        seen = tree.visibility().to(self.device)
        mask = torch.cat([torch.ones(len(seen), start, dtype=torch.bool, device=self.device), seen], dim=1)
        positions = torch.tensor([[start] + [start + d for d in tree.depths()]], device=self.device)
        ids = torch.tensor([[pending] + tree.tokens], device=self.device)
        logits = self._run(ids, positions, mask[None, None], False)
        self.tokens[start:] = [pending] + tree.tokens
        return logits

    def _run(self, ids, positions, mask, last_only) -> torch.Tensor:
        start = self.cache.length
        self.cache.reserve(start + ids.shape[1])
        logits, captured = self.decoder.forward(ids, positions, self.cache, start, mask, self.capture, last_only)
        self.cache.length = start + ids.shape[1]
        self.hidden = {layer: states[0] for layer, states in captured.items()}
        return logits[0]

    @torch.inference_mode()
    def keep(self, length: int, rows: list[int]) -> None:
        """Keep the first `length` cached tokens and, after them, the entries at length + r for r in rows
        (the accepted path of a verified tree), in that order."""
        self.cache.keep(length, rows)
        self.tokens[length:] = [self.tokens[length + r] for r in rows]

    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values of the positions held [1, Hkv, length, D] (views)."""
        n = self.length
        return [(k[:, :, :n], v[:, :, :n]) for k, v in zip(self.cache.keys, self.cache.values)]

    def rollback(self, length: int) -> None:
        """Keep the first `length` cached tokens: the accepted prefix after a verification."""
        self.cache.length = min(length, self.cache.length)
        del self.tokens[self.cache.length:]
