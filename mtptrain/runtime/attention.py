"""The runtime's attention kernels, by name, as the measured choice (runtime/choice.py) picks them: torch's SDPA;
two plain products with a float32 softmax between them (and both over a float32 cache); and the C++ kernels of
runtime/native_kernels.py, for a row's new tokens (`fused_row`: one token, a causal chain, and with `for_mask` a
tree's nodes, each computed as a token decoded alone) and for batched decoding (`fused_attention`).

Every kernel takes q [B, H, T, D], k and v [B, Hkv, S, D], a mask (or None) and whether attention is causal;
`batch_mask` puts a batched step's mask in the form its kernel reads fastest.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mtptrain.runtime.native_kernels import causal_attention_kernel, decode_attention_kernel, tree_attention_kernel


# cuDNN's attention, which torch's SDPA tries first on Hopper GPUs, builds an execution plan for each new shape,
# and decoding meets a new key length at every step: each length's first step pays for a plan. On an NVIDIA H200
# (torch 2.11, cuDNN attention on by default) a temperature-0 eval of 4 prompts x 64 tokens, the first over those
# lengths, verified at 16.4 ms a step, and the same eval at temperature 1 right after it at 1.8 ms; with cuDNN left
# out, the first 64-token generation's steps took 0.150 s, later ones 0.119 s (docs/benchmarks.md, GPU check).
# Flash, mem-efficient and math kernels choose per call, with no plan to build.
DECODING_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def decoding_kernels(device: torch.device | str) -> contextlib.AbstractContextManager:
    """Within it, SDPA on CUDA leaves cuDNN's attention out (a plan per new length, see DECODING_BACKENDS): for
    decoding and drafting, whose shapes change every step. Elsewhere it changes nothing."""
    return sdpa_kernel(DECODING_BACKENDS) if torch.device(device).type == "cuda" else contextlib.nullcontext()


def causal_mask(count: int, past: int = 0, device=None) -> torch.Tensor:
    """[count, past + count], True where new token i may look: everything before it and new tokens 0..i."""
    return torch.ones(count, past + count, dtype=torch.bool, device=device).tril(past)


# SDPA's fused CUDA kernels in torch 2.5 to 2.13 (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp): flash
# attention takes grouped query heads (enable_gqa) but no explicit mask, bfloat16 or float16 only, head dims up to
# 256, and `is_causal` only with as many keys as queries; the mem-efficient kernel takes a mask (and float32) but
# not grouped heads (check_batch_size_and_num_heads_dense<false>), head dims a multiple of 8 (4 in float32). Any
# other call falls to the math kernel, which builds the [B, H, T, S] scores in float32 (an H100 profile of batched
# regeneration put 36 of 60 s there: the bands' masked steps and the prompt chunks after a cache).
FLASH_DTYPES = (torch.bfloat16, torch.float16)


def sdpa_form(device_type: str, dtype: torch.dtype, heads: int, kv_heads: int, count: int, length: int,
              head_dim: int, masked: bool, causal: bool) -> str:
    """How `sdpa_attention` gives q [B, H, T=count, D], k and v [B, Hkv, S=length, D] to torch's SDPA:
    - "gqa": as they are, with enable_gqa where H != Hkv: always on the CPU (its choice was measured so), and on
      CUDA where heads match or flash attention takes the call;
    - "fold": each key-value head's group of G query heads folded into its queries (q [B, Hkv, G*T, D], a mask
      repeated per group), which the mem-efficient kernel takes, reading the keys once per key-value head:
      a masked call, or one without `causal` in float32;
    - "expand": keys and values repeated per query head, for the mem-efficient kernel: causal attention flash
      does not take (float32, or more keys than queries); folding would need a mask as large as the scores.
    CUDA calls with a head dim neither kernel takes stay "gqa" (nothing fused runs them either way)."""
    if device_type != "cuda" or heads == kv_heads:
        return "gqa"
    if head_dim % (4 if dtype == torch.float32 else 8):
        return "gqa"
    if dtype in FLASH_DTYPES and head_dim <= 256 and not masked and (not causal or count == length):
        return "gqa"
    return "expand" if causal else "fold"


def folded_mask(mask: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """mask [B, 1, T, S] (True = seen, or additive) as the folded queries' additive mask [B, 1, G*T, S] in `dtype`,
    its rows 8 positions aligned (the mem-efficient kernel copies a mask whose strides are not)."""
    rows, _, count, length = mask.shape
    aligned = -(-length // 8) * 8
    folded = torch.zeros(rows, 1, group, count, aligned, dtype=dtype, device=mask.device)[..., :length]
    if mask.dtype == torch.bool:
        folded.masked_fill_(~mask[:, :, None], float("-inf"))
    else:
        folded.copy_(mask[:, :, None])
    return folded.view(rows, 1, group * count, length)


def sdpa_attention(q, k, v, mask, causal: bool):
    """q [B, H, T, D], k and v [B, Hkv, S, D]; mask [B, 1, T, S] (True = seen, or additive in q's dtype) or None;
    in the form `sdpa_form` picks (query head h reads key-value head h // (H / Hkv) in each)."""
    batch, heads, count, dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    form = sdpa_form(q.device.type, q.dtype, heads, kv_heads, count, length, dim, mask is not None, causal)
    if form == "fold" and mask is not None and mask.shape[1] != 1:  # a mask per head: not the runtime's
        form = "expand"
    group = heads // kv_heads
    if form == "fold":
        if mask is not None and (count > 1 or mask.dtype not in (torch.bool, q.dtype)):
            mask = folded_mask(mask, group, q.dtype)  # one token's [B, 1, 1, S] mask broadcasts as it is
        folded = q.reshape(batch, kv_heads, group * count, dim)
        # reshape, not view: the fused kernels hand back [B, G*T, Hkv, D] in memory, transposed
        return F.scaled_dot_product_attention(folded, k, v, attn_mask=mask).reshape(batch, heads, count, dim)
    if form == "expand":
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          enable_gqa=k.shape[1] != heads)


def plain_attention(q, k, v, mask, causal: bool):
    """The same as two products with a float32 softmax between them; each key-value head serves its group of
    query heads (head h reads kv head h // group), without repeating the keys. `mask` is boolean (True = seen)
    or float32 and added to the scores (0 = seen, -inf = not: `batch_mask`)."""
    batch, heads, count, dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = heads // kv_heads
    scores = torch.matmul(q.reshape(batch, kv_heads, group * count, dim), k.transpose(-1, -2)).float()
    scores = scores.mul_(dim ** -0.5).view(batch, kv_heads, group, count, length)
    if causal:
        mask = causal_mask(count, length - count, q.device)[None, None]
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    elif mask is not None:
        scores = scores.add_(mask[:, :, None])
    weights = torch.softmax(scores.view(batch, kv_heads, group * count, length), dim=-1).to(v.dtype)
    return torch.matmul(weights, v).view(batch, heads, count, dim)


def _in_float32(attention):
    """The kernel over a float32 KV cache: queries (and keys and values not yet float32) cast up, the output
    cast back. In bfloat16 this keeps the cache twice as large and the attention products in float32, which
    some CPUs run several times faster for the few rows of a decoding step."""
    def attend(q, k, v, mask, causal: bool):
        return attention(q.float(), k.float(), v.float(), mask, causal).to(q.dtype)
    return attend


def batch_mask(seen: torch.Tensor, kernel: str | None, dtype: torch.dtype) -> torch.Tensor:
    """A batched step's boolean mask [B, 1, 1, S] (True = seen; each row sees a prefix of the positions) as
    `kernel` reads it fastest when one mask serves every layer of a step:
    - the fused kernel takes each row's number of seen positions (an int64 tensor [B]) and reads nothing else;
    - plain products add a float32 mask to their float32 scores in place (measured on an AMD EPYC, 64 rows of
      320 positions over 30 layers: 29.9 ms against 33.6 ms for a boolean mask filled in on every layer);
    - SDPA takes it in its queries' dtype (float32 for the kernels over a float32 cache)."""
    if kernel is None:
        return seen
    if usable(kernel) == "fused":
        return seen.reshape(seen.shape[0], -1).sum(-1)
    return layer_mask(seen, kernel, dtype)


def layer_mask(mask: torch.Tensor, kernel: str, dtype: torch.dtype) -> torch.Tensor:
    """A step's boolean mask [B, 1, T, S] (True = seen) made once for every layer in the form the kernel named
    `kernel` adds to its scores: 0 where seen, -inf where not, in the queries' dtype for torch's SDPA (float32 for
    the kernels over a float32 cache), which otherwise makes that very mask from the boolean one in every call
    (two `where` of 11 us each a layer, measured with torch's profiler on an AMD EPYC Zen 3 for 4 tokens), and
    in float32 for the plain products, which add it in place. The same values enter the same sums: outputs do
    not change. The fused kernels read the boolean mask: it is returned as it is for them."""
    if kernel not in ATTENTION:
        return mask
    dtype = dtype if kernel == "sdpa" else torch.float32
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def fused_attention(q, k, v, lengths, causal: bool):
    """Batched decoding's attention in one C++ kernel (runtime/native_kernels.py): q [R, H, 1, D], k and v
    [>= R, Hkv, C, D] contiguous, row r attending over its first lengths[r] positions only."""
    return decode_attention_kernel()(q, k, v, lengths)


def _fits_kernel(q, k, v) -> bool:
    """q [1, H, T, D] and k, v [1, Hkv, S, D] as the fused row kernels read them: one row on the CPU, float32 or
    bfloat16 throughout, each head's positions D apart."""
    return q.shape[0] == 1 and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and \
        k.dtype == q.dtype == v.dtype and k.stride(3) == 1 and k.stride(2) == q.shape[-1] and k.stride() == v.stride()


def fused_row(q, k, v, mask, causal: bool):
    """A row's new tokens, q [1, H, T, D], over k and v [1, Hkv, S, D] (the cache's first S positions, the T new
    ones last, as the cache hands them out) in the fused C++ kernel, which reads them in place; token t attends
    positions 0 .. S - T + t. Every token is computed as one decoded alone is, so a chain's verification gives
    each token the output a one-token step gives it. Anything else (a mask, unless `for_mask` made a tree of it;
    several rows: a batched prefill; keys laid out otherwise; another dtype or device) goes to torch's kernels:
    two plain products for one token, SDPA for several (its flash kernel for a long prefill)."""
    kernel = causal_attention_kernel()
    count, length = q.shape[2], k.shape[2]
    if kernel is None or mask is not None or (count > 1 and not causal) or not _fits_kernel(q, k, v):
        if count == 1:
            return plain_attention(q, k, v, mask, causal)
        if causal and length > count:  # SDPA's is_causal aligns the queries with the first keys, not the last
            mask, causal = causal_mask(count, length - count, q.device)[None, None], False
        return sdpa_attention(q, k, v, mask, causal)
    return kernel(q[0].transpose(0, 1), k, v).transpose(0, 1)[None]


fused_row.causal_after_cache = True  # `causal` holds with cached positions before the new tokens too


def tree_plan(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The tree kernel's (lengths [T], gather [T + 1], gathered) for a mask [1, 1, T, S] (True = seen): each new
    token's sequence is the run of positions it sees from 0 on (the cache, and the new positions right after
    it, a chain's all of them), then the other positions it sees, in their order, gathered. A verified tree's
    nodes see the whole cache and their ancestors among the new positions; a head drafting a tree sees the
    true prefix, and its ancestors among the expanded nodes cached before. None for any other mask."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[1] != 1:
        return None
    count, length = mask.shape[2], mask.shape[3]
    if length < count:
        return None
    seen = mask[0, 0].cpu()
    sizes = seen.sum(1)
    if bool((sizes == 0).any()):
        return None
    lead = seen.cumprod(1).sum(1)  # positions seen from 0 on, without a gap: the contiguous run
    rest = seen.clone()
    rest[torch.arange(length)[None, :] < lead[:, None]] = False
    rows, columns = rest.nonzero(as_tuple=True)
    gather = torch.zeros(count + 1, dtype=torch.int64)
    gather[1:] = torch.bincount(rows, minlength=count).cumsum(0)
    return sizes.to(torch.int64), gather, columns.to(torch.int64)


def for_mask(attention, mask: torch.Tensor | None):
    """`attention` for one forward under `mask`: the fused row kernel turns a tree's mask into each node's
    ancestors once (`tree_plan`) and attends each node over the cache and them as a token decoded after that
    path is computed (bit for bit the same), rather than through SDPA under the mask; anything else as it was."""
    if attention is not fused_row or mask is None:
        return attention
    kernel = tree_attention_kernel()
    plan = None if kernel is None else tree_plan(mask)
    if plan is None:
        return attention

    def tree_row(q, k, v, mask, causal: bool):
        if q.shape[2] != plan[0].shape[0] or k.shape[2] != mask.shape[-1] or not _fits_kernel(q, k, v):
            return fused_row(q, k, v, mask, causal)
        return kernel(q[0].transpose(0, 1), k, v, *plan).transpose(0, 1)[None]

    return tree_row


ATTENTION = {"sdpa": sdpa_attention, "plain": plain_attention,
             "sdpa-f32": _in_float32(sdpa_attention), "plain-f32": _in_float32(plain_attention)}
F32_CACHE = ("sdpa-f32", "plain-f32")  # kernels that read a float32 cache


def row_attention(kernel: str):
    """The kernel named `kernel` for a row's new tokens: a key of ATTENTION, or "fused" (whose work falls to the
    plain products where the fused kernel no longer builds: a measured choice is cached, and the compiler may be
    gone since)."""
    return fused_row if kernel == "fused" else ATTENTION[kernel]


def attention_kernels(dtype: torch.dtype) -> list[str]:
    """The attention kernels measured in `dtype`, for a row's new tokens and for batched decoding alike: torch's
    (those of a float32 cache only below float32), and the fused ones where the runtime's extension builds here,
    for float32 and bfloat16 (the plain kernels serve float64)."""
    kernels = [a for a in ATTENTION if dtype != torch.float32 or a not in F32_CACHE]
    if dtype in (torch.float32, torch.bfloat16) and decode_attention_kernel() is not None:
        kernels.append("fused")
    return kernels


def usable(kernel: str) -> str:
    """`kernel`, or "plain" for "fused" where the fused kernel does not build (a machine's measured choice is
    cached, and its compiler may be gone since)."""
    return "plain" if kernel == "fused" and decode_attention_kernel() is None else kernel


def batch_attention(kernel: str):
    """The batch kernel named `kernel` (a key of ATTENTION, or "fused"), as `usable` allows."""
    kernel = usable(kernel)
    return fused_attention if kernel == "fused" else ATTENTION[kernel]
