"""The `mtptrain` command line. Each command parses, loads the recipe, and calls one run_<stage>.

Imports: this module imports at its top only typer, the standard library and mtptrain.errors (which imports
nothing), so that `mtptrain --help` and a mistyped option answer in ~0.1 s. Every import inside a function in
this module follows one rule, with no comment of its own: a module that --help does not need is imported in
the command that uses it (or in the helper the command calls). The stages pull in torch (~0.9 s) and more,
the logging set-up (mtptrain.dist) torch too, and the recipe schema (mtptrain.config, which mtptrain.tracking
and mtptrain.slurm import) pydantic and yaml (~0.1 s).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Optional

import typer

from mtptrain.errors import MtptrainError

app = typer.Typer(
    help="Train speculative-decoding draft heads (MTP / EAGLE) for a target LLM.\n\n"
    "Every command reads a YAML recipe (see recipes/) and takes repeatable --set section.key=value "
    "overrides, validated like the recipe itself.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

LOG_LEVELS = ("debug", "info", "warning", "error")


@app.callback()
def main(log_level: Annotated[str, typer.Option(
        help=f"What this project's packages log ({', '.join(LOG_LEVELS)}); other libraries log warnings.")] = "info"
         ) -> None:
    """The one logging set-up of every command."""
    from mtptrain.dist import DistInfo, setup_logging

    if log_level.lower() not in LOG_LEVELS:
        typer.echo(f"error: --log-level {log_level!r}: use one of {', '.join(LOG_LEVELS)}", err=True)
        raise typer.Exit(2)
    setup_logging(DistInfo.from_env(), getattr(logging, log_level.upper()))


RecipeOpt = Annotated[Optional[Path], typer.Option("--recipe", "-r", help="YAML recipe; defaults apply when omitted.")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", "-s", help="Override, e.g. --set data.max_conversations=50 (repeatable).")]


def _recipe(recipe: Optional[Path], overrides: Optional[list[str]]):
    from mtptrain.config import RecipeError, load_recipe

    try:
        return load_recipe(recipe, overrides or [])
    except RecipeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


@app.command()
def regenerate(recipe: RecipeOpt = None, overrides: SetOpt = None,
               progress: Annotated[bool, typer.Option(help="Show the progress bar.")] = True) -> None:
    """Rewrite the assistant turns of the recipe's conversations with the target itself (self-distillation).

    Reads data.source (at most data.max_conversations rows), keeps the user turns and asks the target for every
    answer in order, batched (regenerate.batch_size rows, each refilled as soon as its answer ends), greedy or
    sampled (regenerate.temperature), each answer at most regenerate.max_new_tokens and the whole conversation
    within data.max_length. Writes data.regenerated (JSONL, same ids as the source); precompute then reads it in
    place of the original answers. On the native runtime it also keeps the target's states at precompute.layers
    for every conversation (regenerate.keep_states, in <data.regenerated>.states/), which precompute then copies
    instead of running the target again. Rerunning the same command resumes after the last finished group of
    conversations.
    """
    from mtptrain.data.regenerate import format_summary, run_regenerate

    cfg = _recipe(recipe, overrides)
    typer.echo(format_summary(_guarded(lambda: run_regenerate(cfg, show_progress=progress))))


@app.command("self-prompts")
def self_prompts(recipe: RecipeOpt = None, overrides: SetOpt = None,
                 progress: Annotated[bool, typer.Option(help="Show the progress bar.")] = True) -> None:
    """Sample user requests from the target itself, to regenerate answers to (Magpie, arXiv:2406.08464).

    The target is given its chat template up to a user turn's text and samples the request
    (self_prompts.temperature, at most self_prompts.max_new_tokens); self_prompts.count are sampled in
    batches of self_prompts.batch_size. Requests cut by the token budget, shorter than self_prompts.min_chars
    or repeating one already kept are dropped. Writes self_prompts.output (JSONL of one-turn conversations):
    set data.source to it for `mtptrain regenerate`. Rerunning the same command resumes after the last finished
    group.
    """
    from mtptrain.data.self_prompts import format_summary, run_self_prompts

    cfg = _recipe(recipe, overrides)
    typer.echo(format_summary(_guarded(lambda: run_self_prompts(cfg, show_progress=progress))))


@app.command()
def precompute(recipe: RecipeOpt = None, overrides: SetOpt = None,
               no_wandb: Annotated[bool, typer.Option("--no-wandb", help="Do not log to W&B.")] = False,
               progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True) -> None:
    """Run the target over the recipe's conversations and store its hidden states.

    Writes sharded safetensors and a manifest to precompute.output_dir. Rerunning the same
    command resumes: complete shards are kept. Under torchrun or srun each rank computes a
    disjoint set of shards.
    """
    from mtptrain.features.precompute import format_summary, run_precompute

    cfg = _recipe(recipe, overrides)
    summary = _guarded(lambda: run_precompute(cfg, show_progress=progress, wandb="disabled" if no_wandb else None))
    if summary["rank"] == 0 or summary["wrote_manifest"]:
        typer.echo(format_summary(summary))


@app.command()
def train(recipe: RecipeOpt = None, overrides: SetOpt = None,
          no_wandb: Annotated[bool, typer.Option("--no-wandb", help="Log to metrics.jsonl only, not to W&B.")] = False,
          progress: Annotated[bool, typer.Option(help="Show the progress bar.")] = True) -> None:
    """Train a draft head (head.kind: eagle, eagle3, mtp) on a precomputed feature store, or online.

    With train.online=true the target runs inside the trainer and computes each micro-batch's hidden states
    (no store on disk; the same batches and loss as offline, the target's forward repeated every epoch).

    DeepSpeed does the optimisation (ZeRO stage, precision, accumulation and clipping from the recipe).
    Checkpoints go to train.output_dir/checkpoints; rerunning the same command resumes from the latest
    one. The trained head is exported to train.output_dir/head. W&B logs offline unless credentials are
    configured. Several processes: torchrun --nproc-per-node N -m mtptrain.cli train ... or the deepspeed
    launcher.
    """
    from mtptrain.train.trainer import run_train

    cfg = _recipe(recipe, overrides)
    summary = _guarded(lambda: run_train(cfg, wandb="disabled" if no_wandb else None, show_progress=progress))
    if summary["rank"] == 0:
        typer.echo(format_train_summary(summary))


def format_train_summary(summary: dict) -> str:
    if summary.get("stopped"):
        return (f"stopped on request at step {summary['steps']} (a STOP file in train.output_dir): checkpoint "
                f"{summary['checkpoint']}; run the same command again to resume")
    accuracy = "  ".join(f"{k.removeprefix('val/')} {v:.3f}" for k, v in summary.items() if k.startswith("val/acc_"))
    lines = [f"trained {summary['steps']} steps at {summary['tokens_per_second']:,.0f} tokens/s per process "
             f"(data wait {summary['data_wait_fraction']:.1%})",
             f"validation top-1 agreement per draft position: {accuracy or 'no validation split'}"]
    for kind in ("chain", "tree"):
        if f"val/tau_{kind}" in summary:
            accepted = " ".join(f"{v:.3f}" for k, v in summary.items() if k.startswith(f"val/accept_{kind}_"))
            lines.append(f"drafting in the engine, last validation: {kind} tau {summary[f'val/tau_{kind}']:.3f}, "
                         f"acceptance per position {accepted}")
    if "selected" in summary:
        lines.append(f"exported the head of step {summary['selected']['step']} (best validated chain tau "
                     f"{summary['selected']['tau_chain']:.3f})")
    lines.append(f"head: {summary['head']}   last checkpoint: {summary['checkpoint']}")
    return "\n".join(lines)


@app.command("eval")
def evaluate(recipe: RecipeOpt = None, overrides: SetOpt = None,
             no_wandb: Annotated[bool, typer.Option("--no-wandb", help="Do not log the results to W&B.")] = False,
             progress: Annotated[bool, typer.Option(help="Show the progress bar.")] = True) -> None:
    """Measure speculative decoding against plain decoding: tau, acceptance per position, speedup.

    Every method of eval.methods (ngram, suffix, chain, tree, draft) is run with each draft length K of eval.k
    (trees: each node budget of eval.tree.budgets) on the same prompts as the autoregressive baseline, in one
    run: by default the 80 MT-bench questions, second turns asked after the model's own first answers.
    chain and tree draft with the head at <train.output_dir>/head, or eval.head; on the embedded default with no
    head trained yet, with the head shipped in pretrained/ (trained by recipes/reference.yaml). At temperature 0
    every output is checked against the baseline token for token; a divergence that is not a float near-tie
    fails the command (exit code 3). Writes results.json, report.md and PNG plots to eval.output_dir.
    """
    from mtptrain.eval.exactness import exactness_failures
    from mtptrain.eval.report import format_results
    from mtptrain.eval.run import run_eval

    cfg = _recipe(recipe, overrides)
    results = _guarded(lambda: run_eval(cfg, wandb="disabled" if no_wandb else None, show_progress=progress))
    typer.echo(format_results(results))
    typer.echo(f"report: {Path(cfg.eval.output_dir) / 'report.md'}")
    failures = exactness_failures(results)
    if failures:
        typer.echo(f"error: {len(failures)} outputs differ from the baseline beyond a near-tie: "
                   + "; ".join(failures[:5]), err=True)
        raise typer.Exit(3)


@app.command()
def pipeline(recipe: RecipeOpt = None, overrides: SetOpt = None,
             no_wandb: Annotated[bool, typer.Option("--no-wandb", help="Do not log to W&B.")] = False,
             progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True) -> None:
    """Run the recipe end to end: regenerate (when data.regenerated is set), precompute (unless train.online), train,
    eval.

    Each stage is the command of the same name with the same recipe and overrides, so a rerun after an
    interruption resumes where it stopped: finished groups of regenerated conversations, feature shards and
    training steps are kept, and eval (which measures, so has nothing to resume) runs again.
    """
    from mtptrain.tracking import pipeline_group

    cfg = _recipe(recipe, overrides)
    overrides = [*(overrides or []), f"tracking.group={pipeline_group(cfg)}"]  # one W&B group for this run's jobs
    if cfg.data.regenerated:
        typer.echo("== regenerate")
        regenerate(recipe, overrides, progress)
    if not cfg.train.online:  # online training computes the features itself
        typer.echo("== precompute")
        precompute(recipe, overrides, no_wandb, progress)
    typer.echo("== train")
    train(recipe, overrides, no_wandb, progress)
    typer.echo("== eval")
    evaluate(recipe, overrides, no_wandb, progress)


@app.command("export")
def export(recipe: RecipeOpt = None, overrides: SetOpt = None) -> None:
    """Write a trained head in a format a serving engine loads, with a README, checked against the format's table.

    export.format: eagle3 (EAGLE-3 head; SGLang and vLLM draft model), speculators (EAGLE-3 head; `vllm serve
    <dir>`), eagle (EAGLE-1/2 head trained with head.norms=stripped; official EAGLE code and SGLang), deepseek-mtp
    (MTP head; DeepSeek-V3 MTP layers, see `mtptrain stitch`). The head is export.head, or the one `mtptrain eval`
    would use; the directory is export.output_dir, or <train.output_dir>/export/<format>. Every export is checked
    against mtptrain/export/specs/<format>.yaml before it replaces an earlier one; `mtptrain eval --set
    eval.head=<export>` drafts with it exactly as with the head. Example:
    mtptrain export --set export.head=runs/x/train/head --set export.format=speculators
    """
    from mtptrain.export.run import run_export

    cfg = _recipe(recipe, overrides)
    summary = _guarded(lambda: run_export(cfg))
    typer.echo(f"exported as {summary['format']} to {summary['out']}: {summary['tensors']} tensors, "
               f"{summary['bytes'] / 2**20:.1f} MiB; checked against mtptrain/export/specs/{summary['format']}.yaml")
    for note in summary["notes"]:
        typer.echo(f"  {note}")
    for engine, command in summary["serve"]:
        typer.echo(f"serve with {engine}:\n  {command}")


@app.command()
def stitch(export_dir: Annotated[Path, typer.Argument(help="A deepseek-mtp export (mtptrain export --set export.format=deepseek-mtp).")],
           target: Annotated[Path, typer.Option(help="The target's local checkpoint directory (safetensors).")],
           out: Annotated[Path, typer.Option(help="New directory: the target's checkpoint plus its MTP layers.")]) -> None:
    """Write a copy of the target checkpoint with the trained MTP layers added, as DeepSeek-V3 ships them.

    The MTP layers become model.layers.N.. (N = the target's layer count) in model-mtp.safetensors, listed in
    model.safetensors.index.json, and config.json gains num_nextn_predict_layers. The target's weight files are
    hard-linked where possible, never changed.
    """
    from mtptrain.export.stitch import stitch_mtp

    summary = _guarded(lambda: stitch_mtp(export_dir, target, out))
    typer.echo(f"stitched {summary['mtp_layers']} MTP layer(s) ({summary['mtp_tensors']} tensors) into a copy of "
               f"{target} ({summary['target_tensors']} tensors): {summary['out']}")


speculators_app = typer.Typer(
    help="vLLM's speculators (0.9.0) as a peer trainer: our store in its offline format, its checkpoint as our head.",
    no_args_is_help=True)
app.add_typer(speculators_app, name="speculators")


@speculators_app.command("data")
def speculators_data(out: Annotated[Path, typer.Option(help="New directory for speculators' --data-path.")],
                     recipe: RecipeOpt = None, overrides: SetOpt = None,
                     progress: Annotated[bool, typer.Option(help="Show the progress bar.")] = True) -> None:
    """Write the recipe's feature store (train.features) as speculators' offline training data.

    A `datasets` directory (input_ids, loss_mask, seq_len; the train split, then the validation split), one
    hidden_states/hs_<i>.safetensors per sample ([T, 4, H]: the head's feature layers, then the last layer before
    the final norm; token_ids) and the draft vocabulary the recipe's head would use (d2t-<N>.npy, t2d-<N>.npy):
    speculators trains eagle3 heads, so a head section of another kind stands for eagle3's defaults.
    Prints the arguments its trainer needs (scripts/speculators_train_cpu.py runs it on a CPU). Rerunning keeps
    the sample files already written.
    """
    from mtptrain.config import Eagle3HeadConfig
    from mtptrain.features.store import load_manifest
    from mtptrain.heads.spec import HeadSpec
    from mtptrain.peers.speculators import write_offline_data

    cfg = _recipe(recipe, overrides)
    head = cfg.head if isinstance(cfg.head, Eagle3HeadConfig) else Eagle3HeadConfig()

    def run():
        if not isinstance(cfg.train.features, str):
            raise MtptrainError(f"train.features lists {len(cfg.train.features)} stores; `mtptrain speculators data` "
                              "writes one store: set train.features to one of them")
        spec = HeadSpec.of(head, load_manifest(Path(cfg.train.features)))
        return write_offline_data(Path(cfg.train.features), out, list(spec.feature_layers), spec.draft_vocab_size,
                                  progress)

    summary = _guarded(run)
    typer.echo(f"wrote {summary['rows']:,} samples ({summary['train']:,} train, {summary['validation']:,} "
               f"validation; {summary['tokens']:,} tokens) to {out}")
    typer.echo("speculators' trainer takes: --data-path {} --train-data-ratio {:.10f} --target-layer-ids {} "
               "--draft-vocab-size {}".format(out, summary["train_data_ratio"],
                                              " ".join(map(str, summary["target_layer_ids"])),
                                              summary["draft_vocab_size"]))


@speculators_app.command("import")
def speculators_import(checkpoint: Annotated[Path, typer.Argument(help="A checkpoint directory speculators saved.")],
                       out: Annotated[Path, typer.Option(help="New head directory (eval it with eval.head).")],
                       recipe: RecipeOpt = None, overrides: SetOpt = None) -> None:
    """Read a speculators EAGLE-3 checkpoint as an mtptrain head trained for the recipe's target.

    The head's settings come from the checkpoint's config (feature layers = eagle_aux_hidden_state_layer_ids - 1,
    TTT steps = its speculative tokens, fc_norm / norm_output); the head records the target's identity, so
    `mtptrain eval --set eval.head=<out>` measures it exactly as a head trained here.
    """
    from mtptrain.peers.speculators import import_checkpoint

    cfg = _recipe(recipe, overrides)
    config = _guarded(lambda: import_checkpoint(checkpoint, cfg.target, out))
    head = config["head"]
    typer.echo(f"imported {checkpoint} to {out}: eagle3, feature layers {head['feature_layers']}, "
               f"{head['ttt_steps']} TTT steps, draft vocabulary {head['draft_vocab_size']}, fc_norm "
               f"{head['fc_norm']}, norm_output {head['norm_output']}")


@app.command()
def slurm(stage: Annotated[str, typer.Argument(help="precompute, train, eval, or pipeline (all three, chained).")],
          recipe: RecipeOpt = None, overrides: SetOpt = None,
          dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the scripts; submit nothing.")] = False) -> None:
    """Render the sbatch script of a stage from the recipe (its slurm section) and submit it.

    pipeline submits precompute, train and eval, each after the previous one succeeded. The scripts, the
    resolved recipe they run and the job logs go to slurm.output_dir (default <train.output_dir>/slurm). The
    train job asks Slurm for a warning signal slurm.warning_seconds before its time limit, checkpoints on it,
    requeues itself and resumes; precompute resumes by keeping complete shards.
    """
    from mtptrain.slurm import STAGES, render, slurm_dir, submit

    if stage not in (*STAGES, "pipeline"):
        typer.echo(f"error: unknown stage {stage!r}: use {', '.join(STAGES)} or pipeline", err=True)
        raise typer.Exit(2)
    cfg = _recipe(recipe, overrides)
    stages = STAGES if stage == "pipeline" else (stage,)
    for line in _guarded(lambda: _memory_plan(cfg, stages)):
        typer.echo(line)
    if dry_run:
        for name in stages:
            typer.echo(f"# ---- {name}.sbatch\n" + render(cfg, name, slurm_dir(cfg) / "recipe.yaml"))
        return
    for name, job, script in _guarded(lambda: submit(cfg, stage)):
        typer.echo(f"submitted {name} as job {job}: {script}")
    typer.echo(f"logs: {slurm_dir(cfg) / 'logs'}")


def _memory_plan(cfg, stages: tuple[str, ...]) -> list[str]:
    """What the fullest GPU of each GPU stage holds, or PlanError where a GPU cannot hold its stage."""
    from mtptrain.memory_plan import check_plan, summary
    from mtptrain.target.parts import load_config
    from mtptrain.target.source import TargetError

    on_gpus = tuple(name for name in stages if getattr(cfg.slurm, name).gpus_per_node > 0)
    if not on_gpus:
        return []
    try:
        config = load_config(cfg.target)
    except TargetError as exc:
        return [f"memory plan not checked: the target's config did not load ({exc})"]
    gib = cfg.slurm.gpu_memory_gib
    return [f"memory plan, {line}" for line in summary(check_plan(cfg, config, gib, on_gpus), gib)]


@app.command()
def measure(recipe: RecipeOpt = None, overrides: SetOpt = None) -> None:
    """Time the runtime's products and attention kernels on the target's shapes again, then the products' prefetch
    on the target's own forwards, and cache the results.

    Each stage measures once per machine, CPU, torch version and thread count, and caches the timings in
    <MTPTRAIN_CACHE or ~/.cache/mtptrain>/runtime-choice.json (the prefetch in runtime-prefetch.json). Run this
    after a change the key does not see (a BIOS or VM setting, a new compiler) or to replace a doubtful choice;
    run it on a quiet machine: timings taken while other processes keep the cores busy are not cached (exit
    code 1).
    """
    from mtptrain.io import cache_root
    from mtptrain.runtime.dtype import measure_again
    from mtptrain.runtime import prefetch
    from mtptrain.runtime.runner import measure_prefetch
    from mtptrain.target import load_config, load_target

    cfg = _recipe(recipe, overrides)
    choice, cached = _guarded(lambda: measure_again(load_config(cfg.target), cfg.target.dtype, cfg.target.model))
    typer.echo(f"{cfg.target.model}: {choice.describe()}")
    if not cached:
        typer.echo("error: other processes kept the cores busy during the measurement, so it was not cached; "
                   "run mtptrain measure again when the machine is quiet", err=True)
        raise typer.Exit(1)
    typer.echo(f"cached in {cache_root() / 'runtime-choice.json'}")
    rows, source = _guarded(lambda: measure_prefetch(load_target(cfg.target).model))
    typer.echo(f"products' prefetch: passes of {prefetch.describe(rows)} ({source})")
    if source == "too slow":
        typer.echo(f"the target's forwards are too slow to time {prefetch.MIN_PAIRS} pairs of them in "
                   f"{prefetch.MEASURE_BUDGET_S:.0f} s: the default stays")
    if source in ("measured under load", "busy", "noisy"):
        typer.echo("error: the products' prefetch was not cached (see the warning above); run mtptrain measure "
                   "again when the machine is quiet", err=True)
        raise typer.Exit(1)
    if source == "measured":
        typer.echo(f"cached in {cache_root() / 'runtime-prefetch.json'}")


@app.command("recipe")
def show_recipe(recipe: RecipeOpt = None, overrides: SetOpt = None) -> None:
    """Validate a recipe and print it fully resolved (every default spelled out)."""
    import yaml

    typer.echo(yaml.safe_dump(_recipe(recipe, overrides).model_dump(mode="json"), sort_keys=False), nl=False)


def _guarded(run):
    """The project's own errors (the input's fault, with the fix in the message) end with the message and exit
    code 1; anything else is a bug and keeps its traceback."""
    try:
        return run()
    except MtptrainError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


if __name__ == "__main__":
    app()
