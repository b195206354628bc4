"""One vLLM engine in a process of vLLM's own environment (scripts/setup_vllm.sh), driven by mtptrain.

This file runs under the vLLM environment's python, not mtptrain's: it imports only the standard library and
vLLM, and speaks JSON, one object per line, over the pipes mtptrain/serving/vllm_engine.py opened. Everything vLLM or
its libraries print goes to stderr, so that nothing but the protocol reaches the reader. Requests:

  {"op": "open", "engine": {...}}   build `vllm.LLM(**engine)` (closing the one open before), reply its facts
  {"op": "each", "requests": [...]} generate each request alone, one after the other (batch 1), and reply per
                                    request its tokens, seconds and the spec-decode counters it moved
  {"op": "stream", "add": [...]}    add requests to the running batch, step until one or more finish (or none is
                                    left), reply those (continuous batching: rows are refilled as the caller adds)
  {"op": "close"}                   end

A request is {"id", "prompt": [token ids], "max_tokens", "temperature", "top_k", "top_p", "seed", "stop": [ids]}.
A reply carrying "error" is a failure of that request, with vLLM's traceback; the worker stays usable.
"""

import gc
import json
import os
import sys
import time
import traceback

# The protocol keeps the pipe that was stdout; fd 1 becomes stderr, for vLLM's logs and progress bars. vLLM is
# imported after this, so that what it prints while importing goes to stderr too.
PROTOCOL = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.sample import rejection_sampler  # noqa: E402

SPEC = "vllm:spec_decode_"
# vLLM's engine core runs in this process (vllm.in_process): only then can fix_cpu_expand probe and repair it; in
# a process of its own, vLLM has not registered its CPU kernels here, and the probe could not even run
IN_PROCESS = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"


def fix_cpu_expand() -> list[str]:
    """vLLM's CPU build (0.32 at least) replaces the Triton kernel that spreads each request's temperature, top-k
    and top-p over its draft tokens with a C++ one that fills an int64 copy of the output and drops it
    (vllm-project/vllm issue 55005; fix proposed in pull request 55006): at temperature > 0 the target's logits
    of every draft position are divided by uninitialised memory, and next to nothing is accepted. Greedy requests
    and GPUs do not take that path. Probed on a known input; where the answer is wrong, the function is replaced
    by one that expands at the input's own dtype. Returns what was replaced (empty where nothing was wrong)."""
    if not current_platform.is_cpu():
        return []

    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
        values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
        return torch.repeat_interleave(values, counts, output_size=num_tokens)

    def right() -> bool:  # probed once an engine is built: vLLM registers its CPU kernels while building one
        got = rejection_sampler.expand_batch_to_tokens(torch.tensor([0.7, 0.0]), torch.tensor([2, 5], dtype=torch.int32),
                                                       5, replace_from=0, replace_to=1)
        return torch.equal(got, torch.tensor([0.7, 0.7, 1.0, 1.0, 1.0]))

    if right():
        return []
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    if not right():
        raise RuntimeError("vllm.v1.sample.rejection_sampler.expand_batch_to_tokens is still wrong after replacing it")
    return ["vllm.v1.sample.rejection_sampler.expand_batch_to_tokens (vLLM issue 55005: its CPU kernel drops its "
            "output, so sampled requests were verified against uninitialised temperatures)"]


def reply(message: dict) -> None:
    PROTOCOL.write(json.dumps(message) + "\n")


class Worker:
    def __init__(self):
        self.llm = None
        self.fixed = None  # what fix_cpu_expand replaced, once an engine was built in this process

    def open(self, engine: dict) -> dict:
        self.close_engine()
        started = time.perf_counter()
        self.llm = vllm.LLM(**engine)
        if self.fixed is None:
            self.fixed = fix_cpu_expand() if IN_PROCESS else []
        config = self.llm.llm_engine.vllm_config
        spec = config.speculative_config
        return {"vllm": vllm.__version__, "torch": torch.__version__, "seconds": time.perf_counter() - started,
                "threads": torch.get_num_threads(), "dtype": str(config.model_config.dtype).removeprefix("torch."),
                "fixed": self.fixed, "unprobed": not IN_PROCESS and current_platform.is_cpu(),
                "device": str(config.device_config.device), "speculative": None if spec is None else {
                    "method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
                    "draft_model": spec.model,
                    **({"draft_sample_method": spec.draft_sample_method}
                       if getattr(spec, "draft_sample_method", "greedy") != "greedy" else {})}}

    def close_engine(self) -> None:
        if self.llm is not None:
            engine_core = getattr(self.llm.llm_engine, "engine_core", None)
            if hasattr(engine_core, "shutdown"):
                engine_core.shutdown()
            self.llm = None
            gc.collect()

    def params(self, request: dict):
        return SamplingParams(max_tokens=request["max_tokens"], temperature=request.get("temperature", 0.0),
                              top_k=request.get("top_k") or -1, top_p=request.get("top_p") or 1.0,
                              seed=request.get("seed"), stop_token_ids=request.get("stop") or None,
                              ignore_eos=False, detokenize=False)

    def add(self, request: dict) -> None:
        self.llm.llm_engine.add_request(str(request["id"]), TokensPrompt(prompt_token_ids=request["prompt"]),
                                        self.params(request))

    def counters(self) -> dict:
        """The spec-decode counters so far: drafts, draft tokens, accepted tokens, accepted per position."""
        found = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
        names = {SPEC + "num_drafts": "drafts", SPEC + "num_draft_tokens": "draft_tokens",
                 SPEC + "num_accepted_tokens": "accepted"}
        for metric in self.llm.get_metrics():
            if metric.name in names:
                found[names[metric.name]] += int(metric.value)
            elif metric.name == SPEC + "num_accepted_tokens_per_pos":
                values = list(metric.values)
                seen = found["accepted_per_pos"]
                found["accepted_per_pos"] = [a + b for a, b in zip(seen + [0] * len(values), values + [0] * len(seen))]
        return found

    def each(self, requests: list) -> dict:
        engine, results = self.llm.llm_engine, []
        for request in requests:
            before = self.counters()
            started = time.perf_counter()
            self.add(request)
            done = []
            while engine.has_unfinished_requests():
                done += [o for o in engine.step() if o.finished]
            seconds = time.perf_counter() - started
            after = self.counters()
            moved = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
            moved["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"],
                                                               before["accepted_per_pos"] + [0] * 64)]
            out = done[0].outputs[0]
            results.append({"id": request["id"], "tokens": list(out.token_ids), "finish_reason": out.finish_reason,
                            "seconds": seconds, **moved})
        return {"results": results}

    def stream(self, add: list) -> dict:
        engine = self.llm.llm_engine
        for request in add:
            self.add(request)
        finished = []
        while engine.has_unfinished_requests() and not finished:
            finished = [o for o in engine.step() if o.finished]
        return {"finished": [{"id": o.request_id, "tokens": list(o.outputs[0].token_ids),
                              "finish_reason": o.outputs[0].finish_reason} for o in finished],
                "running": engine.get_num_unfinished_requests()}


def main() -> None:
    worker = Worker()
    reply({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        message = json.loads(line)
        op = message.get("op")
        if op == "close":
            worker.close_engine()
            reply({"closed": True})
            break
        try:
            if op == "open":
                reply(worker.open(message["engine"]))
            elif op == "each":
                reply(worker.each(message["requests"]))
            elif op == "stream":
                reply(worker.stream(message.get("add", [])))
            else:
                reply({"error": f"unknown op {op!r}"})
        except Exception as exc:  # the caller turns this into an error naming the engine's settings
            traceback.print_exc()
            reply({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]})


if __name__ == "__main__":
    main()
