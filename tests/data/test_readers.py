import codecs
import json

import pytest

from mtptrain.data.conversations import BadRow, normalise
from mtptrain.data.readers import DataSourceError, read_rows


def test_truncated_json_array_yields_complete_rows_then_one_damaged_row(tmp_path):
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
            for i in range(5)]
    text = json.dumps(rows)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.rindex('"yo"')])  # cut inside the last record
    read = list(read_rows(str(path)))
    assert [r.value["id"] for r in read[:4]] == ["0", "1", "2", "3"]
    assert read[4].problem[0] == "file cut off" and read[4].ref == "cut.json[4]"
    assert len(read) == 5


def test_broken_json_in_the_middle_stops_with_the_element_and_line(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]} for i in range(4)]
    text = json.dumps(rows, indent=1).replace('"q2"', '"q2" oops', 1)
    path = tmp_path / "broken.json"
    path.write_text("\ufeff" + text)  # a byte-order mark is accepted
    with pytest.raises(DataSourceError) as err:
        list(read_rows(str(path)))
    assert "broken.json[2]" in str(err.value) and f"line {text[:text.index('oops')].count(chr(10)) + 1}" in str(err.value)


def test_jsonl_reports_line_numbers_for_bad_json_and_bad_bytes(tmp_path):
    path = tmp_path / "rows.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    path.write_bytes(good.encode() + b"\n{not json\n" + b'{"messages": "\xff\xfe"}\n\n' + good.encode() + b"\n")
    read = list(read_rows(str(path)))
    assert [r.ref for r in read] == ["rows.jsonl:1", "rows.jsonl:2", "rows.jsonl:3", "rows.jsonl:5"]
    assert read[1].problem[0] == "malformed JSON"
    assert read[2].problem[0] == "non-UTF-8 text"
    assert read[3].problem is None


def test_json_nested_past_the_parsers_depth_is_a_bad_row_or_a_named_element_not_a_crash(tmp_path):
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    lines = tmp_path / "deep.jsonl"
    lines.write_text(json.dumps(good) + "\n" + "[" * 100_000 + "\n" + json.dumps(good) + "\n")
    read = list(read_rows(str(lines)))
    assert [r.ref for r in read] == ["deep.jsonl:1", "deep.jsonl:2", "deep.jsonl:3"]
    assert read[1].problem == ("malformed JSON", "nested past the JSON parser's depth")
    assert read[0].problem is None and read[2].problem is None
    array = tmp_path / "deep.json"
    array.write_text("[" + json.dumps(good) + ",\n" + "[" * 100_000 + "]" * 100_000 + "]")
    with pytest.raises(DataSourceError) as err:
        list(read_rows(str(array)))
    assert "deep.json[1]" in str(err.value) and "line 2" in str(err.value) and "depth" in str(err.value)


def test_non_utf8_inside_a_json_array_is_a_bad_row_not_a_crash(tmp_path):
    path = tmp_path / "bytes.json"
    path.write_bytes(b'[{"conversations": [{"from": "human", "value": "caf\xe9"}, {"from": "gpt", "value": "ok"}]}]')
    (row,) = list(read_rows(str(path)))
    with pytest.raises(BadRow) as bad:
        normalise(row.value, row.ref)
    assert bad.value.reason == "non-UTF-8 text"


def test_limit_and_missing_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"messages": []}) for _ in range(10)))
    assert len(list(read_rows(str(path), limit=3))) == 3
    with pytest.raises(DataSourceError, match="does not exist"):
        list(read_rows(str(tmp_path / "missing.json")))
    (tmp_path / "obj.json").write_text('{"a": 1}')
    with pytest.raises(DataSourceError, match="not a JSON array"):
        list(read_rows(str(tmp_path / "obj.json")))


def test_layouts_normalise_to_the_same_conversation():
    expected = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    sharegpt = {"id": "x", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    messages = {"id": "x", "messages": expected}
    ultrachat = {"id": "x", "data": ["q", "a"]}
    for row in (sharegpt, messages, ultrachat):
        assert normalise(row, "ref").messages == expected
    assert normalise({"chat": expected}, "ref", messages_column="chat").messages == expected


@pytest.mark.parametrize("row, reason", [
    ({"conversations": [{"from": "robot", "value": "q"}]}, "unknown role"),
    ({"conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "a"}]}, "empty turn"),
    ({"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "a"}]}, "wrong type"),
    ({"conversations": "hello"}, "wrong type"),
    (["not", "a", "dict"], "wrong type"),
    ({"conversations": [{"from": "human", "value": "q"}]}, "no assistant turn"),
    ({"conversations": []}, "empty conversation"),
    ({"text": "plain"}, "unknown layout"),
])
def test_bad_rows_raise_with_a_reason(row, reason):
    with pytest.raises(BadRow) as bad:
        normalise(row, "ref")
    assert bad.value.reason == reason


@pytest.mark.parametrize("answered", [True, False])
def test_rows_with_nothing_asked_are_refused(answered):
    # ShareGPT holds rows cut from longer chats that keep only the assistant's side: nothing is left to answer or
    # to train on once the opening assistant turns are dropped (regenerate used to crash on such a row)
    only_gpt = {"conversations": [{"from": "gpt", "value": "the rest of the code"}]}
    only_system = {"messages": [{"role": "system", "content": "be brief"}, {"role": "assistant", "content": "a"}]}
    for row in (only_gpt, only_system):
        with pytest.raises(BadRow) as bad:
            normalise(row, "ref", answered=answered)
        assert bad.value.reason == "no user turn"


def test_leading_assistant_turns_are_dropped():
    row = {"conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    assert [m["role"] for m in normalise(row, "r").messages] == ["user", "assistant"]


def test_datasets_directory_source(tmp_path):
    import datasets  # part of the dev extra

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(4)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    read = list(read_rows(f"datasets:{tmp_path / 'ds'}"))
    assert [r.ref for r in read] == [f"ds[{i}]" for i in range(4)]
    assert normalise(read[2].value, read[2].ref).messages[1]["content"] == "a2"
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataSourceError, match="not 'train'"):
        list(read_rows(f"datasets:{tmp_path / 'dd'}"))
    assert len(list(read_rows(f"datasets:{tmp_path / 'dd'}", split="test"))) == 4


def test_a_byte_order_mark_does_not_cost_the_first_jsonl_row(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
            for i in range(3)]
    path = tmp_path / "bom.jsonl"
    path.write_bytes(codecs.BOM_UTF8 + "\n".join(json.dumps(r) for r in rows).encode() + b"\n")
    read = list(read_rows(str(path)))
    assert [(r.ref, r.problem, r.value) for r in read] == [(f"bom.jsonl:{i + 1}", None, r) for i, r in enumerate(rows)]
    # Files joined with cat keep each part's mark at the start of a later line; a mark alone is an empty line.
    path.write_bytes(codecs.BOM_UTF8 + b"\n" + json.dumps(rows[0]).encode() + b"\n" + codecs.BOM_UTF8
                     + json.dumps(rows[1]).encode() + b"\n" + codecs.BOM_UTF8 + b'{"messages": "\xff"}\n')
    read = list(read_rows(str(path)))
    assert [(r.ref, r.value) for r in read[:2]] == [("bom.jsonl:2", rows[0]), ("bom.jsonl:3", rows[1])]
    assert read[2].problem == ("non-UTF-8 text", "byte 17: b'\\xff\"}\\n'")
