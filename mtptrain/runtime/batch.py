"""Many rows at once: the captured states of a batch (precompute) and batched decoding (regenerate).

Both run on the native decoder when the model allows it and on transformers' forward otherwise, with the
same results up to float rounding.

Decoding on the native decoder keeps every row busy: each row of the cache holds its own sequence at its
own length, and the rows step together, one token each, with the attention kernel measured for batches
(runtime/choice.py) under a mask of each row's length. A row whose answer ends takes the next request at
once, keeping the prefix the two share; the rest of the new prompt rides along with the next step (its
tokens join the step's products, and attend causally within their row, no padding computed), so a
conversation's next turn takes in only its new tokens. On transformers' forward, requests run in waves of
left-padded prompts, and a row that stops leaves its wave.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from mtptrain.runtime.attention import causal_mask, decoding_kernels
from mtptrain.runtime.cache import NoCache
from mtptrain.runtime.model import FastDecoder
from mtptrain.runtime.runner import load_decoder
from mtptrain.runtime.capture import LayerCapture


@torch.inference_mode()
def capture_states(source, ids: torch.Tensor, layers: list[int]) -> dict[int, torch.Tensor]:
    """States [B, T, H] after each decoder layer of `layers` for right-padded ids [B, T], on `source`: a batched
    decoder (`load_decoder(model, batched=True)`, built once per stage) or a model, run by transformers' forward.
    Right padding needs no mask: under the causal mask a real token never attends to the padding after it."""
    if isinstance(source, FastDecoder):
        ids = ids.to(source.device)
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        _, captured = source.forward(ids, positions, NoCache(), 0, None, tuple(layers), logits=False)
        return captured
    model = source
    ids = ids.to(model.get_input_embeddings().weight.device)
    capture = LayerCapture(model.get_decoder().layers, layers)
    try:
        model.get_decoder()(input_ids=ids, use_cache=False)  # the stack alone: no vocabulary-sized logits
        return capture.take()
    finally:
        capture.close()


@dataclass
class Request:
    """One answer to decode: at most `budget` new tokens after `prompt`, each chosen from the logits [V] by `pick`
    (None: the most likely token). Decoding fills in `tokens` (the new ids, without the stop token) and `stopped`
    (a stop token ended it, rather than the budget)."""
    prompt: list[int]
    budget: int
    pick: Callable[[torch.Tensor], int] | None = None
    seed: int | None = None  # the seed of `pick`'s stream, for an engine that draws itself (vLLM)
    tokens: list[int] = field(default_factory=list)
    stopped: bool = False
    keep_states: bool = False  # when it ends, hand over the captured states of every position its row holds
    states: torch.Tensor | None = None  # with keep_states: [positions, layers, H], one per id its row took in
    tops: torch.Tensor | None = None  # with keep_states: the target's greedy next token after each (int32), -1
    # where no logits were computed (a prompt's positions but its last)


class Captured:
    """The states a row's cache holds, position by position, at the layers a stream captures: segments of each
    step's captured tensor (views), cut back when a new request keeps only part of the row's prefix."""

    def __init__(self):
        self.segments: list[tuple[torch.Tensor, torch.Tensor]] = []  # (states [n, layers, H], tops [n])
        self.length = 0

    def cut(self, keep: int) -> None:
        while self.length > keep:
            states, tops = self.segments[-1]
            over = self.length - keep
            if over >= states.shape[0]:
                self.segments.pop()
                self.length -= states.shape[0]
            else:
                self.segments[-1] = states[: states.shape[0] - over], tops[: states.shape[0] - over]
                self.length = keep

    def add(self, states: torch.Tensor, tops: torch.Tensor) -> None:
        self.segments.append((states, tops))
        self.length += states.shape[0]

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([s for s, _ in self.segments]), torch.cat([t for _, t in self.segments])


Done = Callable[[Request], "Request | None"]  # a finished request -> the next one to decode in its place, or None


@torch.inference_mode()
def decode_stream(source, requests: Iterable[Request], done: Done, rows: int, stops: set[int], pad_id: int,
                  runtime: str = "auto", capture: tuple[int, ...] = (),
                  capture_dtype: torch.dtype = torch.bfloat16) -> None:
    """Decode every request, up to `rows` at once, on `source`: a batched decoder (`load_decoder(model,
    batched=True)`), or a model, on the batched decoder built for it where `runtime` allows. When one finishes,
    `done(request)` is called; the request it returns (a conversation's next turn) is decoded next, before the rest
    of `requests`.

    On the native decoder a finished row is refilled at once (continuous batching): the next request takes its row,
    keeps the cached prefix it shares with what the row held (a conversation's earlier turns, a system prompt) and
    takes in the rest with the next step. Rows leave the batch only when nothing is left to decode. On transformers'
    forward the requests run in waves of `rows` that each finish before the next starts.

    With `capture` (layer indices; the native decoder only), every step keeps the states after those layers, in
    `capture_dtype`, for every position each row takes in, and a request with `keep_states` gets, when it ends,
    the states of every position its row then holds (`Request.states`): its prompt and the answer's tokens but the
    last chosen one, which no step took in."""
    pending = iter(requests)
    first = list(itertools.islice(pending, rows))
    if not first:  # nothing to decode: the model is not even looked at
        return
    decoder = source if isinstance(source, FastDecoder) else load_decoder(source, runtime, batched=True)
    if capture and decoder is None:
        raise ValueError("capturing states while decoding needs the native decoder (target.runtime native)")
    with decoding_kernels(decoder.device if decoder is not None else source.device):
        if decoder is not None:
            _stream_native(decoder, first, pending, done, stops, capture, capture_dtype)
        else:
            _stream_waves(source, first, pending, done, rows, pad_id, stops)


def _stream_waves(model, first: list[Request], pending: Iterator[Request], done: Done, rows: int, pad_id: int,
                  stops: set[int]) -> None:
    """transformers' forward: waves of `rows` requests, each finished before the next starts."""
    follow: deque[Request] = deque()
    wave = first
    while wave:
        _decode_wave(_TransformersRows(model, [r.prompt for r in wave], pad_id), wave, stops)
        for request in wave:
            after = done(request)
            if after is not None:
                follow.append(after)
        wave = [follow.popleft() for _ in range(min(rows, len(follow)))]
        wave += list(itertools.islice(pending, rows - len(wave)))


def _choose(requests: list[Request], logits: torch.Tensor, best: torch.Tensor | None = None) -> list[int]:
    """Each row's next token: one argmax over the batch (`best`, where the step took it) for the greedy rows,
    `pick` for the others."""
    if best is None:
        best = logits.max(-1).indices  # the first of equal maxima, as argmax; 5x faster in bfloat16 on CPU
    best = best.tolist()
    return [best[j] if r.pick is None else r.pick(logits[j].float()) for j, r in enumerate(requests)]


def _finished(request: Request, token: int, stops: set[int]) -> bool:
    """Record the chosen token; True when the request is over (a stop token, or its budget reached)."""
    if token in stops:
        request.stopped = True
        return True
    request.tokens.append(token)
    return len(request.tokens) >= request.budget


def _decode_wave(rows: "_TransformersRows", wave: list[Request], stops: set[int]) -> None:
    logits = rows.start()
    live = list(range(len(wave)))  # live[j] = the index in the wave of batch row j
    while live:
        chosen = _choose([wave[i] for i in live], logits)
        keep = [j for j, (i, token) in enumerate(zip(live, chosen)) if not _finished(wave[i], token, stops)]
        if not keep:
            return
        if len(keep) < len(live):
            rows.select(keep)
        live = [live[j] for j in keep]
        logits = rows.step([chosen[j] for j in keep])


def _stream_native(decoder, first: list[Request], pending: Iterator[Request], done: Done, stops: set[int],
                   capture: tuple[int, ...] = (), capture_dtype: torch.dtype = torch.bfloat16) -> None:
    slots = _Slots(decoder, capture, capture_dtype)
    for request in first:
        slots.admit(None, request)
    while slots.rows:
        rows, logits = slots.step()
        for row, token in zip(rows, _choose([row.request for row in rows], logits, slots.best)):
            if not _finished(row.request, token, stops):
                row.feed = token
                continue
            if row.request.keep_states and row.captured is not None:
                row.request.states, row.request.tops = row.captured.take()
            after = done(row.request)
            if after is None:
                after = next(pending, None)
            if after is None:
                slots.remove(row)
            else:
                slots.admit(row, after)


GROW = 64  # positions a band's cache grows by
FIRST_BAND = 128  # the shortest band's length limit; each next band's is twice the one before
ROWS_GROW = 8  # rows a band's cache grows by


@dataclass(eq=False)
class _Row:
    request: Request
    held: list[int]  # the ids whose keys and values the row's cache holds
    feed: int  # the token the row takes in at the next step, and whose logits it gets
    chunk: list[int] = field(default_factory=list)  # a new prompt's tokens taken in before `feed` at the next step
    band: "_Band | None" = None
    index: int = -1  # the row's place in its band's cache
    captured: Captured | None = None  # the states of `held`, where the stream captures


class _Band:
    """The cache of the rows whose sequences fit in `limit` positions (and are longer than the band before's).

    A batch of rows of different lengths attends over a rectangle as long as its longest row, with the shorter
    rows' tails masked. Measured during regenerate on an AMD EPYC, 64 rows in one such rectangle left 54% of it
    masked; grouping rows into bands that double in length (128, 256, 512, ...) keeps each band's rectangle
    close to its rows, at the cost of a few more, smaller kernel calls per layer. A band's rows are its cache's
    first rows (a row that leaves is replaced by the band's last), so the band attends over one contiguous
    slice: the attention kernels copy a slice cut along the positions into a contiguous tensor on every call
    (measured: 623 us for the key product over such a slice, 124 us over a whole tensor), so the capacity grows
    GROW positions at a time, and positions never written hold zeros (a masked weight is 0, and 0 times
    uninitialised memory may be NaN; what a row's earlier sequence left is finite)."""

    def __init__(self, limit: int, layers: int, kv_heads: int, head_dim: int, dtype, device):
        empty = (0, kv_heads, 0, head_dim)  # [rows, Hkv, positions, D], grown by `_grow`
        self.keys = [torch.empty(empty, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.empty(empty, dtype=dtype, device=device) for _ in range(layers)]
        self.limit = limit
        self.rows: list[_Row] = []
        self.slots = self.mask = None  # set by place()

    def _grow(self, rows: int, length: int) -> None:
        """Room for `rows` rows of `length` positions: more rows by ROWS_GROW, more positions by GROW."""
        have_rows, capacity = self.keys[0].shape[0], self.keys[0].shape[2]
        more_rows = max(0, -(-(rows - have_rows) // ROWS_GROW) * ROWS_GROW)
        more = max(0, -(-(length - capacity) // GROW) * GROW)
        if not more_rows and not more:
            return
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                new = old.new_zeros((have_rows + more_rows, old.shape[1], capacity + more, old.shape[3]))
                new[:have_rows, :, :capacity] = old
                store[i] = new

    def take(self, row: _Row, keep: int, length: int) -> None:
        """Make `row` the band's last row with room for `length` positions, bringing its first `keep` cached
        positions from the band it leaves."""
        self._grow(len(self.rows) + 1, length)
        index = len(self.rows)
        if keep:
            for mine, theirs in ((self.keys, row.band.keys), (self.values, row.band.values)):
                for layer, tensor in enumerate(mine):
                    tensor[index, :, :keep] = theirs[layer][row.index, :, :keep]
        if row.band is not None:
            row.band.drop(row)
        self.rows.append(row)
        row.band, row.index = self, index

    def drop(self, row: _Row) -> None:
        """Take `row` out of the band; the band's last row moves into its place."""
        last = self.rows.pop()
        if last is not row:
            for store in (self.keys, self.values):
                for tensor in store:
                    tensor[row.index] = tensor[last.index]
            self.rows[row.index] = last
            last.index = row.index
        row.band, row.index = None, -1

    def place(self, decoder, fused: bool) -> None:
        """Before a step: room for every row's new tokens and, for torch's kernels (not `fused`), where each row
        writes its `feed` and what it sees."""
        device = decoder.device
        lengths = torch.tensor([len(row.held) + len(row.chunk) for row in self.rows], device=device)
        self._grow(len(self.rows), int(lengths.max()) + 1)
        if fused:
            return
        _, kv_heads, capacity, _ = self.keys[0].shape
        heads = torch.arange(kv_heads, device=device)
        rows = torch.arange(len(self.rows), device=device)
        self.slots = ((rows[:, None] * kv_heads + heads) * capacity + lengths[:, None]).reshape(-1)
        seen = torch.arange(capacity, device=device)[None] <= lengths[:, None]
        self.mask = decoder.batch_mask(seen[:, None, None, :])

    def write_and_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         attention) -> torch.Tensor:
        """The band's rows of one step: their new keys and values [n, Hkv, 1, D] written at each row's length
        (one index_copy_ into the flattened cache, the index computed once per step), then their attention. A
        kernel over a float32 cache gets its keys and values cast up here (index_copy_ does not cast)."""
        dim, count = k.shape[-1], len(self.rows)
        keys, values = self.keys[layer], self.values[layer]
        keys.view(-1, dim).index_copy_(0, self.slots, k.reshape(-1, dim).to(keys.dtype))
        values.view(-1, dim).index_copy_(0, self.slots, v.reshape(-1, dim).to(values.dtype))
        return attention(q, keys[:count], values[:count], self.mask, False)

    def prefill(self, layer: int, row: _Row, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kernels) -> torch.Tensor:
        """A row's chunk of new tokens [1, H, n, D]: keys and values written after what the row holds, then causal
        attention over the row, as a forward over the chunk alone would run it."""
        start, count = len(row.held), k.shape[2]
        keys, values = self.keys[layer][row.index: row.index + 1], self.values[layer][row.index: row.index + 1]
        keys[:, :, start: start + count] = k
        values[:, :, start: start + count] = v
        if start == 0:  # nothing cached before: the new keys as computed, whatever the cache's dtype
            return kernels.attention_for(count)(q, k, v, None, count > 1)
        mask = causal_mask(count, start, q.device)[None, None] if count > 1 else None
        attention = kernels.attention_for(count)
        if keys.dtype != q.dtype:  # a batch kernel's float32 cache under a row kernel of the model's dtype
            return attention(q.to(keys.dtype), keys[:, :, : start + count], values[:, :, : start + count], mask,
                             False).to(q.dtype)
        return attention(q, keys[:, :, : start + count], values[:, :, : start + count], mask, False)


class _Slots:
    """The native decoder's rows, held in bands by length (`_Band`). A row admits a request (its cache keeps
    the prefix it shares with the prompt; the rest comes in with the next step) and then takes one token per
    step with the others; the batch's order is the bands' rows in turn."""

    def __init__(self, decoder, capture: tuple[int, ...] = (), capture_dtype: torch.dtype = torch.bfloat16):
        self.decoder = decoder
        self.bands: list[_Band] = []
        self.rows: list[_Row] = []
        self.capture, self.capture_dtype = tuple(capture), capture_dtype
        self.best: torch.Tensor | None = None  # each row's most likely next token at the last step, when capturing

    def _band(self, length: int) -> _Band:
        limit = FIRST_BAND
        while limit < length:
            limit *= 2
        for band in self.bands:
            if band.limit == limit:
                return band
        d = self.decoder
        band = _Band(limit, d.num_layers, d.kv_heads, d.head_dim, d.batch_cache_dtype, d.device)
        self.bands = sorted([*self.bands, band], key=lambda b: b.limit)
        return band

    def remove(self, row: _Row) -> None:
        row.band.drop(row)
        self.rows.remove(row)

    def _fit(self, row: _Row, length: int, keep: int) -> None:
        """Put `row` in the band for `length` positions, with its first `keep` cached positions."""
        band = self._band(length)
        if band is not row.band:
            band.take(row, keep, length)
        else:
            band._grow(len(band.rows), length)

    def admit(self, row: _Row | None, request: Request) -> None:
        """Give `row` (None: a new row) a new request. Its cache keeps the prefix it shares with the prompt; the
        rest of the prompt is taken in at the next step, with the other rows' tokens."""
        if row is None:
            row = _Row(request, [], request.prompt[-1], captured=Captured() if self.capture else None)
            self.rows.append(row)
        body = request.prompt[:-1]
        keep = 0
        for a, b in zip(row.held, body):
            if a != b:
                break
            keep += 1
        self._fit(row, len(body) + 1, keep)
        row.request, row.held, row.chunk, row.feed = request, body[:keep], body[keep:], request.prompt[-1]
        if row.captured is not None:
            row.captured.cut(keep)

    def step(self) -> tuple[list[_Row], torch.Tensor]:
        """Every row takes in its token (after the rest of its prompt, for a row just given a request): the rows
        in batch order, and the logits [B, V] after each one's token."""
        for row in self.rows:
            if len(row.held) + len(row.chunk) + 1 > row.band.limit:
                self._fit(row, len(row.held) + len(row.chunk) + 1, len(row.held))
        bands = [band for band in self.bands if band.rows]
        fused = self.decoder.step_kernel
        for band in bands:
            band.place(self.decoder, fused is not None)
        order = [row for band in bands for row in band.rows]
        chunked = [row for row in order if row.chunk]
        ids = [row.feed for row in order] + [t for row in chunked for t in row.chunk]
        positions = [len(row.held) + len(row.chunk) for row in order]
        positions += [p for row in chunked for p in range(len(row.held), len(row.held) + len(row.chunk))]
        device = self.decoder.device
        step = _Step(bands, chunked, fused)
        logits, captured = self.decoder.forward(torch.tensor([ids], device=device),
                                                torch.tensor([positions], device=device), step, 0, None,
                                                self.capture, logits_for=len(order))
        if self.capture:
            self.best = logits[0].max(-1).indices
            self._keep(order, chunked, captured, self.best)
        for row in order:
            row.held += row.chunk + [row.feed]
            row.chunk = []
        return order, logits[0]

    def _keep(self, order: list[_Row], chunked: list[_Row], captured: dict[int, torch.Tensor],
              best: torch.Tensor) -> None:
        """Each row's states of this step, in the order of its positions: its chunk's, then its feed's (the step's
        tokens are every row's feed, then the chunks in turn), with the most likely next token after each feed
        (-1 after a chunk's tokens, whose logits no step computes)."""
        states = torch.stack([captured[layer][0] for layer in self.capture], dim=1).to("cpu", self.capture_dtype)
        tops = torch.full((states.shape[0],), -1, dtype=torch.int32)
        tops[: len(order)] = best.to("cpu", torch.int32)
        chunks = len(order)
        starts = {}
        for row in chunked:
            starts[id(row)] = chunks
            chunks += len(row.chunk)
        for j, row in enumerate(order):
            if row.chunk:
                start = starts[id(row)]
                row.captured.add(states[start: start + len(row.chunk)], tops[start: start + len(row.chunk)])
            row.captured.add(states[j: j + 1], tops[j: j + 1])


class _Step:
    """The cache (runtime/cache.py's `Attends`) the decoder's layers see in one batched step, whose tokens come as one
    sequence: first one token of every row (the bands' rows in turn), then the prompt chunks of rows just given a
    request. The chunks are written and attended first, row by row (causal, as a forward over the chunk alone), then
    each band writes and attends its rows' tokens together. The products of every layer thus run over all the step's
    tokens at once: a prompt's prefill costs what its tokens add to a wide product, rather than a forward of its own
    (measured on an AMD EPYC: a 40-token prefill after 300 cached positions ran at 1,043 tok/s by itself).

    With the fused step kernel (`fused`, runtime/native_kernels.py) each band's tokens, its rows' tokens and its
    chunks' alike, are written and attended by one call per layer, into one output for the whole step."""

    def __init__(self, bands: list[_Band], chunked: list[_Row], fused=None):
        self.bands, self.chunked, self.fused = bands, chunked, fused
        self.bounds = list(itertools.accumulate([0] + [len(band.rows) for band in bands]))
        self.longest = max(len(row.held) + len(row.chunk) + 1 for band in bands for row in band.rows)
        if fused is not None:
            self.plans = self._plans()

    def _plans(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Each band's entries for the step kernel: (tokens, rows, positions), int64 tensors."""
        entries = {id(band): [] for band in self.bands}
        for band, first in zip(self.bands, self.bounds):
            entries[id(band)] += [(first + i, i, len(row.held) + len(row.chunk)) for i, row in enumerate(band.rows)]
        token = self.bounds[-1]
        for row in self.chunked:
            held = len(row.held)
            entries[id(row.band)] += [(token + j, row.index, held + j) for j in range(len(row.chunk))]
            token += len(row.chunk)
        plans = []
        for band in self.bands:
            columns = torch.tensor(entries[id(band)], dtype=torch.int64).T.contiguous()
            plans.append((columns[0], columns[1], columns[2]))
        return plans

    masks_itself = True

    def end(self, start: int, count: int) -> int:
        return self.longest

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernels, start=0, mask=None,
               causal=False, attention=None) -> torch.Tensor:
        """q [1, H, N, D], k and v [1, Hkv, N, D] of the step's N tokens -> the attention's output [1, H, N, D]
        (each row's part written and attended with the row's own mask: the decoder's are not used)."""
        if self.fused is not None:
            q3, k3, v3 = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)  # [N, heads, D] views
            out = torch.empty(q3.shape, dtype=q3.dtype, device=q3.device)
            for band, (tokens, rows, positions) in zip(self.bands, self.plans):
                self.fused(q3, k3, v3, band.keys[layer], band.values[layer], tokens, rows, positions, out)
            return out.transpose(0, 1)[None]
        rows = self.bounds[-1]
        parts = []
        start = rows
        for row in self.chunked:
            end = start + len(row.chunk)
            parts.append(row.band.prefill(layer, row, q[:, :, start:end], k[:, :, start:end], v[:, :, start:end],
                                          kernels)[0])
            start = end

        def one_each(x: torch.Tensor) -> torch.Tensor:  # [1, h, N, D] -> [rows, h, 1, D]: each row's token
            return x[0, :, :rows].transpose(0, 1).unsqueeze(2)

        q1, k1, v1 = one_each(q), one_each(k), one_each(v)
        attention = kernels.attention_for(1, batched=True)
        tokens = [band.write_and_attend(layer, q1[a:b], k1[a:b], v1[a:b], attention)
                  for band, a, b in zip(self.bands, self.bounds, self.bounds[1:])]
        tokens = tokens[0] if len(tokens) == 1 else torch.cat(tokens)
        return torch.cat([tokens.squeeze(2).transpose(0, 1), *parts], dim=1)[None]


def _left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    seen = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        seen[i, width - len(p):] = True
    return ids, seen


class _TransformersRows:
    def __init__(self, model, prompts: list[list[int]], pad_id: int):
        from transformers import DynamicCache  # lazy: transformers loads only where the fallback runs

        self.model = model
        device = model.get_input_embeddings().weight.device
        ids, seen = _left_padded(prompts, pad_id)
        self.ids, self.mask = ids.to(device), seen.long().to(device)
        self.cache = DynamicCache()

    def start(self) -> torch.Tensor:
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=self.ids, attention_mask=self.mask, position_ids=positions,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.next = positions[:, -1] + 1
        return out.logits[:, -1].float()

    def select(self, keep: list[int]) -> None:
        index = torch.tensor(keep, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask, self.next = self.mask[index], self.next[index]

    def step(self, tokens: list[int]) -> torch.Tensor:
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        out = self.model(input_ids=torch.tensor(tokens, device=self.mask.device)[:, None], attention_mask=self.mask,
                         position_ids=self.next[:, None], past_key_values=self.cache, use_cache=True)
        self.next = self.next + 1
        return out.logits[:, -1].float()
