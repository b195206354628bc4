"""vLLM from mtptrain: its environment found, one engine per worker process, requests and replies as JSON lines.

vLLM pins its own torch and transformers, so it lives in a virtual environment of its own
(scripts/setup_vllm.sh) and runs mtptrain/serving/vllm_worker.py there; this side starts that process, hands it
engine settings and token ids, and reads back tokens, seconds and vLLM's own spec-decode counters. Nothing of
vLLM is imported here.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import selectors
import subprocess
import sys
import tempfile
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch

from mtptrain.config import VllmConfig
from mtptrain.errors import MtptrainError

log = logging.getLogger(__name__)
WORKER = Path(__file__).with_name("vllm_worker.py")
VENV = ".venv-vllm"
SETUP = "scripts/setup_vllm.sh"


class VllmError(MtptrainError, RuntimeError):
    """vLLM is missing, or refused an engine or a request; the message says which and how to fix it."""


def vllm_python(setting: str = "auto") -> Path:
    """The python of vLLM's environment: vllm.python, else MTPTRAIN_VLLM_PYTHON, else .venv-vllm/bin/python in the
    working directory or in the checkout this package lives in."""
    if setting != "auto":
        candidates, named = [Path(setting).expanduser()], f"vllm.python {setting}"
    elif os.environ.get("MTPTRAIN_VLLM_PYTHON"):
        candidates, named = [Path(os.environ["MTPTRAIN_VLLM_PYTHON"])], "MTPTRAIN_VLLM_PYTHON"
    else:
        checkout = Path(__file__).resolve().parents[2]
        candidates = [Path.cwd() / VENV / "bin" / "python", checkout / VENV / "bin" / "python"]
        named = f"{VENV}/bin/python (in {Path.cwd()} or {checkout})"
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise VllmError(f"vLLM's environment was not found at {named}: build it with `bash {SETUP}` in the mtptrain "
                    "checkout (a separate virtual environment, as vLLM pins its own torch), or point vllm.python "
                    "(or MTPTRAIN_VLLM_PYTHON) at the python of an environment where vLLM is installed")


def on_gpu() -> bool:
    return torch.cuda.is_available()


def engine_args(cfg: VllmConfig, model: str, max_model_len: int, speculative: dict | None = None,
                max_num_seqs: int | None = None, kv_cache_gib: float | None = None,
                prefix_caching: bool = False) -> dict:
    """`vllm.LLM`'s keyword arguments for one engine of the recipe's vllm section. Prefix caching is off unless
    asked for: eval's repeats must each compute their prompts, as the first did."""
    gpu = on_gpu()
    args = {"model": model, "dtype": cfg.dtype if cfg.dtype != "auto" else ("auto" if gpu else "bfloat16"),
            "seed": cfg.seed, "max_model_len": max_model_len, "disable_log_stats": False,  # the counters we read
            "enforce_eager": (not gpu) if cfg.enforce_eager is None else cfg.enforce_eager,
            "gpu_memory_utilization": cfg.memory_utilization or (0.9 if gpu else 0.2),
            "tensor_parallel_size": cfg.tensor_parallel_size, "enable_prefix_caching": prefix_caching}
    if cfg.in_process and cfg.tensor_parallel_size == 1:
        args["distributed_executor_backend"] = "uni"
    cache = cfg.kv_cache_gib or kv_cache_gib
    if cache:
        args["kv_cache_memory_bytes"] = int(cache * 2**30)
    if max_num_seqs:
        args["max_num_seqs"] = max_num_seqs
    if speculative:
        args["speculative_config"] = speculative
    return args


def batch1_cache_gib(model_config, tokens: int, dtype: str = "bfloat16") -> float:
    """A KV cache that holds one request of `tokens` (and a one-layer draft's), with room to spare: eval's
    batch-1 engines run side by side, so none may take vLLM's default share of memory. Keys and values take
    2 x layers x kv heads x head dim x 2 bytes a token in bfloat16 (SmolLM2: 23 KB; Llama-3.1-8B: 128 KB)."""
    heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    per_token = 2 * (model_config.num_hidden_layers + 1) * heads * head_dim * (4 if dtype == "float32" else 2)
    return max(0.25, 1.5 * tokens * per_token / 2**30)


def eagle3_speculation(export_dir: Path, k: int, draft_sample_method: str = "greedy") -> dict:
    """The speculative_config of an EAGLE-3 head exported as eagle3 or speculators, drafting k tokens a step, each
    drawn by `draft_sample_method` (vLLM's key; its default, greedy, is left out)."""
    spec = {"method": "eagle3", "model": str(Path(export_dir).resolve()), "num_speculative_tokens": k}
    return spec if draft_sample_method == "greedy" else {**spec, "draft_sample_method": draft_sample_method}


@dataclass
class Served:
    """What an engine generated for one request, and the spec-decode counters it moved (batch 1)."""

    tokens: list[int]
    seconds: float
    finish_reason: str | None = None
    drafts: int = 0  # steps that verified a draft
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class VllmWorker:
    """One process of vLLM's environment holding one engine at a time. Its log (vLLM's own) goes to `log_path`,
    or to a temporary file whose end is quoted when something fails. `devices`: its CUDA_VISIBLE_DEVICES (one
    data-parallel engine's GPUs)."""

    def __init__(self, cfg: VllmConfig, log_path: Path | None = None, devices: str | None = None):
        self.python = vllm_python(cfg.python)
        if log_path is None:
            handle, name = tempfile.mkstemp(prefix="mtptrain-vllm-", suffix=".log")
            os.close(handle)
            log_path = Path(name)
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.facts: dict = {}
        env = worker_env(self.python, cfg)
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        self.process = subprocess.Popen([str(self.python), str(WORKER)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self._log, env=env, text=True, bufsize=1)
        self._started = False  # its "ready" line is read with the first reply, so that workers start together
        self._close_asked = False  # close_begin sent the close request (close_end then waits for its answer)

    def _call(self, message: dict | None, what: str) -> dict:
        self._send(message, what)
        return self._receive(what)

    def _send(self, message: dict | None, what: str) -> bool:
        """Writes `message` to the worker (None: nothing, the read of a reply that is already coming); False where
        the pipe is broken and nothing reached it."""
        if self.process.poll() is not None and message is not None:
            raise VllmError(f"vLLM's worker has exited (code {self.process.returncode}) before {what}:\n"
                            f"{self.log_tail()}")
        try:
            if message is not None:
                self.process.stdin.write(json.dumps(message) + "\n")
                self.process.stdin.flush()
        except BrokenPipeError:
            return False  # a caller that reads next finds the worker's end there
        return True

    def _receive(self, what: str) -> dict:
        line = self._readline()
        if line and not self._started:
            self._started = True
            line = self._readline()
        if not line:
            self.process.wait(timeout=60)
            raise VllmError(f"vLLM's worker ({self.python}) ended during {what} with code "
                            f"{self.process.returncode}; the end of its log ({self.log_path}):\n{self.log_tail()}")
        answer = json.loads(line)
        if "error" in answer:
            raise VllmError(f"vLLM failed during {what}: {answer['error']}\n(its log: {self.log_path})")
        return answer

    def _readline(self) -> str:
        try:
            return self.process.stdout.readline()
        except (BrokenPipeError, ValueError):
            return ""

    def log_tail(self, lines: int = 25) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def open(self, engine: dict) -> dict:
        """Build the engine (closing the one before); returns vLLM's facts (version, dtype, threads, device)."""
        self.open_begin(engine)
        return self.open_end()

    def open_begin(self, engine: dict) -> None:
        """Asks for the engine without waiting for it: several workers build theirs at once (open_end waits)."""
        self._opening = (engine, f"the start of an engine for {engine['model']}" + (
            f" with {engine['speculative_config']}" if engine.get("speculative_config") else ""))
        self._send({"op": "open", "engine": engine}, self._opening[1])

    def open_end(self) -> dict:
        engine, what = self._opening
        self.facts = self._receive(what)
        log.info("vLLM %s: %s in %s on %s, %d threads, ready in %.1f s%s", self.facts["vllm"], engine["model"],
                 self.facts["dtype"], self.facts["device"], self.facts["threads"], self.facts["seconds"],
                 f", drafting {self.facts['speculative']}" if self.facts.get("speculative") else "")
        return self.facts

    def each(self, requests: list[dict]) -> list[Served]:
        """Each request alone (batch 1), timed inside the worker, with the counters it moved."""
        answer = self._call({"op": "each", "requests": requests}, f"{len(requests)} request(s)")
        return [Served(r["tokens"], r["seconds"], r["finish_reason"], r["drafts"], r["draft_tokens"], r["accepted"],
                       r["accepted_per_pos"]) for r in answer["results"]]

    def stream(self, add: list[dict]) -> tuple[list[dict], int]:
        """Adds requests to the running batch and steps until some finish: (finished requests, still running)."""
        self.stream_begin(add)
        return self.stream_end()

    def stream_begin(self, add: list[dict]) -> None:
        self._send({"op": "stream", "add": add}, "a batch step")

    def stream_end(self) -> tuple[list[dict], int]:
        answer = self._receive("a batch step")
        return answer["finished"], answer["running"]

    def close(self) -> None:
        self.close_begin()
        self.close_end()

    def close_begin(self) -> None:
        """Asks the worker to end without waiting for it: several workers shut their engines down at once
        (close_end waits; 6 engines closed one after the other took 22 s of a 2-core machine, docs/benchmarks.md)."""
        if self.process.poll() is None:
            try:
                self._close_asked = self._send({"op": "close"}, "closing")
            except (VllmError, ValueError, OSError):
                pass  # close_end finds it ended, or kills it

    def close_end(self) -> None:
        if self.process.poll() is None:
            try:
                if not self._close_asked:  # a worker never asked would never answer: the read below would hang
                    raise VllmError("the close request could not be sent")
                self._receive("closing")
                self.process.wait(timeout=60)
            except (VllmError, subprocess.TimeoutExpired, ValueError, OSError):
                self.process.kill()
                self.process.wait()
        self._log.close()

    def __enter__(self) -> VllmWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def close_all(workers: list[VllmWorker]) -> None:
    """Closes every worker, all shutting down at once."""
    for worker in workers:
        worker.close_begin()
    for worker in workers:
        worker.close_end()


def stream_requests(workers: list[VllmWorker], requests: Iterable, done: Callable, rows: int, stops: set[int],
                    temperature: float, top_k: int, top_p: float) -> None:
    """Decode every request (runtime/batch.py's Request: prompt, budget, seed; filled in: tokens without the stop
    token, stopped) on vLLM's continuous batching, keeping `rows` in flight on each worker. When one finishes,
    `done(request)` is called, and the request it returns (a conversation's next turn) goes to the same worker,
    whose prefix cache holds the turns before it, ahead of the rest of `requests`."""
    pending = iter(requests)
    flying: dict[VllmWorker, dict[str, object]] = {w: {} for w in workers}
    adding: dict[VllmWorker, list[dict]] = {w: [] for w in workers}
    follow: dict[VllmWorker, deque] = {w: deque() for w in workers}
    count = itertools.count()

    def add(worker: VllmWorker, request) -> None:
        key = str(next(count))
        flying[worker][key] = request
        adding[worker].append({"id": key, "prompt": list(request.prompt), "max_tokens": request.budget,
                               "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": request.seed,
                               "stop": sorted(stops)})

    def fill() -> None:
        for worker in sorted(workers, key=lambda w: len(flying[w])):
            while len(flying[worker]) < rows and follow[worker]:
                add(worker, follow[worker].popleft())
        while True:
            worker = min(workers, key=lambda w: len(flying[w]))
            if len(flying[worker]) >= rows:
                return
            request = next(pending, None)
            if request is None:
                return
            add(worker, request)

    selector = selectors.DefaultSelector()
    fill()
    while any(flying.values()):
        waiting = [w for w in workers if flying[w]]
        for worker in waiting:
            worker.stream_begin(adding[worker])
            adding[worker] = []
            selector.register(worker.process.stdout, selectors.EVENT_READ, worker)
        for worker in waiting:  # every worker steps at once; each reply is read as it comes
            key = selector.select()[0][0]
            selector.unregister(key.fileobj)
            answered = key.data
            finished, _ = answered.stream_end()
            for item in finished:
                request = flying[answered].pop(item["id"])
                tokens = item["tokens"]
                request.stopped = item["finish_reason"] == "stop"
                request.tokens = tokens[:-1] if request.stopped and tokens and tokens[-1] in stops else tokens
                after = done(request)
                if after is not None:
                    follow[answered].append(after)
        fill()
    selector.close()


def worker_env(python: Path, cfg: VllmConfig) -> dict[str, str]:
    """The worker's environment: ours without this interpreter's paths, plus what vLLM's CPU guide asks for."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if cfg.in_process else "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vLLM's CPU backend wants Intel's OpenMP preloaded (its warning: "Speculative decoding on CPU without Intel
    # OpenMP in LD_PRELOAD will cause significant performance loss"); its wheel brings libiomp5.
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if not on_gpu() and iomp.is_file() and "libiomp" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
    if sys.platform == "darwin":
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return env


def data_parallel_devices(cfg: VllmConfig) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each data-parallel engine (tensor_parallel_size GPUs each), or [None] * N on a
    machine without CUDA (engines on the CPU, sharing its cores)."""
    if not on_gpu():
        return [None] * cfg.data_parallel_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    need = cfg.data_parallel_size * cfg.tensor_parallel_size
    if need > len(ids):
        raise VllmError(f"vllm.data_parallel_size {cfg.data_parallel_size} x vllm.tensor_parallel_size "
                        f"{cfg.tensor_parallel_size} needs {need} GPUs; this machine shows {len(ids)}: lower them")
    size = cfg.tensor_parallel_size
    return [",".join(ids[i * size:(i + 1) * size]) for i in range(cfg.data_parallel_size)]
