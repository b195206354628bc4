"""The fused decode-attention kernel (mtptrain/runtime/csrc/decode_attention.cpp) computes what
`attention.plain_attention` computes over a masked rectangle: in float32 within 1e-5, in bfloat16 within the
output's rounding of a float64 reference and no further from it than plain_attention. It reads nothing past a
row's length (NaN there changes nothing), checks its inputs, and builds here: a build failure fails the tests.
The step kernel beside it (batched decoding's writes and attention of a band, prompt chunks included) writes
every entry where it belongs, attends each causally within its row, and rejects bad entries before writing."""

import logging

import pytest
import torch

from mtptrain.engine.tree import DraftTree
from mtptrain.runtime import native_kernels
from mtptrain.runtime.attention import plain_attention
from mtptrain.runtime.native_kernels import decode_attention_kernel, extension, extension_name


@pytest.fixture(scope="module")
def attend():
    kernel = decode_attention_kernel()
    assert kernel is not None, "the decode attention kernel did not build (see the warning logged above)"
    return kernel


def _inputs(rows, heads, kv_heads, dim, capacity, dtype, spare_rows=2, seed=0):
    """q as the runtime passes it (a transposed view), keys and values with `spare_rows` rows more than q,
    lengths from 1 to the capacity (both ends included)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, 1, heads, dim, generator=g).to(dtype).transpose(1, 2)
    keys = torch.randn(rows + spare_rows, kv_heads, capacity, dim, generator=g).to(dtype)
    values = torch.randn(rows + spare_rows, kv_heads, capacity, dim, generator=g).to(dtype)
    lengths = torch.randint(1, capacity + 1, (rows,), generator=g)
    lengths[0] = 1
    lengths[-1] = capacity
    if rows > 2:
        lengths[1] = capacity - 1
    return q, keys, values, lengths


def _poisoned(tensor, lengths):
    """A copy with NaN at every position the kernel must not read: past each row's length, and in the rows
    past q's."""
    out = tensor.clone()
    out[len(lengths):] = float("nan")
    for row, length in enumerate(lengths.tolist()):
        out[row, :, length:] = float("nan")
    return out


def _plain(q, keys, values, lengths):
    rows, capacity = len(lengths), keys.shape[2]
    seen = (torch.arange(capacity)[None] < lengths[:, None])[:, None, None, :]
    return plain_attention(q, keys[:rows], values[:rows], seen, False)


def _float64(q, keys, values, lengths):
    """softmax(q.k / sqrt(D)) . v in float64, row by row over each row's live positions."""
    rows, heads, _, dim = q.shape
    group = heads // keys.shape[1]
    out = torch.empty(rows, heads, 1, dim, dtype=torch.float64)
    for row, length in enumerate(lengths.tolist()):
        k = keys[row, :, :length].double().repeat_interleave(group, 0)
        v = values[row, :, :length].double().repeat_interleave(group, 0)
        weights = torch.softmax(q[row].double() @ k.transpose(-1, -2) * dim ** -0.5, dim=-1)
        out[row] = weights @ v
    return out


SHAPES = [  # rows, heads, kv_heads, dim, capacity
    (1, 9, 3, 64, 200),    # SmolLM2's heads, one row
    (37, 8, 2, 128, 300),  # D = 128, a group of 4 (more heads than one value pass holds)
    (5, 4, 4, 80, 70),     # the generic path (D = 80), no grouping
    (3, 16, 2, 64, 150),   # a group of 8
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "R{}-H{}-Hkv{}-D{}-C{}".format(*s))
def test_float32_matches_plain_attention_and_reads_no_position_past_a_row(attend, shape):
    rows, heads, kv_heads, dim, capacity = shape
    q, keys, values, lengths = _inputs(rows, heads, kv_heads, dim, capacity, torch.float32)
    expected = _plain(q, keys, values, lengths)
    out = attend(q, _poisoned(keys, lengths), _poisoned(values, lengths), lengths)
    assert out.shape == (rows, heads, 1, dim) and out.dtype == torch.float32 and out.is_contiguous()
    assert torch.isfinite(out).all()
    assert float((out - expected).abs().max()) <= 1e-5
    assert float((out.double() - _float64(q, keys, values, lengths)).abs().max()) <= 1e-5
    assert torch.equal(out, attend(q, keys, values, lengths))  # the NaN tails changed nothing


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "R{}-H{}-Hkv{}-D{}-C{}".format(*s))
def test_bfloat16_is_the_float64_result_rounded_and_closer_than_plain_attention(attend, shape):
    rows, heads, kv_heads, dim, capacity = shape
    q, keys, values, lengths = _inputs(rows, heads, kv_heads, dim, capacity, torch.bfloat16, seed=1)
    reference = _float64(q, keys, values, lengths)
    out = attend(q, _poisoned(keys, lengths), _poisoned(values, lengths), lengths)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference, rtol=1e-2, atol=1e-4)
    # plain_attention rounds its scores and weights to bfloat16 as well as its output
    mine = (out.double() - reference).abs()
    plain = (_plain(q, keys, values, lengths).double() - reference).abs()
    assert float(mine.max()) <= float(plain.max()) + 1e-6
    assert float(mine.mean()) <= float(plain.mean())
    assert torch.equal(out, attend(q, keys, values, lengths))


def test_the_result_does_not_depend_on_the_thread_count(attend):
    q, keys, values, lengths = _inputs(64, 9, 3, 64, 256, torch.bfloat16, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attend(q, keys, values, lengths)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, attend(q, keys, values, lengths))


@pytest.mark.parametrize("fault, message", [
    ("dtype", "must have q's dtype"),
    ("zero length", "has length 0, outside 1 .. 16"),
    ("long length", "has length 17, outside 1 .. 16"),
    ("heads", "not a multiple"),
    ("lengths dtype", "lengths must be an int64 CPU tensor"),
    ("strided keys", "one after another"),
])
def test_bad_inputs_raise_a_clear_error(attend, fault, message):
    q, keys, values, lengths = _inputs(3, 4, 2, 64, 16, torch.float32)
    if fault == "dtype":
        q = q.to(torch.bfloat16)
    elif fault == "zero length":
        lengths[1] = 0
    elif fault == "long length":
        lengths[1] = 17
    elif fault == "heads":
        keys, values = keys[:, :1].expand(-1, 3, -1, -1).contiguous(), values[:, :1].expand(-1, 3, -1, -1).contiguous()
    elif fault == "lengths dtype":
        lengths = lengths.int()
    elif fault == "strided keys":
        keys = keys.transpose(2, 3).contiguous().transpose(2, 3)
    with pytest.raises(RuntimeError, match=message):
        attend(q, keys, values, lengths)


def test_the_extension_name_follows_the_source_torch_and_the_cpu(monkeypatch, tmp_path):
    source = tmp_path / "kernel.cpp"
    source.write_text("int x;\n")
    helper = tmp_path / "helper.cpp"
    helper.write_text("int z;\n")
    name = extension_name([source, helper])
    assert name.startswith("mtptrain_kernel_") and name.isidentifier()
    assert extension_name([source, helper]) == name
    monkeypatch.setattr(native_kernels, "cpu_flags", lambda: "fpu sse2 avx2")
    other_cpu = extension_name([source, helper])
    assert other_cpu != name
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert extension_name([source, helper]) not in (name, other_cpu)
    helper.write_text("int y;\n")  # any source, not only the first
    assert extension_name([source, helper]) not in (name, other_cpu)


def test_a_failed_build_warns_once_and_returns_none(monkeypatch, tmp_path, caplog):
    source = tmp_path / "broken.cpp"
    source.write_text("#error deliberately broken\n")
    monkeypatch.setattr(native_kernels, "SOURCES", [source])
    monkeypatch.setenv("MTPTRAIN_CACHE", str(tmp_path / "cache"))
    extension.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=native_kernels.__name__):
            assert decode_attention_kernel() is None
            assert decode_attention_kernel() is None  # tried once per process
        mine = [r for r in caplog.records if r.name == native_kernels.__name__]
        warnings = [r for r in mine if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "deliberately broken" in warnings[0].getMessage()
        said = [r.getMessage() for r in mine if r.levelno == logging.INFO]
        assert said[0].startswith("compiling")  # the first run's wait is announced
    finally:
        extension.cache_clear()  # the real kernel again for whatever runs next


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next(attend):
    """torch's loader waits for its `lock` file to vanish; a build killed midway leaves it. The next load removes
    it (it holds the build directory alone, by an flock the kernel drops when its holder dies) and goes on."""
    import threading

    from mtptrain.io import cache_root

    lock = cache_root() / "kernels" / extension_name() / "lock"
    lock.write_text("")  # as a build killed before its end leaves it
    extension.cache_clear()
    loaded = []
    try:
        loader = threading.Thread(target=lambda: loaded.append(decode_attention_kernel()), daemon=True)
        loader.start()
        loader.join(timeout=120)
        assert loaded and loaded[0] is not None, "the loader still waits on the stale lock"
        assert not lock.exists()
    finally:
        lock.unlink(missing_ok=True)  # let a hung loader thread finish rather than spin for ever
        extension.cache_clear()


# ---------------------------------------------------------------------------------------------------------
# The step kernel: one band's writes and attention in a batched step (runtime/batch.py's _Step).

@pytest.fixture(scope="module")
def step():
    kernel = native_kernels.step_attention_kernel()
    assert kernel is not None, "the step attention kernel did not build (see the warning logged above)"
    return kernel


def _step_inputs(dtype, seed=0):
    """A band of 6 cache rows (2 spare) holding 10, 50, 100, 0, 200 and 33 positions; row 1 takes a chunk of 5
    tokens before its own, row 3 (empty) a chunk of 4. The step's tokens come as the runtime lays them out:
    q, k and v views of one [N, H + 2 Hkv, D] product. Returns the entries as (row, position) per token, in an
    order that is not the tokens' (entries need not be sorted)."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim, capacity = 9, 3, 64, 256
    held = [10, 50, 100, 0, 200, 33]
    chunks = {1: 5, 3: 4}
    entries = []
    for row, length in enumerate(held):
        entries += [(row, p) for p in range(length, length + chunks.get(row, 0) + 1)]
    keys = torch.randn(len(held) + 2, kv_heads, capacity, dim, generator=g).to(dtype)
    values = torch.randn(len(held) + 2, kv_heads, capacity, dim, generator=g).to(dtype)
    for row, length in enumerate(held):  # what the kernel must neither read nor keep
        keys[row, :, length:] = values[row, :, length:] = float("nan")
    keys[len(held):] = values[len(held):] = float("nan")
    qkv = torch.randn(len(entries), heads + 2 * kv_heads, dim, generator=g).to(dtype)
    q, k, v = qkv[:, :heads], qkv[:, heads: heads + kv_heads], qkv[:, heads + kv_heads:]
    order = torch.randperm(len(entries), generator=g)
    tokens = order.clone()
    rows = torch.tensor([entries[i][0] for i in order.tolist()])
    positions = torch.tensor([entries[i][1] for i in order.tolist()])
    return q, k, v, keys, values, entries, tokens, rows, positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_step_kernel_writes_every_entry_and_attends_causally_within_its_row(step, dtype):
    q, k, v, keys, values, entries, tokens, rows, positions = _step_inputs(dtype)
    expect_keys, expect_values = keys.clone(), values.clone()
    for token, (row, position) in enumerate(entries):
        expect_keys[row, :, position], expect_values[row, :, position] = k[token], v[token]
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    step(q, k, v, keys, values, tokens, rows, positions, out)
    assert torch.equal(keys.nan_to_num(7.0), expect_keys.nan_to_num(7.0))
    assert torch.equal(values.nan_to_num(7.0), expect_values.nan_to_num(7.0))
    for token, (row, position) in enumerate(entries):
        n = position + 1  # its row's positions up to its own: the chunk's later tokens are not seen
        lengths = torch.tensor([n])
        reference = _float64(q[token][None, :, None], expect_keys[row: row + 1], expect_values[row: row + 1], lengths)
        error = (out[token].double() - reference[0, :, 0]).abs().max()
        tolerance = 1e-5 if dtype == torch.float32 else 2 ** -8 * float(reference.abs().max())
        assert float(error) <= tolerance, (token, row, position, float(error))


def test_the_step_kernel_leaves_other_tokens_alone(step):
    q, k, v, keys, values, entries, tokens, rows, positions = _step_inputs(torch.float32, seed=1)
    mine = [i for i, (row, _) in enumerate(entries) if row != 2]  # this call's band lacks row 2's token
    pick = torch.tensor([m for m, token in enumerate(tokens.tolist()) if token in mine])
    out = torch.full(q.shape, 5.0)
    step(q, k, v, keys, values, tokens[pick], rows[pick], positions[pick], out)
    other = [i for i, (row, _) in enumerate(entries) if row == 2]
    assert bool((out[other] == 5.0).all()) and not bool((out[mine] == 5.0).any())
    assert bool(keys[2, :, 100].isnan().all())  # row 2's own position was not written


@pytest.mark.parametrize("fault, message", [
    ("token", "names token 99, outside 0 .. 14"),
    ("row", "names cache row 8, outside 0 .. 7"),
    ("position", "writes position 256, outside 0 .. 255"),
    ("entries", "rows must be an int64 CPU tensor of 15 entries"),
    ("out", "out must be"),
    ("new keys", "k_new and v_new must be"),
])
def test_the_step_kernel_rejects_bad_entries_before_writing(step, fault, message):
    q, k, v, keys, values, _, tokens, rows, positions = _step_inputs(torch.float32)
    before = keys.clone()
    out = torch.empty(q.shape)
    if fault == "token":
        tokens[3] = 99
    elif fault == "row":
        rows[3] = 8
    elif fault == "position":
        positions[3] = 256
    elif fault == "entries":
        rows = rows[:-1]
    elif fault == "out":
        out = torch.empty(q.shape[0], q.shape[2], q.shape[1]).transpose(1, 2)
    elif fault == "new keys":
        k = k[:, :2]
    with pytest.raises(RuntimeError, match=message):
        step(q, k, v, keys, values, tokens, rows, positions, out)
    assert torch.equal(keys.nan_to_num(7.0), before.nan_to_num(7.0))


# A draft tree of 7 nodes: with the pending token, 8 tokens to verify.
TREE = DraftTree(tokens=[0] * 7, parents=[-1, -1, 0, 0, 2, 1, 4])


def _tree_mask(tree: DraftTree, past: int) -> torch.Tensor:
    """The mask [1, 1, N + 1, past + N + 1] of `tree`'s verification after `past` cached positions, as
    FastRunner.forward_tree makes it; row t's True columns are token t's sequence."""
    seen = tree.visibility()
    return torch.cat([torch.ones(len(seen), past, dtype=torch.bool), seen], dim=1)[None, None]


@pytest.mark.parametrize("masked", ["verified", "drafting"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(9, 3, 64, 37), (8, 2, 128, 48), (4, 4, 80, 20), (16, 2, 64, 5), (9, 3, 64, 0)])
def test_the_tree_kernel_gives_each_node_what_decoding_its_path_gives(attend, dtype, shape, masked):
    """Each node attends over the cache and then its ancestors and itself, gathered: bit for bit what
    decode_attention computes over a row holding that sequence, whatever the prefix's length against the
    kernel's blocks of 16 positions (37, 48, 5, none), on both of its paths (D 64 and 128, and 80). For a
    verified tree's nodes, and for a drafting head's, which see their ancestors past gaps in the cache."""
    from mtptrain.runtime.attention import tree_plan
    from mtptrain.runtime.native_kernels import tree_attention_kernel

    heads, kv_heads, dim, past = shape
    mask = _tree_mask(TREE, past) if masked == "verified" else _drafting_mask(past)
    count, length = mask.shape[2], mask.shape[3]
    g = torch.Generator().manual_seed(5)
    keys, values = (torch.randn(1, kv_heads, length + 7, dim, generator=g).to(dtype) for _ in range(2))
    k, v = keys[:, :, :length], values[:, :, :length]  # views, as the cache hands them out
    q = torch.randn(count, heads, dim, generator=g).to(dtype)
    out = tree_attention_kernel()(q, k, v, *tree_plan(mask))
    for node in range(count):
        positions = mask[0, 0, node].nonzero().flatten().tolist()  # the cache, then its path
        row_k, row_v = k[:, :, positions].contiguous(), v[:, :, positions].contiguous()
        alone = attend(q[node][None, :, None], row_k, row_v, torch.tensor([len(positions)]))
        assert torch.equal(out[node], alone[0, :, 0]), node


def _drafting_mask(past: int) -> torch.Tensor:
    """A head's mask drafting a tree's third level after `past` true positions: the cache holds them, then the
    first level's 3 nodes and the second level's 3 (each under one of the first); the 2 new nodes see the true
    prefix and their own ancestors (the second under a node at the cache's first expanded slot), and a third row
    (no true prefix: a one-token prompt's) sees only its ancestors and itself."""
    mask = torch.zeros(1, 1, 3, past + 6 + 3, dtype=torch.bool)
    mask[0, 0, :2, :past] = True
    for row, ancestors in enumerate([(0, 3), (0, 4), (2, 5)]):
        for slot in ancestors:
            mask[0, 0, row, past + slot] = True
        mask[0, 0, row, past + 6 + row] = True
    return mask


def test_a_tree_plan_folds_the_run_from_the_first_position_and_gathers_the_rest():
    from mtptrain.runtime.attention import tree_plan

    lengths, gather, gathered = tree_plan(_tree_mask(DraftTree([0] * 3, [-1, -1, 0]), past=3))
    # sequences: node 0 [.., 3]; 1 [.., 3, 4]; 2 [.., 3] + [5]; 3 [.., 3, 4] + [6]
    assert lengths.tolist() == [4, 5, 5, 6]
    assert gather.tolist() == [0, 0, 0, 1, 2] and gathered.tolist() == [5, 6]
    chain = torch.ones(1, 1, 4, 10, dtype=torch.bool).tril(6)
    lengths, gather, gathered = tree_plan(chain)
    assert lengths.tolist() == [7, 8, 9, 10] and gather.tolist() == [0] * 5 and gathered.numel() == 0
    gap = _tree_mask(DraftTree.chain([0]), past=4)
    gap[..., 1, 2] = False  # a node that does not see all of the cache (a head drafting a tree): gathered past it
    lengths, gather, gathered = tree_plan(gap)
    assert lengths.tolist() == [5, 5] and gather.tolist() == [0, 0, 3] and gathered.tolist() == [3, 4, 5]
    blind = gap.clone()
    blind[..., 1, :] = False  # a row that sees nothing has no attention to compute
    assert tree_plan(blind) is None
    assert tree_plan(torch.zeros(1, 1, 2, 6)) is None  # an additive float mask


@pytest.mark.parametrize("fault, message", [
    ("gather", "gather must start at 0"),
    ("length", "node 1 has length"),
    ("position", "gathered position 99"),
])
def test_the_tree_kernel_rejects_a_bad_plan(fault, message):
    from mtptrain.runtime.attention import tree_plan
    from mtptrain.runtime.native_kernels import tree_attention_kernel

    k = v = torch.randn(1, 2, 14, 64)
    q = torch.randn(8, 4, 64)
    lengths, gather, gathered = tree_plan(_tree_mask(TREE, 6))
    if fault == "gather":
        gather = gather + 1
    elif fault == "length":
        lengths[1] = 15
    else:
        gathered[0] = 99
    with pytest.raises(RuntimeError, match=message):
        tree_attention_kernel()(q, k, v, lengths, gather, gathered)
