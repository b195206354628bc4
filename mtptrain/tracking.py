"""W&B for every stage: one group per pipeline run, precompute, train and eval as its jobs.

Runs are offline unless credentials are configured (WANDB_API_KEY, or a
`wandb login` entry in ~/.netrc), so a job never blocks on the network and
never asks for a key; `wandb sync <dir>/wandb/offline-run-*` uploads later.
An online start waits at most WANDB_INIT_TIMEOUT seconds (20 by default, not
wandb's 90). When it fails (a malformed or rejected key, no network), auto
logs one warning and runs offline; an explicit online stops with TrackingError.
Only the resolved recipe goes into a run's config: no environment, no keys.
The settings are the recipe's `tracking` section. The group is tracking.group,
or the recipe's name; `mtptrain pipeline` and `mtptrain slurm pipeline` set a
fresh <name>-<date-time> when it is unset.
"""

from __future__ import annotations

import logging
import math
import os
from datetime import datetime
from pathlib import Path

from mtptrain.config import Recipe
from mtptrain.errors import MtptrainError

log = logging.getLogger(__name__)

# wandb's own default is 90 s, and it keeps retrying until then when the server is unreachable; a reachable
# server answers a run's creation in a few seconds.
DEFAULT_INIT_TIMEOUT_S = 20.0


class TrackingError(MtptrainError, RuntimeError):
    """W&B was asked for explicitly and could not start, or its settings are unusable."""


def wandb_mode(requested: str) -> str:
    """A recipe's explicit mode; for auto, W&B's own WANDB_MODE when set, else online with credentials and
    offline without."""
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_MODE") in ("online", "offline", "disabled"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path.home() / ".netrc"
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return "online"
    return "offline"


def wandb_group(recipe: Recipe) -> str:
    return recipe.tracking.group or recipe.name


def pipeline_group(recipe: Recipe) -> str:
    """The group a new pipeline run gets when the recipe names none: its name and the time it starts."""
    return recipe.tracking.group or f"{recipe.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def init_timeout() -> float:
    """Seconds an online start may wait for the W&B server: WANDB_INIT_TIMEOUT (wandb's own variable), else
    DEFAULT_INIT_TIMEOUT_S."""
    raw = os.environ.get("WANDB_INIT_TIMEOUT")
    if raw is None:
        return DEFAULT_INIT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise TrackingError(f"WANDB_INIT_TIMEOUT={raw} is not a number of seconds above 0 (the longest a W&B "
                            f"online start may wait; unset, it is {DEFAULT_INIT_TIMEOUT_S:g})")
    return value


def init_run(recipe: Recipe, job_type: str, mode: str, directory: Path, resume_id: str | None = None):
    """A W&B run of `job_type` (the stage) in the recipe's project and group, or None when W&B is disabled.

    `mode` is tracking.wandb, or what the command line put in its place (--no-wandb). A failed online start falls
    back to an offline run when `mode` is auto (with one warning), and raises TrackingError when online was asked
    for, in the recipe or by WANDB_MODE.
    """
    requested, mode = mode, wandb_mode(mode)
    if mode == "disabled":
        return None
    # wandb takes ~0.3 s to import: a run with W&B disabled (--no-wandb, tests) never pays for it
    import wandb

    timeout = init_timeout()
    Path(directory).mkdir(parents=True, exist_ok=True)

    def start(run_mode: str):
        return wandb.init(project=recipe.tracking.project, name=f"{recipe.name}-{job_type}",
                          group=wandb_group(recipe), job_type=job_type, config=recipe.model_dump(mode="json"),
                          dir=str(directory), mode=run_mode, id=resume_id, resume="allow" if resume_id else None,
                          settings=wandb.Settings(silent=True, console="off", init_timeout=timeout))

    if mode != "online":
        return start(mode)
    try:
        return start("online")
    except Exception as exc:  # wandb raises several types (AuthenticationError, CommError, UsageError, ...)
        reason = _reason(exc)
    _reset_wandb(wandb)
    setting = "tracking.wandb"
    if requested == "online" or os.environ.get("WANDB_MODE") == "online":
        change = (f"set {setting}=offline (then `wandb sync` uploads) or {setting}=disabled, or pass --no-wandb"
                  if requested == "online" else
                  f"unset WANDB_MODE=online ({setting}=auto then logs offline), or set {setting}=disabled")
        raise TrackingError(f"W&B online init failed ({reason}). Fix the key (WANDB_API_KEY or `wandb login`) or the "
                            f"network (WANDB_BASE_URL, proxy), raise WANDB_INIT_TIMEOUT (now {timeout:g} s), or {change}")
    log.warning("W&B online init failed (%s): logging offline to %s; `wandb sync %s` uploads later; set %s=offline "
                "to skip the attempt", reason, Path(directory) / "wandb", Path(directory) / "wandb" / "offline-run-*",
                setting)
    return start("offline")


def _reason(exc: Exception) -> str:
    """The failure in one line, without the API key (wandb's messages may quote what they were given)."""
    text = " ".join(str(exc).split("\n")[0].split()).rstrip(".") or "no message"
    key = os.environ.get("WANDB_API_KEY")
    if key:
        text = text.replace(key, "<WANDB_API_KEY>")
    return f"{type(exc).__name__}: {text}"


def _reset_wandb(wandb) -> None:
    """Stop wandb's service after a failed start: it keeps the failed run's stream, so the run's id stays taken
    and a resumed run (same id) could not start offline."""
    try:
        wandb.teardown()
    except (Exception, SystemExit):  # teardown exits with the service's status when that is not 0
        log.debug("wandb.teardown() after a failed start", exc_info=True)
