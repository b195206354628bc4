"""A micro-batch of training reads nothing back from the device, whatever its draft positions and loss chunks:
the loss and metrics stay tensors there, added up over the log window and read once per log (`Window.reduce`),
and the non-finite check is a flag there, read once per optimizer step with the STOP flag. The head runs on the
meta device, where every read of a value on the host raises (a meta tensor holds none); the loss mask stays on
the host, where the positions that count are picked."""

import pytest
import torch
from conftest import make_tiny_llama

from mtptrain.heads import FrozenTarget
from mtptrain.heads.spec import HeadSpec
from mtptrain.train import scoring

SPECS = [HeadSpec("eagle", last_layer=3), HeadSpec("mtp", last_layer=3, mtp_depths=3),
         HeadSpec("eagle3", last_layer=3, feature_layers=[0, 1, 2], ttt_steps=3, draft_vocab_size=50)]


def _batch(batch_size=2, length=12, hidden=64) -> dict:
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(batch_size, length, generator=g) < 0.7).long()
    return {"input_ids": torch.randint(1, 400, (batch_size, length), generator=g), "loss_mask": mask,
            "lengths": torch.full((batch_size,), length),
            "hidden": {layer: torch.randn(batch_size, length, hidden, generator=g) for layer in range(4)}}


@pytest.mark.parametrize("spec", SPECS, ids=[s.kind for s in SPECS])
def test_micro_batches_read_nothing_back_from_the_device(spec):
    torch.manual_seed(0)
    target = make_tiny_llama(400)
    head = spec.family.build(spec, FrozenTarget.of(target))
    target.to("meta"), head.to("meta")
    device = torch.device("meta")
    results = []
    for _ in range(3):
        batch = scoring.to_device(_batch(), device, torch.float32)
        # chunks of 4 positions: several per draft position
        results.append(spec.family.objective(head, batch, spec, [1.0] * spec.draft_positions, 0.1, 4))
        results[-1].loss.backward()
    assert batch["loss_mask"].device.type == "cpu" and batch["input_ids"].device == device
    window, unhealthy = scoring.Window(spec.draft_positions, device), torch.zeros((), device=device)
    for result in results:  # the training loop's bookkeeping of each micro-batch
        unhealthy += scoring.nonfinite(result.loss)
        window.add(result)
    assert window.sums.device == device and unhealthy.device == device
    assert all(stats.count > 4 for stats in result.positions)  # the counts, from the host's mask
    assert window.counts[-1] == 3 and window.counts[:-1] == [3 * stats.count for stats in result.positions]


def test_the_window_reads_its_sums_once_and_averages_them():
    spec = SPECS[1]
    torch.manual_seed(0)
    head = spec.family.build(spec, FrozenTarget.of(make_tiny_llama(400)))
    window, results = scoring.Window(spec.draft_positions), []
    for _ in range(2):
        results.append(spec.family.objective(head, _batch(), spec, [1.0, 0.5, 0.25], 0.1, 4))
        window.add(results[-1])
    logged = window.reduce(None)
    assert logged["train/loss"] == pytest.approx(sum(float(r.loss.detach()) for r in results) / 2)
    for p in range(spec.draft_positions):
        stats = [r.positions[p] for r in results]
        count = sum(s.count for s in stats)
        assert logged[f"train/acc_{p + 1}"] == pytest.approx(sum(int(s.correct) for s in stats) / count)
        assert logged[f"train/kl_{p + 1}"] == pytest.approx(sum(float(s.kl) * s.count for s in stats) / count)
        assert logged[f"train/alpha_{p + 1}"] == pytest.approx(sum(float(s.alpha) * s.count for s in stats) / count)
    assert window.reduce(None)["train/loss"] == 0.0  # emptied by the read


def test_a_stores_batches_come_pinned_for_training_on_cuda(tiny_store):
    """Page-locked batches let their non-blocking copies to the GPU overlap the step before; online features are
    computed on the GPU and are not pinned."""
    from mtptrain.features.store import FeatureStore
    from mtptrain.train.data import loader

    store = FeatureStore(tiny_store, "train")
    assert loader(store, [[0, 1]], 0, pin=True).pin_memory
    assert not loader(store, [[0, 1]], 0).pin_memory
