"""On CUDA, every SDPA call of the runtime runs in a fused kernel, never in the math fallback that builds the
[B, H, T, S] scores in float32: a single sequence's prefill, chain after a cache, tree and one token, and batched
decoding's masked steps and prompt chunks, for a model with grouped query heads and one without. No GPU here: the
runtime decides its calls as on CUDA (`sdpa_form` asked for "cuda"), each call is checked against the rules by
which torch's CUDA SDPA picks its kernel, and run on the CPU, where it gives what the CPU's own form gives."""

import re
import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from mtptrain.engine.tree import DraftTree
from mtptrain.runtime import attention
from mtptrain.runtime.batch import Request, decode_stream
from mtptrain.runtime.choice import Choice
from mtptrain.runtime.model import FastDecoder
from mtptrain.runtime.runner import FastRunner

REPO = Path(__file__).resolve().parents[2]


def cuda_kernel(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, **_) -> str:
    """The kernel torch 2.5-2.13's CUDA SDPA runs a call on, on a GPU of sm80 or later, with cuDNN's attention left
    out as the runtime's decoding leaves it (attention.decoding_kernels)
    (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp: can_use_flash_attention, then
    can_use_mem_efficient_attention, else math). Without that, torch 2.11 on an H200 ran cuDNN's attention first,
    masked or not (benchmarks/cuda_shapes.py's record in docs/gpu-check/)."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[-1]
    half = q.dtype in (torch.bfloat16, torch.float16)
    grouped = heads != kv_heads
    unit_stride = all(t.stride(-1) == 1 for t in (q, k, v))
    if (half and dim <= 256 and attn_mask is None and (not is_causal or q.shape[2] == k.shape[2])
            and (not grouped or (enable_gqa and heads % kv_heads == 0))):  # flash: GQA, no mask
        return "flash"
    if not grouped and dim % (8 if half else 4) == 0 and unit_stride:  # mem-efficient: a mask, no GQA
        return "efficient"
    return "math"


def _model(kv_heads: int):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=kv_heads,
                                      max_position_embeddings=512, initializer_range=0.2)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def _run(model, dtype) -> list[torch.Tensor]:
    """What the runtime computes on `model` in `dtype` with SDPA for every attention (its choice on CUDA): a
    prefill, a chain after it, a tree, one token; then three prompts decoded in a batch."""
    decoder = FastDecoder(model.to(dtype), Choice(dtype, "linear", "sdpa", "sdpa", "cuda"), "linear")
    runner = FastRunner(decoder)
    runner.reset()
    out = [runner.forward(list(range(10, 47))), runner.forward([5, 6, 7, 8])]
    out.append(runner.forward_tree(9, DraftTree(tokens=[11, 12, 13, 14, 15], parents=[-1, -1, 0, 0, 2])))
    runner.rollback(41)
    out.append(runner.forward([20]))
    requests = [Request(list(range(3, 3 + n)), 6) for n in (5, 19, 2)]
    decode_stream(decoder, requests, lambda request: None, 2, set(), 0)
    return out + [torch.tensor(request.tokens) for request in requests]


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_sdpa_call_runs_fused_on_cuda_and_gives_what_the_cpu_gives(kv_heads, dtype, monkeypatch):
    model = _model(kv_heads)
    on_cpu = _run(model, dtype)
    calls = []
    sdpa = F.scaled_dot_product_attention
    decide = getattr(attention, "sdpa_form", None)  # a runtime without it makes the same calls on any device

    def recorded(q, k, v, **kwargs):
        calls.append((cuda_kernel(q, k, v, **kwargs), tuple(q.shape), tuple(k.shape),
                      None if kwargs.get("attn_mask") is None else tuple(kwargs["attn_mask"].shape)))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    if decide is not None:
        monkeypatch.setattr(attention, "sdpa_form", lambda device_type, *args: decide("cuda", *args))
    as_on_cuda = _run(model, dtype)
    assert len(calls) > 20 and {c[3] is not None for c in calls} == {True, False}  # masked calls and plain ones
    fallbacks = [c for c in calls if c[0] == "math"]
    assert not fallbacks, f"{len(fallbacks)} of {len(calls)} calls on the math kernel, e.g. {fallbacks[:3]}"
    for a, b in zip(as_on_cuda, on_cpu, strict=True):
        if a.is_floating_point():  # logits: the same products and softmax, summed in another order
            assert torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-4 if dtype == torch.float32 else 0.1)
    if dtype == torch.float32:  # bfloat16's near-ties may pick another token
        assert all(torch.equal(a, b) for a, b in zip(as_on_cuda[4:], on_cpu[4:]))


def test_on_the_cpu_every_call_keeps_its_measured_form():
    for dtype in (torch.float32, torch.bfloat16):
        for masked, causal in ((False, False), (True, False), (False, True)):
            assert attention.sdpa_form("cpu", dtype, 32, 8, 5, 300, 128, masked, causal) == "gqa"


@pytest.mark.parametrize("shape, form", [
    ((1, 32, 1, 128), "fold"),  # a batched step's token under its row's mask
    ((1, 32, 5, 128), "fold"),  # a chain after the cache, or a tree
    ((1, 32, 300, 128), "gqa"),  # a prefill: flash, causal
])
def test_cuda_forms_of_the_runtimes_calls(shape, form):
    count = shape[2]
    masked, causal = count < 300, count == 300
    assert attention.sdpa_form("cuda", torch.bfloat16, 32, 8, count, 300, 128, masked, causal) == form
    assert attention.sdpa_form("cuda", torch.bfloat16, 32, 32, count, 300, 128, masked, causal) == "gqa"
    assert attention.sdpa_form("cuda", torch.float32, 32, 8, 300, 300, 128, False, True) == "expand"


def test_the_torch_floor_has_what_the_code_calls():
    """enable_gqa (runtime/attention.py) and torch.serialization.safe_globals (train/checkpoints.py) came with
    torch 2.5: a floor below it installs a torch the package fails on."""
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = next(re.fullmatch(r"torch>=(\d+)\.(\d+)(?:\.\d+)?", d) for d in dependencies if d.startswith("torch"))
    assert floor and (int(floor[1]), int(floor[2])) >= (2, 5), dependencies


def test_on_cuda_decoding_and_drafting_attend_without_cudnn(monkeypatch):
    """cuDNN's attention plans anew for every shape and a decoding step's key length is new each time (measured on
    an H200: runtime/attention.py). generate() (the target's steps and the drafter's) and batched decoding run
    within decoding_kernels of their device, which on CUDA leaves cuDNN out, and hand the setting back after."""
    from mtptrain.engine import generate as generate_module
    from mtptrain.engine.ngram import NgramProposer
    from mtptrain.runtime import batch

    real = attention.decoding_kernels
    devices, flags = [], []

    def as_on_cuda(device):  # the device each caller names, and the context CUDA gets
        devices.append(torch.device(device).type)
        return real("cuda")

    class Recording(NgramProposer):
        def propose(self, tokens, k):
            flags.append(("draft", torch.backends.cuda.cudnn_sdp_enabled()))
            return super().propose(tokens, k)

    sdpa = F.scaled_dot_product_attention

    def recorded(q, k, v, **kwargs):
        flags.append(("attention", torch.backends.cuda.cudnn_sdp_enabled()))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    monkeypatch.setattr(generate_module, "decoding_kernels", as_on_cuda)
    monkeypatch.setattr(batch, "decoding_kernels", as_on_cuda)
    decoder = FastDecoder(_model(2), Choice(torch.float32, "linear", "sdpa", "sdpa", "cuda"), "linear")
    before = torch.backends.cuda.cudnn_sdp_enabled()
    generate_module.generate(FastRunner(decoder), [3, 4, 5, 3, 4, 5, 3, 4], 12, Recording(1, 2), k=3)
    decode_stream(decoder, [Request(list(range(3, 3 + n)), 6) for n in (5, 9)], lambda request: None, 2, set(), 0)
    assert devices == ["cpu", "cpu"]  # each asked for its own device's kernels
    assert {kind for kind, _ in flags} == {"draft", "attention"} and not any(on for _, on in flags)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with real("cpu"):  # elsewhere nothing changes
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
