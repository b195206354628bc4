"""The parts of the vLLM path that need no vLLM: finding its environment, the engine settings, vLLM's counters read
as the engine's statistics, the serving check's verdicts, and the regeneration state's engine."""

import threading
from pathlib import Path

import pytest

from mtptrain.config import RecipeError, VllmConfig, load_recipe
from mtptrain.data.regenerate import settings_of
from mtptrain.engine.generate import GenerationStats
from mtptrain.eval.methods import Config
from mtptrain.eval.tally import Tally, per_request_means
from mtptrain.eval.serving import agreement, conforms, served_stats, unchecked
from mtptrain.serving.vllm_engine import (Served, VllmError, VllmWorker, batch1_cache_gib, close_all, engine_args,
                                          vllm_python, worker_env)


def test_a_missing_environment_names_the_setup_script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MTPTRAIN_VLLM_PYTHON", raising=False)
    monkeypatch.setattr("mtptrain.serving.vllm_engine.VENV", ".venv-none")
    with pytest.raises(VllmError, match="scripts/setup_vllm.sh"):
        vllm_python("auto")
    with pytest.raises(VllmError, match="vllm.python /nowhere/python"):
        vllm_python("/nowhere/python")
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    monkeypatch.setenv("MTPTRAIN_VLLM_PYTHON", str(python))
    assert vllm_python("auto") == python


def test_workers_close_together_and_one_that_cannot_be_asked_is_killed_not_waited_for(tmp_path):
    """Stand-ins for vLLM's python: one answers "closing" to what it reads and exits, as the worker does; the other
    never reads, and the close request cannot reach it (its stdin is shut): waiting for its answer would hang."""
    answering, silent = tmp_path / "answering", tmp_path / "silent"
    answering.write_text('#!/bin/sh\nread line\necho ready\necho \'{"closing": true}\'\n')
    silent.write_text("#!/bin/sh\nexec sleep 600\n")
    for script in (answering, silent):
        script.chmod(0o755)
    workers = [VllmWorker(VllmConfig(python=str(script)), log_path=tmp_path / f"{script.name}.log")
               for script in (answering, silent)]
    workers[1].process.stdin.close()
    closing = threading.Thread(target=close_all, args=(workers,), daemon=True)
    closing.start()
    closing.join(timeout=30)
    alive = closing.is_alive()
    for worker in workers:  # never leave the stand-ins behind, whatever happened
        worker.process.kill()
    assert not alive, "close_all waited for an answer from a worker it could not ask"
    assert workers[0].process.wait() == 0 and workers[0]._close_asked  # it ended by itself, asked
    assert workers[1].process.returncode == -9 and not workers[1]._close_asked  # killed


def test_a_worker_that_shut_its_end_of_the_pipe_but_lives_is_killed_at_close(tmp_path):
    """A worker alive with its stdin closed: the close request breaks the pipe and reaches nobody, so no answer
    will come, and close_all must not wait for one."""
    deaf = tmp_path / "deaf"
    deaf.write_text("#!/bin/sh\nexec 0<&-\necho shut\nexec sleep 600\n")
    deaf.chmod(0o755)
    worker = VllmWorker(VllmConfig(python=str(deaf)), log_path=tmp_path / "deaf.log")
    assert worker.process.stdout.readline() == "shut\n"  # its stdin is closed from here on
    closing = threading.Thread(target=close_all, args=([worker],), daemon=True)
    closing.start()
    closing.join(timeout=30)
    alive = closing.is_alive()
    worker.process.kill()
    assert not alive, "close_all waited for an answer to a request the broken pipe never delivered"
    assert worker.process.wait() == -9 and not worker._close_asked


def test_engine_settings_on_a_cpu(tmp_path):
    args = engine_args(VllmConfig(), "/m", 2048, {"method": "eagle3", "model": "/h", "num_speculative_tokens": 3},
                       kv_cache_gib=0.25)
    assert args["dtype"] == "bfloat16" and args["enforce_eager"] and args["max_model_len"] == 2048
    assert args["distributed_executor_backend"] == "uni" and args["kv_cache_memory_bytes"] == 2**28
    assert not args["enable_prefix_caching"] and not args["disable_log_stats"]
    assert engine_args(VllmConfig(dtype="float32", in_process=False), "/m", 64)["dtype"] == "float32"
    assert "distributed_executor_backend" not in engine_args(VllmConfig(in_process=False), "/m", 64)
    env = worker_env(Path("/venv/bin/python"), VllmConfig())
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and "PYTHONPATH" not in env


def test_a_batch1_cache_holds_one_request():
    class Smol:  # SmolLM2-135M's attention: 30 layers, 3 key-value heads of 64
        num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size = 30, 9, 3, 576
    per_token = 2 * 31 * 3 * 64 * 2
    assert batch1_cache_gib(Smol, 8192) == pytest.approx(1.5 * 8192 * per_token / 2**30)
    assert batch1_cache_gib(Smol, 8192, "float32") == pytest.approx(2 * batch1_cache_gib(Smol, 8192))
    assert batch1_cache_gib(Smol, 16) == 0.25


def test_vllm_counters_become_the_engines_statistics():
    # 1 token from the prefill, then 10 steps: 4 drafts accepted at position 1, 2 at 2, 1 at 3 -> 17 tokens
    stats = served_stats(Served(list(range(18)), 1.0, "length", drafts=10, draft_tokens=30, accepted=7,
                                accepted_per_pos=[4, 2, 1]), 3)
    assert stats.steps == 10 and stats.emitted == 17 and stats.tau == pytest.approx(1.7)
    assert stats.acceptance() == [0.4, 0.2, 0.1] and stats.verified == 30
    # steps that drafted nothing (no n-gram match, say) are steps too
    sparse = served_stats(Served(list(range(12)), 1.0, "length", drafts=4, draft_tokens=12, accepted=2,
                                 accepted_per_pos=[2, 0, 0]), 3)
    assert sparse.steps == 9 and sparse.acceptance()[0] == pytest.approx(2 / 9)
    baseline = served_stats(Served(list(range(8)), 1.0, "length"), 0)
    assert baseline.tau == 1.0 and baseline.acceptance() == []


def _tally(engine: str, method: str, k: int, requests: list[tuple[list[int], int, list[int]]],
           stop: float = 0.0) -> Tally:
    label = f"{'vllm ' if engine == 'vllm' else ''}{method} K={k}" + (f" stop {stop:g}" if stop else "")
    tally = Tally(Config(label, method, k, engine=engine, stop=stop))
    for tokens, steps, accepted in requests:
        stats = GenerationStats(steps=steps, emitted=len(tokens), proposed=[steps] * k, accepted=accepted)
        tally.add(tokens, stats, "all")
    return tally


def test_the_serving_check_compares_like_with_like():
    ours = _tally("embedded", "chain", 3, [([1, 2, 3], 10, [5, 2, 1]), ([4, 5], 8, [4, 2, 0]), ([6], 5, [1, 0, 0])])
    same = _tally("vllm", "chain", 3, [([1, 2, 3], 10, [5, 2, 1]), ([4, 5], 8, [4, 2, 0]), ([6], 5, [1, 0, 0])])
    [entry] = agreement([ours, same])
    assert entry["max_gap"] == 0 and entry["identical_share"] == 1.0 and conforms(entry) == []
    # counts that differ in every request, pooled acceptance nearly the same: the per-request share catches it
    shifted = _tally("vllm", "chain", 3, [([1, 2, 3], 10, [5, 1, 1]), ([4, 5], 8, [4, 3, 0]), ([6], 5, [1, 0, 1])])
    [entry] = agreement([ours, shifted])
    assert entry["identical_share"] == 0.0 and any("identical acceptance" in f for f in conforms(entry))
    # only answers written alike are compared request by request
    other_text = _tally("vllm", "chain", 3, [([9, 9, 9], 10, [0, 0, 0]), ([4, 5], 8, [4, 2, 0]), ([6], 5, [1, 0, 0])])
    [entry] = agreement([ours, other_text])
    assert entry["same_answers"] == 2 and entry["identical_share"] == 1.0
    assert any("differs" in f for f in conforms(entry))  # but its pooled acceptance is off by 0.22
    # a stopped chain (eval.chain.stops) of the same K is not what vLLM drafts: compared with the row without one
    stopped = _tally("embedded", "chain", 3, [([1, 2, 3], 10, [2, 0, 0]), ([4, 5], 8, [1, 0, 0]), ([6], 5, [0, 0, 0])],
                     stop=0.3)
    [entry] = agreement([ours, stopped, same])
    assert entry["against"] == "chain K=3" and entry["max_gap"] == 0
    assert agreement([stopped, same]) == []  # no row that drafts all K: nothing to compare with
    # ... and the eval says so, naming the row and the settings that would give it a partner
    assert unchecked([ours.config, stopped.config, same.config]) == []
    (note,) = unchecked([stopped.config, same.config])
    assert note.startswith("vllm: vllm chain K=3 not checked") and "eval.chain.stops" in note
    warmer = Config("chain K=3 draft T 0.85", "chain", 3, draft_temperature=0.85)
    (note,) = unchecked([warmer, same.config])
    assert "eval.chain.draft_temperatures" in note
    (note,) = unchecked([same.config])
    assert "the embedded engine is not in eval.engines" in note


def test_at_temperature_above_0_the_check_judges_acceptance_in_standard_errors():
    """Sampled answers differ between engines: no request is compared token for token, and each position's pooled
    acceptance must agree within AGREEMENT_Z standard errors of the difference of two binomial shares."""
    def tally(engine, first_accepted: int, first: int, offset: int = 0):
        """100 requests of 10 steps (1,000 steps), each its own answer; the first `first` requests have
        `first_accepted` first drafts accepted, the others 4; 2 and 1 at positions 2 and 3."""
        tally = Tally(Config(f"{'vllm ' if engine == 'vllm' else ''}chain K=3", "chain", 3, engine=engine))
        for i in range(100):
            accepted = [first_accepted if i < first else 4, 2, 1]
            tally.add([i + offset], GenerationStats(steps=10, emitted=1, proposed=[10] * 3, accepted=accepted), "all")
        return tally

    ours = tally("embedded", 4, 0)
    close = tally("vllm", 4, 0, offset=100)  # other answers, the same law
    [entry] = agreement([ours, close], sampled=True)
    assert entry["same_answers"] == 0 and entry["max_z"] == 0 and conforms(entry) == []
    assert conforms(agreement([ours, close])[0])  # judged as at temperature 0, it fails: no answer alike
    # 0.40 against 0.43 at the first position over 1,000 steps a side: 1.4 standard errors, within the bound
    [entry] = agreement([ours, tally("vllm", 5, 30, offset=100)], sampled=True)
    assert 1.3 < entry["z"][0] < 1.5 and conforms(entry) == []
    # 0.40 against 0.10 (about what vLLM's CPU build accepted before its temperatures were repaired): 16 errors
    [entry] = agreement([ours, tally("vllm", 1, 100, offset=100)], sampled=True)
    (failure,) = conforms(entry)
    assert entry["max_z"] > 10 and "standard errors" in failure and "0.300" in failure


def test_per_request_means_average_what_each_request_drafted():
    requests = [GenerationStats(steps=4, emitted=8, proposed=[4, 4], accepted=[2, 1]),
                GenerationStats(steps=2, emitted=2, proposed=[2], accepted=[0]),
                GenerationStats(steps=3, emitted=3),  # drafted nothing (no n-gram match): tau 1, no acceptance
                GenerationStats()]  # no step at all (an answer of one token): not a request that decoded
    means = per_request_means(requests)
    assert means["tau_per_request"] == pytest.approx((2 + 1 + 1) / 3, abs=1e-4)  # rounded to 4 places
    assert means["acceptance_per_request"] == [pytest.approx(0.5 / 3, abs=1e-4), pytest.approx(0.25 / 3, abs=1e-4)]
    assert per_request_means([GenerationStats()]) == {}


def test_a_regeneration_records_its_engine_and_old_states_read_as_the_runtime():
    recipe = load_recipe(None, ["data.regenerated=x.jsonl"])
    assert settings_of(recipe)["engine"] == "runtime"
    vllm = settings_of(recipe, "vllm")
    assert vllm["engine"] == "vllm" and vllm["vllm_dtype"] == "auto"


def test_eval_engines_are_listed_once():
    assert load_recipe(None, ["eval.engines=[vllm, embedded, vllm]"]).eval.engines == ["vllm", "embedded"]
    with pytest.raises(Exception, match="engines"):
        load_recipe(None, ["eval.engines=[]"])


def test_data_parallel_engines_split_the_visible_gpus(monkeypatch):
    import torch

    from mtptrain.serving import vllm_engine

    monkeypatch.setattr(vllm_engine, "on_gpu", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    split = vllm_engine.data_parallel_devices
    assert split(VllmConfig(data_parallel_size=4, tensor_parallel_size=2)) == ["0,1", "2,3", "4,5", "6,7"]
    assert split(VllmConfig(data_parallel_size=8)) == [str(i) for i in range(8)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # a Slurm allocation's GPUs, as the job sees them
    assert split(VllmConfig(data_parallel_size=2)) == ["3", "5"]
    with pytest.raises(VllmError, match="needs 4 GPUs; this machine shows 2"):
        split(VllmConfig(data_parallel_size=2, tensor_parallel_size=2))
    monkeypatch.setattr(vllm_engine, "on_gpu", lambda: False)
    assert split(VllmConfig(data_parallel_size=2)) == [None, None]


def test_vllm_drafts_greedily_unless_asked_to_sample(tmp_path):
    from mtptrain.serving.vllm_engine import eagle3_speculation

    export = tmp_path / "export"
    plain = {"method": "eagle3", "model": str(export.resolve()), "num_speculative_tokens": 3}
    assert eagle3_speculation(export, 3) == eagle3_speculation(export, 3, "greedy") == plain  # vLLM's default
    assert eagle3_speculation(export, 3, "probabilistic") == {**plain, "draft_sample_method": "probabilistic"}
    assert load_recipe(None, []).vllm.draft_sample_method == "probabilistic"
    assert load_recipe(None, ["vllm.draft_sample_method=greedy"]).vllm.draft_sample_method == "greedy"
    with pytest.raises(RecipeError, match="vllm.draft_sample_method"):
        load_recipe(None, ["vllm.draft_sample_method=sampled"])
