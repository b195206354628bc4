"""An exponential moving average of the head's trained weights (train.ema_decay).

After every optimizer step each average moves toward its parameter: a = d a + (1 - d) p, with d ramped up from
about 0.1 as min(decay, (1 + step) / (10 + step)), so that the first steps' random weights fade out quickly (the
ramp of TensorFlow's ExponentialMovingAverage with num_updates). The averages are kept in float32 whatever the
parameters' dtype.

Training steps the live weights; what the run reads as "the head" (validation, drafting in the engine, snapshots,
the export) is the average, swapped into the module for the time it is read (`applied`) and swapped out again,
bit for bit. A checkpoint carries the averages in the trainer's client state, so a resumed run averages on as an
uninterrupted one.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from mtptrain.errors import MtptrainError


class AverageRefused(MtptrainError, ValueError):
    """A checkpoint's weight average that does not fit the head; the message names the checkpoint and the fix."""


def ramped(decay: float, step: int) -> float:
    """The decay applied after optimizer step `step` (1, 2, ...)."""
    return min(decay, (1 + step) / (10 + step))


class WeightAverage:
    def __init__(self, head: nn.Module, decay: float):
        self.decay = decay
        self.params = {name: p for name, p in head.named_parameters() if p.requires_grad}
        self.average = {name: p.detach().float().clone() for name, p in self.params.items()}

    @torch.no_grad()
    def update(self, step: int) -> None:
        names = list(self.params)
        torch._foreach_lerp_([self.average[n] for n in names], [self.params[n].detach().float() for n in names],
                             1.0 - ramped(self.decay, step))

    @contextmanager
    def applied(self):
        """The averages in the head's parameters while the block runs; the live weights back afterwards."""
        live = {name: p.detach().clone() for name, p in self.params.items()}
        try:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(self.average[name])
            yield
        finally:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(live[name])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: a.clone() for name, a in self.average.items()}

    def load_state_dict(self, state: object, where: str) -> None:
        """Averages from a checkpoint (already verified as this run's): floating-point tensors of the trained
        parameters' names and shapes, or refused naming `where`."""
        if not isinstance(state, dict) or state.keys() != self.average.keys() or any(
                not isinstance(state[n], torch.Tensor) or not state[n].is_floating_point() or state[n].shape != a.shape
                for n, a in self.average.items()):
            raise AverageRefused(f"{where} holds no weight average of this head's trained parameters, so it was not "
                                 "resumed; resume it with the recipe that wrote it, or start the run in a fresh "
                                 "train.output_dir")
        for name, a in self.average.items():
            a.copy_(state[name])
