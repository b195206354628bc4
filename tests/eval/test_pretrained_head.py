"""The head shipped in pretrained/: produced by recipes/reference.yaml, small enough for the repository, and used
by `mtptrain eval` on the embedded default when nothing has been trained."""

import json

import pytest
from safetensors import safe_open

from mtptrain.eval.run import run_eval
from mtptrain.heads.checkpoint import PRETRAINED_HEAD, head_directory
from mtptrain.config import load_recipe, validate_recipe
from mtptrain.data.regenerate import HOW

REFERENCE = "recipes/reference.yaml"
# The recipe as the shipped head's config records it, but for the keys that only say where files are, or how the
# regeneration's work was cut into batches (a finished regeneration stands whatever its batch size).
TRAINING_SECTIONS = ("target", "data", "regenerate", "precompute", "head", "train")
# regenerate.engine came later: the shipped head's data was decoded by the runtime, which auto picks on a CPU.
PATHS = {"data": {"regenerated"}, "regenerate": set(HOW) | {"engine"}, "precompute": {"output_dir"},
         "train": {"features", "output_dir"}}


def shipped_config() -> dict:
    return json.loads((PRETRAINED_HEAD / "config.json").read_text())


def test_shipped_head_was_trained_by_the_reference_recipe():
    # The recipe as it reads back today: the head's flat section in its family's, fields added since at their defaults.
    recorded = validate_recipe(shipped_config()["train"]["recipe"]).model_dump(mode="json")
    reference = load_recipe(REFERENCE).model_dump(mode="json")
    for section in TRAINING_SECTIONS:
        skipped = PATHS.get(section, ())
        expected = {k: v for k, v in reference[section].items() if k not in skipped}
        assert {k: v for k, v in recorded[section].items() if k not in skipped} == expected, \
            f"{section}: the shipped head was trained with other settings"


def test_shipped_head_is_small_and_bfloat16():
    weights = PRETRAINED_HEAD / "model.safetensors"
    assert weights.stat().st_size < 25 * 2**20
    with safe_open(str(weights), "pt") as f:
        dtypes = {str(f.get_slice(name).get_dtype()) for name in f.keys()}
    assert "BF16" in dtypes and not dtypes & {"F32", "F64"}, dtypes


def test_eval_falls_back_to_the_shipped_head_only_on_the_embedded_default(tmp_path):
    untrained = [f"train.output_dir={tmp_path / 'none'}"]
    assert head_directory(load_recipe(None, untrained)) == PRETRAINED_HEAD
    other = load_recipe(None, untrained + [f"target.model={tmp_path / 'model'}"])
    assert head_directory(other) == tmp_path / "none" / "head"
    explicit = load_recipe(None, untrained + [f"eval.head={tmp_path / 'h'}"])
    assert head_directory(explicit) == tmp_path / "h"


@pytest.mark.real_model
def test_eval_on_the_embedded_default_measures_the_shipped_head(tmp_path):
    recipe = load_recipe(None, [f"train.output_dir={tmp_path / 'none'}", "eval.methods=[chain]", "eval.k=[3]",
                                "eval.max_prompts=3", "eval.max_turns=1", "eval.max_new_tokens=48", "eval.repeats=1",
                                f"eval.output_dir={tmp_path / 'eval'}", "tracking.wandb=disabled"])
    results = run_eval(recipe, show_progress=False)
    assert results["head"]["path"] == str(PRETRAINED_HEAD)
    chain = next(m for m in results["methods"] if m["method"] == "chain")
    exactness = chain["exactness"]  # bfloat16 where this machine runs it faster: near-ties are reported
    assert exactness["checked"] == 3 and not exactness["failures"]
    assert exactness["identical"] + len(exactness["near_ties"]) == 3
    # The shipped head reaches chain tau 2.11 on all of MT-bench (docs/reference-run.md), the first reference run's
    # head 1.28 on these three questions; a head that stopped accepting would fall to 1.0.
    assert chain["tau"] > 1.5, chain
