"""The drafter's own process, and the proposer `generate` talks to: it forwards the target's states and asks for
drafts, which the process answers from its speculation cache or drafts afresh."""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass

import torch

from mtptrain.engine.proposer import ProposerBase
from mtptrain.engine.ssd.drafters import DraftLM, HeadDraft
from mtptrain.engine.ssd.speculator import SSDSettings, SSDStats, Speculator


@dataclass
class HeadParts:
    """What a worker's `make` returns to draft with a head: the head on its device, its spec, the target's
    vocabulary size."""

    head: torch.nn.Module
    spec: object
    vocab_size: int


def _serve(conn, make, settings: SSDSettings) -> None:
    """The drafter's process: answer each request for a draft at once, then pre-draft until the next arrives."""
    torch.set_num_threads(settings.threads)
    try:
        made = make()
        if isinstance(made, HeadParts):
            drafter = HeadDraft(made.head, made.spec, settings.sampling, settings.factor, settings.seed,
                                made.vocab_size)
        else:
            drafter = DraftLM(made, settings.sampling, settings.factor, settings.seed)
    except Exception as exc:  # the main process raises it, with what the worker found
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    speculator = Speculator(drafter, settings)
    conn.send(("ready",))
    while True:
        message = conn.recv()
        kind = message[0]
        if kind == "propose":
            cont = speculator.next_draft(message[1], message[2])
            conn.send((cont.tokens, None if cont.probs is None else cont.probs.cpu()))
            # stops as soon as the next message is waiting, unless every round spends its budget
            speculator.speculate((lambda: False) if settings.complete else conn.poll)
        elif kind == "observe":  # no answer: the target's loop goes on at once
            drafter.observe(*message[1:])
        elif kind == "idle":  # the request is over: stop speculating, so no CPU is spent past it
            conn.send(("ok",))
        elif kind == "reset":
            speculator.reset(message[1])
            conn.send(("ok",))
        elif kind == "stats":
            conn.send(speculator.stats)
        elif kind == "close":
            conn.close()
            return


class SSDProposer(ProposerBase):
    """A proposer for `generate` whose drafter runs in its own process, on its own CPU threads (or device), and
    pre-drafts for the likely outcomes while the target verifies. `generate` is unchanged: it asks for a draft,
    and the answer is immediate when the outcome was guessed (draft_seconds then measures the exposed drafting).

    `make` (picklable: a module-level function or a partial of one) builds the drafter in the worker: a causal
    LM, or `HeadParts` for a head. A head reads the target's states, so give `layers` (the target layers it
    reads; the runner must capture them): the proposer then forwards each verification's states to the worker.
    """

    name = "ssd"

    def __init__(self, make, settings: SSDSettings = SSDSettings(), layers: list[int] | None = None,
                 device: str | torch.device = "cpu"):
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: its own torch threads
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, make, settings), daemon=True)
        self._process.start()
        child.close()
        try:
            answer = self._conn.recv()
        except EOFError:
            self._process.join(timeout=5)
            answer = ("error", f"the process exited with code {self._process.exitcode}")
        if answer != ("ready",):
            self._process.join(timeout=5)
            raise RuntimeError(f"the SSD drafter process could not start its drafter: {answer[1]}")
        self._device = torch.device(device)  # the target's: the draft distributions go there
        self.layers = list(layers) if layers is not None else None
        self.reads_states = layers is not None  # a head drafter reads the target's states; a draft model does not

    def reset(self, prompt: list[int]) -> None:
        self._conn.send(("reset", list(prompt)))
        self._conn.recv()

    def observe(self, true_length: int, hidden: dict[int, torch.Tensor], next_tokens: list[int]) -> None:
        states = {layer: hidden[layer].detach().to("cpu", copy=True) for layer in self.layers}
        self._conn.send(("observe", true_length, states, list(next_tokens)))

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        self._conn.send(("propose", list(tokens), k))
        draft, probs = self._conn.recv()
        return draft, None if probs is None else probs.to(self._device)

    def finish(self, tokens: list[int]) -> None:
        """The request is over (`generate` calls this): returns once the worker has stopped pre-drafting."""
        self._conn.send(("idle",))
        self._conn.recv()

    def stats(self) -> SSDStats:
        self._conn.send(("stats",))
        return self._conn.recv()

    def close(self) -> None:
        if self._process.is_alive():
            self._conn.send(("close",))
            self._process.join(timeout=30)
        self._conn.close()
