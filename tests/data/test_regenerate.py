import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import kill_after_first_group, recipe_file, write_sharegpt
from transformers import AutoModelForCausalLM

from mtptrain.data.chat import prompt_ids
from mtptrain.data.prepare import prepare_samples, split_of
from mtptrain.data.samples import RowStats
from mtptrain.data.engines import sampler, turn_seed
from mtptrain.data.regenerate import read_jobs, regenerate_jobs, run_regenerate
from mtptrain.data.resumable import RegenerateError, state_path
from mtptrain.config import load_recipe
from mtptrain.engine.verify import Sampling
from mtptrain.runtime.batch import Request, decode_stream
from mtptrain.target import load_tokenizer

REPO = Path(__file__).resolve().parents[2]


def regen_overrides(target_dir: Path, source: Path, out: Path, *extra: str) -> list[str]:
    return [f"target.model={target_dir}", f"data.source={source}", "data.max_length=96",
            "data.validation_fraction=0.2", f"data.regenerated={out}", "regenerate.max_new_tokens=24",
            "regenerate.batch_size=3", *extra]


def greedy_alone(model, prompt: list[int], budget: int, stops: set[int]) -> tuple[list[int], bool]:
    """Plain decoding without cache or padding: the reference for the batched loop."""
    ids = list(prompt)
    new: list[int] = []
    while len(new) < budget:
        token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        if token in stops:
            return new, True
        new.append(token)
        ids.append(token)
    return new, False


@pytest.fixture(scope="module")
def model64(varied_target_dir):
    return AutoModelForCausalLM.from_pretrained(varied_target_dir, dtype=torch.float64).eval()


@pytest.mark.parametrize("runtime", ["auto", "transformers"])
# small: the bands' caches grow in rows and positions, and rows move from band to band, while rows are refilled
# and leave
@pytest.mark.parametrize("grow, first_band, rows_grow", [(64, 128, 8), (2, None, 1)])
def test_streamed_decoding_equals_decoding_each_prompt_alone(model64, varied_target_dir, grow, first_band, rows_grow,
                                                             runtime, monkeypatch):
    from mtptrain.runtime import batch

    for name, value in (("GROW", grow), ("ROWS_GROW", rows_grow)):
        monkeypatch.setattr(batch, name, value)
    prefilled = []  # the tokens of every prompt chunk a row takes in (counted at the first layer)
    prefill = batch._Band.prefill

    def spy(band, layer, row, q, *args):
        if layer == 0:
            prefilled.append(q.shape[2])
        return prefill(band, layer, row, q, *args)

    monkeypatch.setattr(batch._Band, "prefill", spy)
    tok = load_tokenizer(load_recipe(None, [f"target.model={varied_target_dir}"]).target)
    texts = ["the a of", "water than call first who may down side been now find", "hot", "one have this from or"]
    prompts = [prompt_ids(tok, [{"role": "user", "content": t}]) for t in texts]
    # None: the third prompt just fits the first band, so its row moves to the next band at its first step
    monkeypatch.setattr(batch, "FIRST_BAND", first_band or len(prompts[2]))
    moved = []  # positions a row brought along into another band
    take = batch._Band.take
    monkeypatch.setattr(batch._Band, "take", lambda band, row, keep, length: (moved.append(keep),
                                                                              take(band, row, keep, length)))
    # stop on a token the first row emits mid-way, so rows end by stop token and by budget at different steps
    first_alone = greedy_alone(model64, prompts[0], 12, set())[0]
    stops = {first_alone[5]}
    requests = [Request(p, b) for p, b in zip(prompts, [9, 4, 12, 1])]
    # The third request is followed by a next turn: what it was asked and answered, then new tokens.
    turn = Request([], 6)  # its prompt is known once the third request has ended
    ended = []

    def done(request: Request) -> Request | None:
        ended.append(request)
        if request is requests[2]:
            turn.prompt = request.prompt + request.tokens + prompts[3]
            return turn
        return None

    with torch.inference_mode():
        decode_stream(model64, requests, done, 2, stops, tok.pad_token_id, runtime)  # 2 rows: refilled twice
        alone = [greedy_alone(model64, r.prompt, r.budget, stops) for r in [*requests, turn]]
    assert [(r.tokens, r.stopped) for r in [*requests, turn]] == alone
    assert (requests[0].tokens, requests[0].stopped) == (first_alone[:5], True)
    assert [len(r.tokens) for r in requests[1:]] == [4, 12, 1]
    assert len(ended) == 5 and any(r is turn for r in ended)
    if runtime == "auto":  # the next turn prefilled only what it adds to the row's cached prefix
        assert prefilled[-1] == len(prompts[3]) and len(prefilled) == 5
        assert (len(prompts[2]) in moved) == (first_band is None)  # the third row outgrew its band at once


def test_the_fused_kernel_decodes_as_the_plain_products_do(varied_target_dir, monkeypatch):
    """In float32, batched decoding with the fused attention kernel (runtime/native_kernels.py) chooses the tokens
    the plain products choose, with rows refilled, moved between bands as they grow, and prefilled in chunks."""
    import dataclasses

    from mtptrain.runtime import batch, model as runtime_model, runner

    for name, value in (("GROW", 2), ("ROWS_GROW", 1), ("FIRST_BAND", 8)):
        monkeypatch.setattr(batch, name, value)
    kernel = runtime_model.step_attention_kernel()
    assert kernel is not None, "the fused kernel must build here (see the warning logged above)"
    calls = []
    monkeypatch.setattr(runtime_model, "step_attention_kernel", lambda: lambda *a: (calls.append(1), kernel(*a))[1])
    tok = load_tokenizer(load_recipe(None, [f"target.model={varied_target_dir}"]).target)
    texts = ["the a of", "water than call first who may down side been now find", "hot", "one have this from or",
             "been now find the a of to"]
    prompts = [prompt_ids(tok, [{"role": "user", "content": t}]) for t in texts]
    answers = {}
    for name in ("plain", "fused"):
        chosen = runner.choose
        monkeypatch.setattr(runner, "choose", lambda *a, name=name, chosen=chosen:
                            dataclasses.replace(chosen(*a), attention_batch=name))
        model = AutoModelForCausalLM.from_pretrained(varied_target_dir, dtype=torch.float32).eval()
        requests = [Request(p, 14) for p in prompts]
        decode_stream(model, requests, lambda request: None, 3, set(), tok.pad_token_id)
        monkeypatch.setattr(runner, "choose", chosen)
        answers[name] = [r.tokens for r in requests]
    assert calls and answers["fused"] == answers["plain"]
    assert all(len(a) == 14 for a in answers["fused"])


@pytest.mark.parametrize("kernel", ["plain-f32", "sdpa-f32"])
@pytest.mark.parametrize("row", ["sdpa", "sdpa-f32"])
def test_a_bfloat16_model_decodes_in_batches_over_a_float32_cache(varied_target_dir, monkeypatch, kernel, row):
    """A batch kernel over a float32 cache (measured fastest on some CPUs) takes the bfloat16 steps' keys and
    values cast up: each step writes them into the bands' float32 caches, and a prompt's chunk after a prefix
    is attended over that cache by the row kernel, whichever cache the row kernel reads itself."""
    import dataclasses

    from mtptrain.runtime import runner

    tok = load_tokenizer(load_recipe(None, [f"target.model={varied_target_dir}"]).target)
    # Three prompts on two rows: the third takes a row whose cache keeps the prefix they share (the system
    # prompt), and its chunk is attended over what that band holds.
    prompts = [prompt_ids(tok, [{"role": "user", "content": t}]) for t in ("the a of", "hot water", "one")]
    chosen = runner.choose
    monkeypatch.setattr(runner, "choose", lambda *a: dataclasses.replace(
        chosen(*a), attention_batch=kernel, attention_one=row, attention_many=row))
    model = AutoModelForCausalLM.from_pretrained(varied_target_dir, dtype=torch.bfloat16).eval()
    requests = [Request(p, 10) for p in prompts]
    decode_stream(model, requests, lambda request: None, 2, set(), tok.pad_token_id)
    assert runner.load_decoder(model, batched=True).choice.batch_cache_dtype == torch.float32
    assert all(len(r.tokens) == 10 for r in requests)


def test_sampled_rows_do_not_depend_on_their_batch(model64, varied_target_dir):
    tok = load_tokenizer(load_recipe(None, [f"target.model={varied_target_dir}"]).target)
    prompts = [prompt_ids(tok, [{"role": "user", "content": t}]) for t in ["the a", "of to and in is it you"]]
    sampling = Sampling(temperature=1.0, top_p=0.9)

    def sampled(chosen: list[list[int]], seeds: list[int]) -> list[list[int]]:
        requests = [Request(p, 15, sampler(sampling, seed)) for p, seed in zip(chosen, seeds)]
        decode_stream(model64, requests, lambda request: None, 2, set(), tok.pad_token_id)
        return [r.tokens for r in requests]

    with torch.inference_mode():
        together = sampled(prompts, [7, 8])
        second = sampled(prompts[1:], [8])
        reseeded = sampled(prompts[1:], [9])
    assert together[1] == second[0]
    assert reseeded[0] != second[0]
    assert sampler(Sampling(), 0) is None  # greedy rows take the batch's argmax
    assert turn_seed(0, "a", 1) == turn_seed(0, "a", 1) != turn_seed(0, "a", 2)


def test_regenerated_conversations_keep_questions_ids_and_split(varied_target_dir, tmp_path):
    source = write_sharegpt(tmp_path / "chats.json", 14, extra_rows=[
        {"id": "long", "conversations": [{"from": "human", "value": "word " * 200}, {"from": "gpt", "value": "a"}]},
        {"id": "conv3", "conversations": [{"from": "human", "value": "same id again"}, {"from": "gpt", "value": "b"}]},
        "not a conversation"])
    out = tmp_path / "regen" / "r.jsonl"
    # float32, as the transformers reference the first answer is checked against below
    recipe = load_recipe(None, regen_overrides(varied_target_dir, source, out, "data.max_length=160",
                                               "target.dtype=float32"))
    summary = run_regenerate(recipe, show_progress=False)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    originals: dict[str, list] = {}
    for r in json.loads(source.read_text()):
        if isinstance(r, dict):
            originals[r["id"] + "#1" if r["id"] in originals else r["id"]] = r["conversations"]
    ids = [r["id"] for r in rows]
    assert summary["conversations"] == len(rows) >= 10 and len(set(ids)) == len(ids)
    assert "long" not in ids and "conv3#1" in ids  # a repeated id is renamed as precompute renames it
    assert summary["skipped"]["prompt over-long"] >= 1
    assert summary["read"]["skipped"] == {"wrong type": 1}
    tok = load_tokenizer(recipe.target)
    model = AutoModelForCausalLM.from_pretrained(varied_target_dir).eval()
    for row in rows:
        questions = [t["value"] for t in originals[row["id"]] if t["from"] == "human"]
        users = [m["content"] for m in row["messages"] if m["role"] == "user"]
        assert users == questions[:len(users)] and users
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"] * len(users)
        assert len(row["meta"]["new_tokens"]) == len(users)
        for turn, new in enumerate(row["meta"]["new_tokens"]):  # every answer fits in max_length
            assert len(prompt_ids(tok, row["messages"][:2 * turn + 1])) + new + 1 <= 160
        assert all(n <= 24 for n in row["meta"]["new_tokens"])
    # the first answer is the target's own greedy answer
    first = rows[0]
    prompt = prompt_ids(tok, first["messages"][:1])
    with torch.inference_mode():
        tokens, _ = greedy_alone(model, prompt, first["meta"]["new_tokens"][0], {tok.eos_token_id})
    assert first["messages"][1]["content"] == tok.decode(tokens, skip_special_tokens=True).strip()
    # precompute's data reader takes the regenerated file in place of the source, with the same split
    samples, stats = prepare_samples(recipe.data, tok, show_progress=False)
    assert len(samples) == len(rows)
    # an answer cut by a length limit is trained on without an end-of-turn target after it
    end = tok.convert_tokens_to_ids("<|im_end|>")
    by_key = {s.key: s for s in samples}
    for row in rows:
        sample = by_key[row["id"]]
        ends_masked = int(((sample.input_ids == end) & (sample.loss_mask == 1)).sum())
        assert ends_masked == sum(row["meta"]["finished"]), row["id"]
    assert not all(f for row in rows for f in row["meta"]["finished"])
    assert all(s.split == split_of(s.key, 0, 0.2) for s in samples)
    original, _ = prepare_samples(recipe.data.model_copy(update={"regenerated": None}), tok, show_progress=False)
    assert {s.key for s in samples} <= {s.key for s in original}


def test_a_source_shorter_than_max_conversations_is_named_before_regenerating(varied_target_dir, tmp_path, caplog):
    source = write_sharegpt(tmp_path / "chats.json", 5)
    caplog.set_level("WARNING", logger="mtptrain.data.regenerate")
    for limit, said in ((5, []), (9, [f"regenerate: {source} holds 5 rows, fewer than data.max_conversations (9): "
                                       "every row was read"])):
        caplog.clear()
        recipe = load_recipe(None, regen_overrides(varied_target_dir, source, tmp_path / "r.jsonl",
                                                   f"data.max_conversations={limit}"))
        jobs = read_jobs(recipe, load_tokenizer(recipe.target), RowStats())
        assert len(jobs) == 5 and [r.message for r in caplog.records] == said


def test_repeated_ids_get_the_same_keys_in_the_original_and_regenerated_sets(varied_target_dir, tmp_path):
    """A repeated id whose first row is unusable still takes its key, in both paths."""
    long_first = {"id": "dup", "conversations": [{"from": "human", "value": "word " * 200},
                                                 {"from": "gpt", "value": "a"}]}
    usable = {"id": "dup", "conversations": [{"from": "human", "value": "the a of"}, {"from": "gpt", "value": "b"}]}
    short = [{"id": f"s{i}", "conversations": [{"from": "human", "value": w}, {"from": "gpt", "value": "c"}]}
             for i, w in enumerate(["hot", "water", "time"])]
    source = write_sharegpt(tmp_path / "chats.json", 0, extra_rows=short + [long_first, usable])
    recipe = load_recipe(None, regen_overrides(varied_target_dir, source, tmp_path / "r.jsonl"))
    run_regenerate(recipe, show_progress=False)
    tok = load_tokenizer(recipe.target)
    regenerated, _ = prepare_samples(recipe.data, tok, show_progress=False)
    original, _ = prepare_samples(recipe.data.model_copy(update={"regenerated": None}), tok, show_progress=False)
    assert sorted(s.key for s in regenerated) == sorted(s.key for s in original) == ["dup#1", "s0", "s1", "s2"]
    assert {s.key: s.split for s in regenerated} == {s.key: s.split for s in original}


def test_settings_target_and_foreign_files_are_refused(varied_target_dir, tiny_target_dir, tmp_path):
    source = write_sharegpt(tmp_path / "chats.json", 4)
    out = tmp_path / "r.jsonl"
    run_regenerate(load_recipe(None, regen_overrides(varied_target_dir, source, out)), show_progress=False)
    before = out.read_bytes()
    with pytest.raises(RegenerateError, match=r"other settings \(temperature: 0.0 -> 0.7\).*new path"):
        run_regenerate(load_recipe(None, regen_overrides(varied_target_dir, source, out, "regenerate.temperature=0.7")),
                       show_progress=False)
    with pytest.raises(RegenerateError, match="another target"):
        run_regenerate(load_recipe(None, regen_overrides(tiny_target_dir, source, out)), show_progress=False)
    assert out.read_bytes() == before  # nothing written is lost
    foreign = tmp_path / "mine.jsonl"
    foreign.write_text('{"id": "x"}\n')
    with pytest.raises(RegenerateError, match="not written by `mtptrain regenerate`"):
        run_regenerate(load_recipe(None, regen_overrides(varied_target_dir, source, foreign)), show_progress=False)
    with pytest.raises(RegenerateError, match="data.regenerated is not set"):
        run_regenerate(load_recipe(None, [f"target.model={varied_target_dir}"]), show_progress=False)
    # The source changed under a finished file: the batches already written are no longer what it yields.
    rows = json.loads(source.read_text())
    rows[0]["conversations"][0]["value"] = "an edited question"
    source.write_text(json.dumps(rows))
    with pytest.raises(RegenerateError, match="no longer yields the conversations"):
        run_regenerate(load_recipe(None, regen_overrides(varied_target_dir, source, out)), show_progress=False)
    assert out.read_bytes() == before


def test_a_finished_file_stands_however_its_work_was_cut(varied_target_dir, tiny_target_dir, tmp_path):
    source = write_sharegpt(tmp_path / "chats.json", 4)
    out = tmp_path / "r.jsonl"
    run_regenerate(load_recipe(None, regen_overrides(varied_target_dir, source, out)), show_progress=False)
    before = out.read_bytes()
    state = json.loads(state_path(out).read_text())
    # As the first state format left a finished file: batches instead of groups, another batch size.
    state["settings"].update(version=1, batch_size=64)
    del state["settings"]["engine"]  # written before regenerate.engine: decoded on the runtime
    state["batches_done"] = state.pop("groups_done")
    state_path(out).write_text(json.dumps(state))
    summary = run_regenerate(load_recipe(None, regen_overrides(varied_target_dir, source, out)), show_progress=False)
    assert summary["tokens_this_run"] == 0 and summary["conversations"] == state["counts"]["conversations"]
    assert out.read_bytes() == before
    with pytest.raises(RegenerateError, match="another target"):  # what it is still has to match
        run_regenerate(load_recipe(None, regen_overrides(tiny_target_dir, source, out)), show_progress=False)
    with pytest.raises(RegenerateError, match=r"other settings \(batch_size: 64 -> 3, max_new_tokens: 24 -> 8"):
        run_regenerate(load_recipe(None, regen_overrides(varied_target_dir, source, out, "regenerate.max_new_tokens=8")),
                       show_progress=False)
    state["complete"] = False  # unfinished: its batches cannot be resumed as groups
    state_path(out).write_text(json.dumps(state))
    with pytest.raises(RegenerateError, match=r"unfinished and was written by another version .*state format 1"):
        run_regenerate(load_recipe(None, regen_overrides(varied_target_dir, source, out)), show_progress=False)
    assert out.read_bytes() == before


def test_one_process_only(varied_target_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    recipe = load_recipe(None, regen_overrides(varied_target_dir, write_sharegpt(tmp_path / "c.json", 2),
                                               tmp_path / "r.jsonl"))
    with pytest.raises(RegenerateError, match="one process"):
        run_regenerate(recipe, show_progress=False)


def test_precompute_refuses_a_missing_unfinished_or_stale_regeneration(varied_target_dir, tiny_target_dir, tmp_path):
    source = write_sharegpt(tmp_path / "chats.json", 4)
    out = tmp_path / "r.jsonl"
    recipe = load_recipe(None, regen_overrides(varied_target_dir, source, out, "data.max_length=200"))
    tok = load_tokenizer(recipe.target)
    with pytest.raises(RegenerateError, match="does not exist: run `mtptrain regenerate`"):
        prepare_samples(recipe.data, tok, show_progress=False)
    run_regenerate(recipe, show_progress=False)
    state = json.loads(state_path(out).read_text())
    state_path(out).write_text(json.dumps({**state, "complete": False}))
    with pytest.raises(RegenerateError, match="unfinished"):
        prepare_samples(recipe.data, tok, show_progress=False)
    for hostile in ("[1]", "{torn", json.dumps({**state, "target": "x"}), json.dumps({**state, "settings": [1]})):
        state_path(out).write_text(hostile)
        with pytest.raises(RegenerateError, match=r"r.jsonl.state.json is not a state `mtptrain regenerate` wrote"):
            prepare_samples(recipe.data, tok, show_progress=False)
    state_path(out).write_text(json.dumps(state))
    prepare_samples(recipe.data, tok, show_progress=False)
    with pytest.raises(RegenerateError, match=r"other data \(data.max_length: 200 there, 120 here\)"):
        prepare_samples(recipe.data.model_copy(update={"max_length": 120}), tok, show_progress=False)
    other = load_tokenizer(load_recipe(None, ["target.model=" + str(tiny_target_dir)]).target)
    other.add_tokens(["<extra>"])  # the same words, another tokenizer
    with pytest.raises(RegenerateError, match="another tokenizer"):
        prepare_samples(recipe.data, other, show_progress=False)


def _cli(recipe_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mtptrain.cli", "regenerate", "--recipe", str(recipe_path), "--no-progress",
            *[a for item in extra for a in ("--set", item)]]


def settle_machine_choice(target_dir: Path, monkeypatch) -> None:
    """Cache this machine's kernel choice for `target_dir`'s shapes, as a quiet machine would have: processes that
    start fresh then read one choice. Under load each measures its own and, on a tiny model whose dtypes and
    kernels time alike, may pick another and round a greedy near-tie the other way."""
    from transformers import AutoConfig

    from mtptrain.runtime import choice

    monkeypatch.setattr(choice, "other_load", lambda start, end: 0.0)
    monkeypatch.setattr(choice, "_SETTLED", {})  # not a measurement this process took under load
    assert choice.choose(AutoConfig.from_pretrained(target_dir), torch.device("cpu")).source in ("cached", "measured")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_killed_regeneration_resumes_to_the_same_file(varied_target_dir, tmp_path, temperature, monkeypatch):
    settle_machine_choice(varied_target_dir, monkeypatch)
    source = write_sharegpt(tmp_path / "chats.json", 48)  # 3 groups of 8 batches of 2
    recipe_path = recipe_file(regen_overrides(varied_target_dir, source, tmp_path / "clean.jsonl",
                                              "regenerate.batch_size=2", "regenerate.max_new_tokens=40",
                                              "data.max_length=200", f"regenerate.temperature={temperature}"),
                              tmp_path / "recipe.yaml")
    subprocess.run(_cli(recipe_path), cwd=REPO, check=True, capture_output=True)
    clean = (tmp_path / "clean.jsonl").read_bytes()

    killed = tmp_path / "killed.jsonl"
    state = kill_after_first_group(_cli(recipe_path, f"data.regenerated={killed}"), killed, REPO)
    assert not state["complete"] and 1 <= state["groups_done"] < 3
    # A kill can land mid-append: simulate the worst case, a torn last line after the recorded bytes.
    with open(killed, "ab") as fh:
        fh.write(b'{"id": "torn", "mess')
    result = subprocess.run(_cli(recipe_path, f"data.regenerated={killed}"), cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "regenerated" in result.stdout
    assert killed.read_bytes() == clean
    assert json.loads(state_path(killed).read_text())["complete"]
    # the states kept for precompute: the same files, group by group, as the uninterrupted run's
    kept = json.loads(state_path(killed).read_text())["states"]["groups"]
    assert kept == json.loads(state_path(tmp_path / "clean.jsonl").read_text())["states"]["groups"]
    assert sorted(kept) == ["0", "1", "2"] and all(g["samples"] > 0 for g in kept.values())
    assert state["runtime"]["runtime"] == "native"  # what decoded the first group, for the resume to decode with


def _unfinished(out: Path, runtime: object) -> None:
    """Make a finished regeneration's state say that nothing was written yet, begun with `runtime`."""
    state = json.loads(state_path(out).read_text())
    state.update(complete=False, groups_done=0, bytes=0, runtime=runtime)
    state["counts"] = {"conversations": 0, "answers": 0, "answer_tokens": 0, "unfinished_answers": 0, "skipped": {}}
    state_path(out).write_text(json.dumps(state))


def test_a_resume_decodes_with_the_runtime_the_file_was_begun_with(varied_target_dir, tmp_path, caplog):
    out = tmp_path / "r.jsonl"
    recipe = load_recipe(None, regen_overrides(varied_target_dir, write_sharegpt(tmp_path / "chats.json", 4), out))
    run_regenerate(recipe, show_progress=False)
    first = json.loads(state_path(out).read_text())["runtime"]
    assert first["runtime"] == "native" and first["dtype"] in ("float32", "bfloat16")
    other = "float32" if first["dtype"] == "bfloat16" else "bfloat16"
    begun = {"runtime": "native", "dtype": other, "product": "linear", "product_batch": "linear",
             "attention_one": "plain", "attention_many": "plain", "attention_batch": "plain"}
    _unfinished(out, begun)
    with caplog.at_level("INFO", logger="mtptrain"):
        run_regenerate(recipe, show_progress=False)
    assert f"target runs on mtptrain's runtime: {other} (recorded), products linear / linear (batches), " \
           "attention plain (1 token) / plain / plain (batches)" in caplog.text
    assert json.loads(state_path(out).read_text())["runtime"] == begun  # kept, not replaced by this run's

    with pytest.raises(RegenerateError, match=f"begun in {other}.*set target.dtype={other}"):
        _unfinished(out, begun)
        run_regenerate(load_recipe(None, [*regen_overrides(varied_target_dir, tmp_path / "chats.json", out),
                                          f"target.dtype={first['dtype']}"]), show_progress=False)
    for hostile, why in [({**begun, "product": "os.system"}, "product 'os.system' is not one of"),
                         ({**begun, "dtype": "int8"}, "dtype 'int8'"), ("native", "not an object"),
                         ({**begun, "product": ["linear"]}, "product \\['linear'\\] is not one of"),
                         ({"runtime": "elsewhere", "dtype": "float32"}, "neither native nor transformers")]:
        _unfinished(out, hostile)
        with pytest.raises(RegenerateError, match=f"r.jsonl.state.json: its \"runtime\" entry .*{why}.*start over"):
            run_regenerate(recipe, show_progress=False)


def test_cli_names_the_fix_for_bad_settings(varied_target_dir, tmp_path):
    source = write_sharegpt(tmp_path / "chats.json", 3)
    out = tmp_path / "r.jsonl"
    base = regen_overrides(varied_target_dir, source, out)
    ok = subprocess.run([sys.executable, "-m", "mtptrain.cli", "regenerate", "--no-progress",
                         *[a for item in base for a in ("--set", item)]], cwd=REPO, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    shutil.copy(out, tmp_path / "kept.jsonl")
    bad = subprocess.run([sys.executable, "-m", "mtptrain.cli", "regenerate", "--no-progress",
                          *[a for item in base + ["regenerate.max_new_tokens=8"] for a in ("--set", item)]],
                         cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 1
    assert "max_new_tokens: 24 -> 8" in bad.stderr and "Traceback" not in bad.stderr
    assert out.read_bytes() == (tmp_path / "kept.jsonl").read_bytes()


def test_a_huge_question_is_skipped_without_being_tokenized_whole(tiny_target_dir, tmp_path, longest_text):
    huge = {"id": "huge", "messages": [{"role": "user", "content": "the word is hot " * 25_000},
                                       {"role": "assistant", "content": "a"}]}
    small = {"id": "small", "messages": [{"role": "user", "content": "the word"},
                                         {"role": "assistant", "content": "b"}]}
    source = tmp_path / "chats.jsonl"
    source.write_text(json.dumps(huge) + "\n" + json.dumps(small) + "\n")
    recipe = load_recipe(None, regen_overrides(tiny_target_dir, source, tmp_path / "r.jsonl"))  # max_length 96
    tok = load_tokenizer(recipe.target)
    small_prompt = prompt_ids(tok, small["messages"][:1])
    longest_text()  # from here on
    jobs = read_jobs(recipe, tok, RowStats())
    assert [(job.id, length) for job, length in jobs] == [("huge", 97), ("small", len(small_prompt))]
    job = jobs[0][0]
    # Nothing of it is asked (so no model is needed): the context is full before the first answer.
    assert regenerate_jobs(None, tok, [job], recipe, set()) == 0
    assert job.stopped == "context full" and not job.messages
    assert 0 < longest_text() < 10_000  # rendered or tokenized: something, never the whole question  # of a 400,000-character question


def test_a_hostile_state_file_is_refused_naming_it(varied_target_dir, tmp_path):
    out = tmp_path / "r.jsonl"
    recipe = load_recipe(None, regen_overrides(varied_target_dir, write_sharegpt(tmp_path / "chats.json", 4), out))
    run_regenerate(recipe, show_progress=False)
    state = json.loads(state_path(out).read_text())
    kept = out.read_bytes()
    for hostile in ("[1]", json.dumps({**state, "counts": {**state["counts"], "answers": "7"}}),
                    json.dumps({**state, "complete": 1}), json.dumps({**state, "target": None}),
                    json.dumps({**state, "complete": False, "plan": {"a": 1}})):
        state_path(out).write_text(hostile)
        with pytest.raises(RegenerateError, match="r.jsonl.state.json is not a state mtptrain wrote"):
            run_regenerate(recipe, show_progress=False)
        assert out.read_bytes() == kept
