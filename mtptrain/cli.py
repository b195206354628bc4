"""The `mtptrain` command line. Each command parses, loads the recipe, and calls one run_<stage>."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(
    help="Train speculative-decoding draft heads (MTP / EAGLE) for a target LLM.\n\n"
    "Every command reads a YAML recipe (see recipes/) and takes repeatable --set section.key=value "
    "overrides, validated like the recipe itself.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

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
def precompute(recipe: RecipeOpt = None, overrides: SetOpt = None,
               progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True) -> None:
    """Run the target over the recipe's conversations and store its hidden states.

    Writes sharded safetensors and a manifest to precompute.output_dir. Rerunning the same
    command resumes: complete shards are kept. Under torchrun or srun each rank computes a
    disjoint set of shards.
    """
    from mtptrain.features.precompute import format_summary, run_precompute

    cfg = _recipe(recipe, overrides)
    summary = _guarded(lambda: run_precompute(cfg, show_progress=progress))
    if summary["rank"] == 0 or summary["wrote_manifest"]:
        typer.echo(format_summary(summary))


@app.command("recipe")
def show_recipe(recipe: RecipeOpt = None, overrides: SetOpt = None) -> None:
    """Validate a recipe and print it fully resolved (every default spelled out)."""
    import yaml

    typer.echo(yaml.safe_dump(_recipe(recipe, overrides).model_dump(mode="json"), sort_keys=False), nl=False)


def _guarded(run):
    """Known failures end with their message and exit code 1, not a traceback."""
    from data_prep.prepare import NoUsableData
    from data_prep.readers import DataSourceError
    from mtptrain.embedded import EmbeddedAssetError
    from mtptrain.features.store import FeatureStoreError
    from mtptrain.target import TargetError

    try:
        return run()
    except (NoUsableData, DataSourceError, EmbeddedAssetError, FeatureStoreError, TargetError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


if __name__ == "__main__":
    app()
