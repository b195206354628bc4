"""The target with its KV cache, as the engine drives it: forward over new tokens, roll back to a prefix,
keep a tree's accepted path, and the states of chosen layers for drafters that read them.

`open_runner(model, capture)` gives the fast decoder (`runtime/model.py`) when the model's architecture is
one it runs, and transformers' own forward otherwise; it logs once per model which path runs and why.
Both runners follow the same interface and capture the same states: the output of decoder layer i (0-based),
the last one before the final norm, as the feature store holds them.
"""

from __future__ import annotations

import logging
import weakref
from typing import Protocol

import torch

from mtptrain.runtime.cache import KVCache
from mtptrain.runtime.attention import batch_attention, row_attention
from mtptrain.runtime.choice import PRODUCT, choose, usable_product
from mtptrain.runtime.model import FastDecoder, unsupported
from mtptrain.runtime.weights import layout_of
from mtptrain.runtime.transformers_runner import TransformersRunner

log = logging.getLogger(__name__)

# model -> {batched: its decoder, or why it has none}
_DECODERS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[bool, FastDecoder | str]]" = weakref.WeakKeyDictionary()
INITIAL_CAPACITY = 1024


class Runner(Protocol):
    """What the engine asks of the target: `FastRunner` and `TransformersRunner` both follow it."""

    hidden: dict[int, torch.Tensor]  # layer -> [n, H]: captured states of the latest forward's tokens

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


def fast_decoder(model: torch.nn.Module, batched: bool = False) -> FastDecoder | None:
    """The model's fast decoder, built once (its weights fused in place); None when the model needs
    transformers, logged the first time. `batched`: the decoder of many rows at once (regenerate, precompute),
    whose products are the measured batch product. The model holds one layout of its weights, so a batched and
    a batch-1 decoder whose products want different layouts take turns: each lays the weights out again when it
    next runs after the other (a fraction of a second for a small model)."""
    decoders = _DECODERS.get(model)
    first = decoders is None
    if first:
        decoders = _DECODERS[model] = {}
    known = decoders.get(batched)
    if isinstance(known, FastDecoder) and not known.current():  # the model was cast, moved or restored since
        known = None
    if known is None:
        why = unsupported(model)
        if why is None:
            device = model.get_input_embeddings().weight.device
            dtype = model.get_input_embeddings().weight.dtype
            choice = choose(model.config, device)  # the machine's own pick: reported as measured when it is this
            if choice.dtype != dtype:
                choice = choose(model.config, device, str(dtype).removeprefix("torch."))
            known = build_decoder(model, choice,
                                  usable_product(choice.product_batch if batched else choice.product, dtype))
            if first:
                log.info("target runs on mtptrain's runtime: %s", choice.describe())
        else:
            known = why
            if first:
                log.info("target runs on transformers' forward: %s", why)
        decoders[batched] = known
    return known if isinstance(known, FastDecoder) else None


def build_decoder(model: torch.nn.Module, choice, product: str) -> FastDecoder:
    """A fast decoder of `model` on `product` (a key of PRODUCT, its weights laid out for it) and the attention
    kernels of `choice`. Fused and laid-out weights replace the model's own: built outside inference mode, so that
    the model stays usable where autograd runs later (inference tensors cannot enter a recorded graph)."""
    with torch.inference_mode(False), torch.no_grad():
        return FastDecoder(model, PRODUCT[product], row_attention(choice.attention_one),
                           row_attention(choice.attention_many), choice, batch_attention(choice.attention_batch),
                           layout=layout_of(product))


def native_decoder(model: torch.nn.Module, runtime: str = "auto", batched: bool = False) -> FastDecoder | None:
    """The fast decoder for target.runtime auto or native (None for auto on a model it does not run), or None for
    transformers; `batched` as for `fast_decoder`."""
    if runtime not in ("auto", "native", "transformers"):
        raise ValueError(f"target.runtime must be auto, native or transformers, not {runtime!r}")
    decoder = fast_decoder(model, batched) if runtime != "transformers" else None
    if decoder is None and runtime == "native":
        raise ValueError(f"target.runtime=native cannot run this model ({unsupported(model)}): "
                         "set target.runtime=auto or transformers")
    return decoder


def open_runner(model: torch.nn.Module, capture=(), runtime: str = "auto"):
    """A runner for the engine: the fast decoder where target.runtime allows it, else transformers."""
    decoder = native_decoder(model, runtime)
    return TransformersRunner(model, capture) if decoder is None else FastRunner(decoder, capture)


def runtime_record(model: torch.nn.Module, runtime: str = "auto", batched: bool = False) -> dict:
    """What runs `model` (as `native_decoder` picks it), as a store, a checkpoint or a head records it: the
    runtime's dtype and kernels, or transformers' forward and its attention."""
    decoder = native_decoder(model, runtime, batched)
    if decoder is None:
        dtype = str(model.get_input_embeddings().weight.dtype).removeprefix("torch.")
        return {"runtime": "transformers", "dtype": dtype, "attention": model.config._attn_implementation}
    return {"runtime": "native", **decoder.choice.record()}


def runtime_description(runner) -> str:
    """One line for reports: which forward runs the target, its dtype and products."""
    if runner.runtime == "native":
        return "mtptrain runtime, " + runner.decoder.choice.describe()
    return f"transformers {runner.attention} forward, {str(runner.dtype).removeprefix('torch.')}"


class FastRunner:
    """Batch 1, as the engine decodes; `runtime/batch.py` runs many rows at once."""

    runtime = "native"

    def __init__(self, decoder: FastDecoder, capture=()):
        self.decoder = decoder
        self.model = decoder.model
        self.capture = tuple(capture)
        self.hidden: dict[int, torch.Tensor] = {}  # layer -> [n, H] for the tokens of the latest forward
        self.cache: KVCache | None = None

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
        """A new generation: the cache emptied (its tensors kept), the decoder rebuilt if the model's weights
        changed since (a cast, or transformers' forward restoring packed layers)."""
        if not self.decoder.current():
            self.decoder = fast_decoder(self.model)
            self.cache = None
        if self.cache is None:
            d = self.decoder
            self.cache = KVCache(d.num_layers, 1, d.kv_heads, d.head_dim, INITIAL_CAPACITY, d.cache_dtype, d.device)
        self.cache.length = 0  # the tensors stay: the next generation writes over them

    @torch.inference_mode()
    def forward(self, ids: list[int], last_only: bool = False) -> torch.Tensor:
        """Logits [n, V] for the next token after each of `ids` (only the last with `last_only`), appended after
        the cached prefix."""
        if self.cache is None:
            self.reset()
        start = self.cache.length
        positions = torch.arange(start, start + len(ids), device=self.device)[None]
        return self._run(torch.tensor([ids], device=self.device), positions, None, last_only)

    @torch.inference_mode()
    def forward_tree(self, pending: int, tree) -> torch.Tensor:
        """Logits [N+1, V] for [pending, tree nodes] under the tree mask (see engine/tree.py)."""
        start = self.cache.length
        seen = tree.visibility().to(self.device)
        mask = torch.cat([torch.ones(len(seen), start, dtype=torch.bool, device=self.device), seen], dim=1)
        positions = torch.tensor([[start] + [start + d for d in tree.depths()]], device=self.device)
        ids = torch.tensor([[pending] + tree.tokens], device=self.device)
        return self._run(ids, positions, mask[None, None], False)

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

    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values of the positions held [1, Hkv, length, D] (views)."""
        n = self.length
        return [(k[:, :, :n], v[:, :, :n]) for k, v in zip(self.cache.keys, self.cache.values)]

    def rollback(self, length: int) -> None:
        """Keep the first `length` cached tokens: the accepted prefix after a verification."""
        self.cache.length = min(length, self.cache.length)
