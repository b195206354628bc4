import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import WORDS, make_tokenizer, write_sharegpt

from mtptrain.data.chat import assistant_spans
from mtptrain.data.prepare import prepare_samples, split_of
from mtptrain.data.samples import NoUsableData
from mtptrain.config import DataConfig

REPO = Path(__file__).resolve().parents[2]

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


def test_a_source_shorter_than_max_conversations_is_named_with_both_counts(tmp_path, caplog):
    path = write_sharegpt(tmp_path / "chats.json", 12)
    caplog.set_level("WARNING", logger="mtptrain.data.prepare")
    prepare_samples(DataConfig(source=str(path), max_conversations=12), make_tokenizer(), show_progress=False)
    assert not caplog.records
    prepare_samples(DataConfig(source=str(path), max_conversations=24_000), make_tokenizer(), show_progress=False)
    [record] = caplog.records
    assert f"{path} holds 12 rows, fewer than data.max_conversations (24,000): every row was read" in record.message


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


def test_overlong_skip_still_skips_a_row_cut_before_tokenizing(tmp_path):
    answer = "the word is hot, " * 10_000
    rows = [{"id": "long", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]},
            {"id": "ok", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(source=str(path), max_length=64, overlong="skip")
    samples, stats = prepare_samples(cfg, make_tokenizer(), show_progress=False)
    assert [s.key for s in samples] == ["ok"]
    # Its exact length is not known (it was never tokenized whole), only that it is over.
    expected = f"rows.jsonl:1: more than max_length 64 tokens ({len(answer) + 1:,} characters)"
    assert stats.examples == {"over-long": [expected]}
    truncate = cfg.model_copy(update={"overlong": "truncate"})
    samples, stats = prepare_samples(truncate, make_tokenizer(), show_progress=False)
    assert [(s.key, len(s)) for s in samples] == [("long", 64), ("ok", len(samples[1]))] and stats.truncated == 1


BIG_ROW_RUN = r"""
import json, resource, sys
from pathlib import Path
from conftest import make_tokenizer
from mtptrain.data.prepare import prepare_samples
from mtptrain.config import DataConfig

normal, big, headroom = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])


def status(field):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024


tokenizer = make_tokenizer()
prepare_samples(DataConfig(source=str(normal), max_length=64), tokenizer, show_progress=False)  # a normal run
baseline = status("VmHWM")
# Address space, not resident memory, is what the kernel can cap; it was measured after a normal run so that
# the tokenizer's threads and arenas already exist and the headroom is what the big row may add.
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
cap = status("VmSize") + headroom
resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
samples, stats = prepare_samples(DataConfig(source=str(big), max_length=64), tokenizer, show_progress=False)
print(json.dumps({"baseline": baseline, "peak": status("VmHWM"), "stats": stats.to_dict(),
                  "samples": {s.key: [s.input_ids.tolist(), s.loss_mask.tolist()] for s in samples}}))
"""


def test_a_200_mb_row_is_cut_before_tokenizing_within_a_memory_cap(tmp_path):
    """A huge row costs about what reading it costs: it is cut before it is rendered or tokenized."""
    rng = random.Random(0)
    normal = write_sharegpt(tmp_path / "normal.json", 20, seed=1)
    answer = " ".join(rng.choice(WORDS) for _ in range(200_000)) + " "  # ~1 MB, repeated past 200 MB
    question = {"role": "user", "content": "the word is hot"}
    rows = [{"id": f"n{i}", "messages": [question, {"role": "assistant", "content": f"short answer {i}"}]}
            for i in range(3)]
    big = tmp_path / "big.jsonl"
    with open(big, "w") as fh:
        fh.write(json.dumps(rows[0]) + "\n")
        fh.write('{"id": "big", "messages": [' + json.dumps(question) + ', {"role": "assistant", "content": "')
        for _ in range(int(200e6 / len(answer)) + 1):
            fh.write(answer)
        fh.write('"}]}\n' + json.dumps(rows[1]) + "\n" + json.dumps(rows[2]) + "\n")
    assert big.stat().st_size > 200e6
    headroom = 1536 << 20
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'tests'}{os.pathsep}{REPO}", "RUST_BACKTRACE": "0"}
    run = subprocess.run([sys.executable, "-c", BIG_ROW_RUN, str(normal), str(big), str(headroom)],
                         capture_output=True, text=True, cwd=REPO, timeout=120, env=env)
    seconds = time.perf_counter() - started
    assert run.returncode == 0, run.stderr[:3000]
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["stats"]["kept"] == 4 and out["stats"]["truncated"] == 1
    assert list(out["samples"]) == ["n0", "big", "n1", "n2"]
    # The big row's sample is the first 64 tokens of the whole conversation, as tokenizing a 20,000-character
    # copy of it whole shows.
    short_copy = [question, {"role": "assistant", "content": answer[:20_000]}]
    tokenizer = make_tokenizer()
    text, spans = assistant_spans(tokenizer, short_copy)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s < end and e > start for start, end in spans)) for s, e in encoded["offset_mapping"][:64]]
    assert out["samples"]["big"] == [encoded["input_ids"][:64], mask]
    # What remains is reading the row: two copies of it at a time (its bytes and their text, the text and the
    # parsed row), where tokenizing it whole took gigabytes.
    grown = out["peak"] - out["baseline"]
    print(f"peak RSS {out['peak'] / 2**20:.0f} MiB, {grown / 2**20:.0f} MiB above a normal run; {seconds:.1f} s")
    assert grown < 3 * big.stat().st_size
