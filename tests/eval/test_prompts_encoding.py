import codecs

from mtptrain.eval.prompts import load_prompts


def test_a_byte_order_mark_does_not_break_the_first_prompt(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(codecs.BOM_UTF8 + '{"prompt": "héllo"}\n{"id": "x", "turns": ["a", "b"]}\n'.encode())
    assert [(p.id, p.turns) for p in load_prompts(str(path))] == [("1", ["héllo"]), ("x", ["a", "b"])]
    # Files joined with cat keep each part's mark at the start of a later line.
    path.write_bytes(codecs.BOM_UTF8 + b'{"prompt": "a"}\n' + codecs.BOM_UTF8 + b'{"prompt": "b"}\n')
    assert [(p.id, p.turns) for p in load_prompts(str(path))] == [("1", ["a"]), ("2", ["b"])]
