"""Which of the target's layers the stages capture: precompute's store, online training and the states
regenerate keeps for precompute all read `precompute.layers` through this one rule."""

from __future__ import annotations

from mtptrain.config import RecipeError


def resolve_layers(spec: list[int] | str, num_layers: int) -> list[int]:
    """Captured layers, 0-based "output of decoder layer i"; the last layer is always among them.

    The "eagle3" default takes low / middle / high features at outputs of layers
    1, L/2 - 1 and L - 4, i.e. the inputs of layers 2, L/2 and L - 3 that the
    EAGLE-3 reference implementation and SGLang capture (arXiv:2503.01840).
    """
    if spec == "eagle3":
        inner = [1, num_layers // 2 - 1, num_layers - 4]
    elif spec == "last":
        inner = []
    else:
        inner = list(spec)
        too_deep = [i for i in inner if i >= num_layers]
        if too_deep:
            raise RecipeError(f"precompute.layers {too_deep} do not exist: the target has {num_layers} decoder "
                             f"layers, numbered 0..{num_layers - 1}")
    return sorted(set(i for i in inner if i >= 0) | {num_layers - 1})
