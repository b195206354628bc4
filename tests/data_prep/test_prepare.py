import json

import pytest
from conftest import make_tokenizer, write_sharegpt

from data_prep.prepare import NoUsableData, prepare_samples, split_of
from mtptrain.config import DataConfig

BAD_ROWS = [
    {"id": "robot", "conversations": [{"from": "robot", "value": "q"}, {"from": "gpt", "value": "a"}]},
    {"id": "empty", "conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "a"}]},
    {"id": "num", "conversations": [{"from": "human", "value": 7}, {"from": "gpt", "value": "a"}]},
    {"id": "long", "conversations": [{"from": "human", "value": "word " * 400}, {"from": "gpt", "value": "a"}]},
    "just a string",
]


def test_bad_rows_are_counted_by_reason_with_examples(tmp_path):
    path = write_sharegpt(tmp_path / "chats.json", 12, extra_rows=BAD_ROWS)
    samples, stats = prepare_samples(DataConfig(source=str(path), max_length=128), make_tokenizer(), show_progress=False)
    assert len(samples) == stats.kept == 12
    assert stats.rows == 17
    assert dict(stats.skipped) == {"unknown role": 1, "empty turn": 1, "wrong type": 2, "over-long": 1}
    assert stats.examples["unknown role"] == ["chats.json[12]: from='robot'"]
    assert "over-long" in stats.report() and "chats.json[15]" in stats.report()


def test_nothing_usable_fails_with_the_counts(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(BAD_ROWS))
    with pytest.raises(NoUsableData) as err:
        prepare_samples(DataConfig(source=str(path), max_length=128), make_tokenizer(), show_progress=False)
    assert "no usable conversation" in str(err.value) and "unknown role" in str(err.value)


def test_split_is_deterministic_and_independent_of_order_and_subsets(tmp_path):
    path = write_sharegpt(tmp_path / "chats.json", 200)
    cfg = DataConfig(source=str(path), max_length=256, validation_fraction=0.2, seed=3)
    samples, _ = prepare_samples(cfg, make_tokenizer(), show_progress=False)
    splits = {s.key: s.split for s in samples}
    assert 20 <= sum(v == "validation" for v in splits.values()) <= 60
    subset, _ = prepare_samples(cfg.model_copy(update={"max_conversations": 50}), make_tokenizer(), show_progress=False)
    assert all(splits[s.key] == s.split for s in subset)
    assert split_of("conv1", 3, 0.2) == splits["conv1"]
    assert any(split_of(f"c{i}", 3, 0.2) != split_of(f"c{i}", 4, 0.2) for i in range(50))


def test_duplicate_ids_get_unique_keys(tmp_path):
    row = {"id": "same", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    path = tmp_path / "dup.json"
    taken = {**row, "id": "same#1"}
    path.write_text(json.dumps([row, taken, row, row]))
    samples, _ = prepare_samples(DataConfig(source=str(path)), make_tokenizer(), show_progress=False)
    assert [s.key for s in samples] == ["same", "same#1", "same#2", "same#3"]
