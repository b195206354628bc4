"""mtptrain export: each format conforms to its table, loads back and drafts exactly as the head; impossible
exports fail with the reason; layer ids are numbered as each engine counts them; stitch keeps the target intact."""

import json
import re
from collections import Counter
from dataclasses import replace

import pytest
import torch
from conftest import make_tiny_llama, make_tokenizer
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from mtptrain.cli import app
from mtptrain.engine.generate import generate
from mtptrain.runtime.runner import open_runner
from mtptrain.config import ExportConfig
from mtptrain.export.run import export_head
from mtptrain.export.sidecar import ExportError
from mtptrain.export.conformance import check_export
from mtptrain.export.formats.eagle3 import sglang_layer_ids, vllm_layer_ids
from mtptrain.export.source import open_head
from mtptrain.heads import FrozenTarget
from mtptrain.export.source import load_head_directory
from mtptrain.heads.checkpoint import config_digest, save_head
from mtptrain.heads.spec import HeadSpec
from mtptrain.heads.vocab import DraftVocab
from mtptrain.runtime.capture import LayerCapture

from export_helpers import (EAGLE3, EAGLE31, SPECS, eval_args, identity, save_trained_like_head, target_dir,  # noqa: F401
                            target_model, write_prompts)

def drafts(model, head, spec, prompt: list[int], k: int = 3) -> list[list[int]]:
    """Every draft the head proposes while greedy decoding runs 24 tokens."""
    proposer = spec.family.chain(head, spec)
    seen, propose = [], proposer.propose

    def logged(tokens, kk):
        draft, probs = propose(tokens, kk)
        seen.append(list(draft))
        return draft, probs

    proposer.propose = logged
    generate(open_runner(model, capture=spec.layers), prompt, 24, proposer, k=min(k, spec.draft_positions + 2))
    return seen


@pytest.mark.parametrize("fmt, spec", [*SPECS.items(), ("deepseek-mtp", HeadSpec("mtp", last_layer=5, mtp_depths=2,
                                                                                  mtp_share=True, mtp_input="normed")),
                                        ("eagle3", EAGLE31), ("speculators", EAGLE31)],
                         ids=[*SPECS, "deepseek-mtp-shared", "eagle3-3.1-norms", "speculators-3.1-norms"])
def test_export_conforms_loads_back_and_drafts_the_same_tokens(fmt, spec, target_dir, tmp_path):
    head_dir = save_trained_like_head(target_dir, tmp_path / "head", spec)
    out = tmp_path / fmt
    summary = export_head(head_dir, out, ExportConfig(format=fmt, verifier=str(target_dir)))
    assert summary["tensors"] == len(load_file(out / "model.safetensors"))
    src = open_head(head_dir)
    assert check_export(out, src.target_config, src.target_layer_shapes()) == []
    readme = (out / "README.md").read_text()
    for fact in (identity(target_dir)["fingerprint"], "tiny-export", "## Serve", str(out.resolve())):
        assert fact in readme, fact

    model = target_model(target_dir)
    frozen = FrozenTarget.of(model)
    original, _ = load_head_directory(head_dir, frozen, identity(target_dir))
    exported, exported_spec = load_head_directory(out, frozen, identity(target_dir))
    assert exported_spec == spec
    for name, tensor in original.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name
    prompt = torch.randint(0, model.config.vocab_size, (7,), generator=torch.Generator().manual_seed(3)).tolist()
    ours, theirs = drafts(model, original, spec, prompt), drafts(model, exported, exported_spec, prompt)
    assert len(ours) > 5 and ours == theirs


def test_eval_command_loads_an_export_and_measures_it_as_the_head(target_dir, tmp_path):
    head_dir = save_trained_like_head(target_dir, tmp_path / "head", EAGLE3)
    export_head(head_dir, tmp_path / "export", ExportConfig(format="eagle3"))
    prompts = write_prompts(tmp_path / "p.jsonl", 2)
    measured = {}
    for name, head in (("head", head_dir), ("export", tmp_path / "export")):
        args = eval_args(target_dir, head, prompts, tmp_path / f"eval-{name}", "eval.methods=[chain,tree]")
        result = CliRunner().invoke(app, [*args, "--no-wandb"])
        assert result.exit_code == 0, result.output
        measured[name] = [(m["label"], m["tau"], m["acceptance"], m["tokens"])
                          for m in json.loads((tmp_path / f"eval-{name}" / "results.json").read_text())["methods"]]
    assert measured["head"] == measured["export"]  # the drafts themselves: the test above
    assert [label for label, *_ in measured["head"]] == ["baseline", "chain K=3", "tree N=6"]


def test_the_export_command_casts_checks_and_says_how_to_serve(target_dir, tmp_path):
    head_dir = save_trained_like_head(target_dir, tmp_path / "head", EAGLE3)
    out = tmp_path / "spec"
    result = CliRunner().invoke(app, ["export", *sets(head=head_dir, format="speculators", output_dir=out,
                                                      verifier="org/tiny-target", dtype="bfloat16",
                                                      speculative_tokens=4)])
    assert result.exit_code == 0, result.output
    assert "checked against mtptrain/export/specs/speculators.yaml" in result.output
    assert f"serve with vLLM:\n  vllm serve {out.resolve()}" in result.output
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-target"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    tensors = load_file(out / "model.safetensors")
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.int64
    bad = CliRunner().invoke(app, ["export", *sets(head=head_dir, output_dir=tmp_path / "x", dtype="int8")])
    assert bad.exit_code == 2 and "export.dtype" in bad.output and not (tmp_path / "x").exists()
    default = CliRunner().invoke(app, ["export", *sets(head=head_dir), "--set", f"train.output_dir={tmp_path / 'run'}"])
    assert default.exit_code == 0, default.output
    assert (tmp_path / "run" / "export" / "eagle3" / "model.safetensors").is_file()  # the default place and format


def sets(**fields) -> list[str]:
    return [a for key, value in fields.items() for a in ("--set", f"export.{key}={value}")]


def test_a_changed_fact_fails_one_line_of_the_table(target_dir, tmp_path):
    head_dir = save_trained_like_head(target_dir, tmp_path / "head", EAGLE3)
    out = tmp_path / "eagle3"
    export_head(head_dir, out, ExportConfig(format="eagle3"))
    src = open_head(head_dir)
    tensors = load_file(out / "model.safetensors")
    tensors["layers.0.hidden_norm.weight"] = tensors.pop("midlayer.hidden_norm.weight")
    tensors["t2d"] = tensors["t2d"].long()
    save_file(tensors, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [1, 2, 4]  # SGLang's numbering in vLLM's key
    del config["norm_before_residual"]
    (out / "config.json").write_text(json.dumps(config))
    assert check_export(out, src.target_config) == [
        "eagle3.yaml weights[2] midlayer.hidden_norm.weight: missing",
        "eagle3.yaml weights[17] t2d: dtype int64, expected bool",
        "eagle3: tensor layers.0.hidden_norm.weight is not in eagle3.yaml (engines would skip or reject it)",
        "eagle3.yaml config[16] eagle_aux_hidden_state_layer_ids: [1, 2, 4], expected [2, 3, 5] ([x + 1 for x in j])",
        "eagle3.yaml config[19] norm_before_residual: missing",
    ]


def test_feature_layers_become_each_engines_ids():
    """Ours: output of 0-based layer j. vLLM: the stream captured before layer j+1. SGLang: j, to which it adds 1
    (since sglang PR #25454 only when the first id is 1, taking other ids as they are)."""
    class Src:
        def __init__(self, layers, n=30):
            self.spec = HeadSpec("eagle3", feature_layers=layers)
            self.target_config = {"num_hidden_layers": n}

    assert vllm_layer_ids(Src([1, 14, 26])) == [2, 15, 27]  # both engines' defaults for N = 30
    assert sglang_layer_ids([1, 14, 26], "auto") == [1, 14, 26]
    assert sglang_layer_ids([3, 14, 26], "before-25454") == [3, 14, 26]
    assert sglang_layer_ids([3, 14, 26], "since-25454") == [4, 15, 27]
    with pytest.raises(ExportError, match="PR #25454"):
        sglang_layer_ids([3, 14, 26], "auto")
    with pytest.raises(ExportError, match="would get 1 added again"):
        sglang_layer_ids([0, 14, 26], "since-25454")
    for layers, reason in (([1, 14, 29], "last layer's output is never captured"),
                           ([1, 14, 14], "repeat a layer or are out of order"),
                           ([1, 14], "SGLang's fc takes exactly 3"), ([1, 7, 14, 26], "SGLang's fc takes exactly 3")):
        with pytest.raises(ExportError, match=reason):
            vllm_layer_ids(Src(layers))


def test_speculators_takes_feature_layers_that_only_sglang_would_read_ambiguously(target_dir, tmp_path):
    spec = HeadSpec("eagle3", last_layer=5, feature_layers=[2, 3, 4], ttt_steps=2, draft_vocab_size=64)
    head_dir = save_trained_like_head(target_dir, tmp_path / "head", spec)
    export_head(head_dir, tmp_path / "spec", ExportConfig(format="speculators", verifier="org/m"))
    assert json.loads((tmp_path / "spec" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [3, 4, 5]
    with pytest.raises(ExportError, match="PR #25454"):
        export_head(head_dir, tmp_path / "sglang", ExportConfig(format="eagle3"))
    export_head(head_dir, tmp_path / "sglang", ExportConfig(format="eagle3", sglang_ids="since-25454"))
    config = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 4, 5]


def test_our_layer_j_is_transformers_hidden_states_j_plus_1(target_dir):
    """The numbering the conversion starts from. (vLLM and SGLang capture hidden_states + residual on entering
    layer i, which is transformers' hidden_states[i]: read in their source, docs/export.md.)"""
    model = target_model(target_dir)
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    capture = LayerCapture(model.model.layers, [0, 1, 2])
    out = model(ids, output_hidden_states=True)
    for j, states in capture.take().items():
        assert torch.equal(states, out.hidden_states[j + 1]), j


@pytest.mark.parametrize("fmt, spec, reason", [
    ("eagle3", SPECS["deepseek-mtp"], "a mtp head cannot be exported as eagle3"),
    ("eagle", EAGLE3, "a eagle3 head cannot be exported as eagle .*formats for eagle3 heads: eagle3, speculators"),
    ("eagle", HeadSpec("eagle", last_layer=5), "RMSNorms restored.*head.norms=stripped"),
    ("deepseek-mtp", HeadSpec("mtp", last_layer=5, mtp_input="raw"), "pre-norm states.*head.mtp_input=normed"),
    ("deepseek-mtp", HeadSpec("mtp", norms="stripped", last_layer=5), "norms stripped"),
    ("deepseek-mtp", HeadSpec("eagle", last_layer=5), "a eagle head cannot be exported as deepseek-mtp"),
    ("onnx", EAGLE3, "export.format: Input should be 'eagle3', 'speculators', 'eagle' or 'deepseek-mtp'"),
])
def test_a_format_that_cannot_express_the_head_is_refused_with_the_reason(fmt, spec, reason, target_dir, tmp_path):
    head_dir = save_trained_like_head(target_dir, tmp_path / "head", spec)
    result = CliRunner().invoke(app, ["export", *sets(head=head_dir, format=fmt, output_dir=tmp_path / "out")])
    assert result.exit_code == (2 if fmt == "onnx" else 1)
    assert result.output.startswith("error: ")
    assert re.search(reason, result.output), result.output
    assert not (tmp_path / "out").exists()


def test_a_qwen2_layer_is_refused_by_the_llama_eagle3_formats(tmp_path):
    """Qwen2 layers carry q/k/v biases that LlamaForCausalLMEagle3 has no parameter for."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    target = tmp_path / "qwen2"
    Qwen2ForCausalLM(config).save_pretrained(target)
    spec = HeadSpec("eagle3", last_layer=5, feature_layers=[1, 2, 4], draft_vocab_size=32)
    model = Qwen2ForCausalLM.from_pretrained(target)
    head = spec.family.build(spec, FrozenTarget.of(model), DraftVocab.from_counts(Counter(), 32, 300))
    save_head(tmp_path / "head", head, spec, identity(target), {"train": {"recipe": {"target": {"model": str(target)}}}})
    with pytest.raises(ExportError, match=r"qwen2 layer with tensors a Llama layer lacks \(self_attn.k_proj.bias"):
        export_head(tmp_path / "head", tmp_path / "out", ExportConfig(format="eagle3"))


def test_export_replaces_an_earlier_export_but_never_other_files(target_dir, tmp_path):
    head_dir = save_trained_like_head(target_dir, tmp_path / "head", EAGLE3)
    out = tmp_path / "out"
    export_head(head_dir, out, ExportConfig(format="eagle3"))
    export_head(head_dir, out, ExportConfig(format="speculators", verifier="org/model"))
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "eagle3"
    export_head(out, tmp_path / "again", ExportConfig(format="eagle3"))  # an export exports again, to the same tensors
    first = load_file(tmp_path / "again" / "model.safetensors")
    export_head(head_dir, tmp_path / "direct", ExportConfig(format="eagle3"))
    assert first.keys() == load_file(tmp_path / "direct" / "model.safetensors").keys()
    assert all(torch.equal(t, load_file(tmp_path / "direct" / "model.safetensors")[k]) for k, t in first.items())
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ExportError, match="holds notes.txt besides an earlier export"):
        export_head(head_dir, mine, ExportConfig(format="eagle3"))
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_stitch_adds_the_mtp_layers_to_a_copy_of_the_target(target_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    head_dir = save_trained_like_head(target_dir, tmp_path / "head", SPECS["deepseek-mtp"])
    export_head(head_dir, tmp_path / "mtp", ExportConfig(format="deepseek-mtp"))
    result = CliRunner().invoke(app, ["stitch", str(tmp_path / "mtp"), "--target", str(target_dir),
                                      "--out", str(tmp_path / "stitched")])
    assert result.exit_code == 0, result.output
    stitched = tmp_path / "stitched"
    config = json.loads((stitched / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 2 and config["num_hidden_layers"] == 6
    index = json.loads((stitched / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.layers.6.eh_proj.weight"] == "model-mtp.safetensors"
    assert index["model.layers.7.shared_head.norm.weight"] == "model-mtp.safetensors"
    assert index["model.layers.5.mlp.up_proj.weight"] == "model.safetensors"
    assert "num_nextn_predict_layers" not in json.loads((target_dir / "config.json").read_text())
    # The target itself is unchanged: same logits from the stitched checkpoint
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    before = target_model(target_dir)(ids).logits
    after = AutoModelForCausalLM.from_pretrained(stitched, dtype=torch.float32).eval()(ids).logits
    assert torch.equal(before, after)
    # ...and the stitched directory loads as the head
    model = target_model(target_dir)
    loaded, spec = load_head_directory(stitched, FrozenTarget.of(model), identity(target_dir))
    original, _ = load_head_directory(head_dir, FrozenTarget.of(model), identity(target_dir))
    assert spec == SPECS["deepseek-mtp"]
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in original.state_dict().items())
    again = CliRunner().invoke(app, ["stitch", str(tmp_path / "mtp"), "--target", str(stitched),
                                     "--out", str(tmp_path / "twice")])
    assert again.exit_code == 1 and "already has 2 MTP layer(s)" in again.output
    modes = {p.name: p.stat().st_mode & 0o777 for p in stitched.iterdir()}
    assert modes["model-mtp.safetensors"] == modes["config.json"] == 0o644  # a server under another user reads them
    with pytest.raises(ExportError, match="besides an earlier export"):  # a stitched checkpoint is never replaced
        export_head(head_dir, stitched, ExportConfig(format="deepseek-mtp"))
    assert (stitched / "model-mtp.safetensors").is_file()


def test_another_checkpoint_of_the_same_shape_is_refused_as_target(target_dir, tmp_path):
    """Its embedding would go into the export: the fingerprint must be the head's."""
    other = tmp_path / "other"
    make_tiny_llama(target_model(target_dir).config.vocab_size, seed=9, layers=6, initializer_range=0.2).save_pretrained(other)
    make_tokenizer().save_pretrained(other)
    head_dir = save_trained_like_head(target_dir, tmp_path / "head", SPECS["deepseek-mtp"])
    with pytest.raises(ExportError, match="has fingerprint .* but the head was trained for"):
        export_head(head_dir, tmp_path / "out", ExportConfig(format="deepseek-mtp", target=str(other)))
    export_head(head_dir, tmp_path / "mtp", ExportConfig(format="deepseek-mtp"))
    result = CliRunner().invoke(app, ["stitch", str(tmp_path / "mtp"), "--target", str(other),
                                      "--out", str(tmp_path / "stitched")])
    assert result.exit_code == 1 and "has fingerprint" in result.output and not (tmp_path / "stitched").exists()


def test_mtp_depth_one_reads_the_final_normed_state_when_normed():
    """What DeepSeek engines feed an MTP layer: the target's output after its final norm."""
    model = make_tiny_llama(100)
    frozen = FrozenTarget.of(model)
    spec = HeadSpec("mtp", last_layer=3, mtp_depths=1)
    torch.manual_seed(0)
    normed = spec.family.build(replace(spec, mtp_input="normed"), frozen)
    raw = spec.family.build(replace(spec, mtp_input="raw"), frozen)
    raw.load_state_dict(normed.state_dict())
    hidden, ids = torch.randn(1, 5, 64) * 3, torch.randint(0, 100, (1, 5))
    assert torch.allclose(normed.step(1, hidden, ids), raw.step(1, frozen.final_norm(hidden), ids))
    assert not torch.allclose(normed.step(1, hidden, ids), raw.step(1, hidden, ids))


def test_every_table_row_names_a_listed_source():
    import yaml

    from mtptrain.export.conformance import SPECS as TABLES

    for path in sorted(TABLES.glob("*.yaml")):
        table = yaml.safe_load(path.read_text())
        keys = set(table["sources"])
        for row in table["weights"] + table["config"]:
            assert row.get("source"), (path.name, row)
            assert row["source"].split()[0].rstrip(";") in keys, (path.name, row)


@pytest.mark.real_model
def test_the_shipped_head_drafts_the_same_tokens_from_its_exports(tmp_path):
    from mtptrain.heads.checkpoint import PRETRAINED_HEAD
    from mtptrain.config import TargetConfig
    from mtptrain.target import load_target

    target = load_target(TargetConfig())
    frozen = FrozenTarget.of(target.model)
    head, spec = load_head_directory(PRETRAINED_HEAD, frozen, target.identity())
    text = target.tokenizer.apply_chat_template([{"role": "user", "content": "Name three uses of copper."}],
                                                add_generation_prompt=True, tokenize=False)
    prompt = target.tokenizer(text, add_special_tokens=False)["input_ids"]
    ours = drafts(target.model, head.float(), spec, list(prompt))
    assert len(ours) > 5
    shipped = json.loads((PRETRAINED_HEAD / "eval.json").read_text())
    chain = next(m for m in shipped["methods"] if m["label"] == "chain K=3")
    quoted = f"| chain K=3 | {chain['tau']:.2f} | {chain['speedup']:.2f}x | {chain['acceptance'][0]:.2f} "
    assert chain["tau"] > 1.5 and chain["speedup"] > 1.0  # the reference run's head, which pays
    for fmt in ("eagle3", "speculators"):
        summary = export_head(PRETRAINED_HEAD, tmp_path / fmt, ExportConfig(format=fmt))
        readme = (tmp_path / fmt / "README.md").read_text()
        assert quoted in readme  # the shipped eval.json, quoted
        assert f"{spec.ttt_steps} training-time-test steps, draft vocabulary {spec.draft_vocab_size} tokens" in readme
        assert summary["notes"] and all(mode == 0o644 for mode in
                                        (p.stat().st_mode & 0o777 for p in (tmp_path / fmt).iterdir()))
        exported, exported_spec = load_head_directory(tmp_path / fmt, frozen, target.identity())
        assert drafts(target.model, exported.float(), exported_spec, list(prompt)) == ours, fmt


def test_an_export_sidecar_naming_weights_outside_the_export_is_refused(target_dir, tmp_path):
    import shutil

    from mtptrain.export.formats import read_export

    out = tmp_path / "export"
    export_head(save_trained_like_head(target_dir, tmp_path / "head", EAGLE3), out, ExportConfig(format="eagle3"))
    sidecar = json.loads((out / "mtptrain.json").read_text())
    outside = shutil.copy(out / "model.safetensors", tmp_path / "elsewhere.safetensors")
    for name in (str(outside), "../elsewhere.safetensors"):
        (out / "mtptrain.json").write_text(json.dumps({**sidecar, "weights": name}))
        with pytest.raises(ExportError, match="outside") as err:
            read_export(out)
        assert "mtptrain.json" in str(err.value) and "hostile" in str(err.value)


@pytest.mark.parametrize("fmt", ["eagle3", "eagle"])
def test_every_export_checks_the_recorded_target_without_export_target(fmt, target_dir, tmp_path):
    """Formats that copy no target weights were exported with no check: an export must never carry a fingerprint
    that no check has seen."""
    head_dir = save_trained_like_head(target_dir, tmp_path / "head", SPECS[fmt])
    config = json.loads((head_dir / "config.json").read_text())
    config["target"]["fingerprint"] = "f" * 32
    config["sha256"]["config"] = config_digest(config)  # as trained for that target, not edited after training
    (head_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="has fingerprint .* but the head was trained for") as err:
        export_head(head_dir, tmp_path / "out", ExportConfig(format=fmt))
    assert "f" * 32 in str(err.value) and not (tmp_path / "out").exists()
