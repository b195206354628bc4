"""The native runtime computes what transformers computes, for every architecture it claims (Llama, Mistral,
Qwen2 with q/k/v biases, Qwen3 with q/k norms), in float32: logits within 1e-4 relative, the same captured
layer states, the same cache after a rollback or a kept tree path; other architectures fall back."""

import logging

import pytest
import torch

from mtptrain.engine.generate import generate
from mtptrain.engine.tree import DraftTree
from mtptrain.runtime.runner import load_decoder, open_runner

TOL = 1e-4


def _model(kind: str, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-6)
    if kind == "llama":
        config = transformers.LlamaConfig(**common, tie_word_embeddings=True)
    elif kind == "llama3-rope":
        config = transformers.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    elif kind == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=None)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=False)
    elif kind == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=32)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    if kind == "qwen2":  # random biases: the fused product must add them
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max() / b.abs().max()) < TOL


ARCHITECTURES = ["llama", "llama3-rope", "mistral", "qwen2", "qwen3"]


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_logits_and_captured_states_match_transformers(kind):
    model = _model(kind)
    assert load_decoder(model) is not None
    capture = [0, 2]
    native, reference = open_runner(model, capture), open_runner(model, capture, runtime="transformers")
    assert (native.runtime, reference.runtime) == ("native", "transformers")
    prompt = torch.randint(0, 96, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    for runner in (native, reference):
        runner.reset()
    assert _close(native.forward(prompt), reference.forward(prompt))
    for layer in capture:
        assert _close(native.hidden[layer], reference.hidden[layer])
    assert _close(native.forward([5, 6, 7, 8]), reference.forward([5, 6, 7, 8]))  # a chain after the prefix
    native.rollback(39), reference.rollback(39)  # two of the four kept
    assert native.length == reference.length == 39
    assert _close(native.forward([9]), reference.forward([9]))
    assert _close(native.forward([3], last_only=True), reference.forward([3], last_only=True))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_verified_tree_and_its_kept_path_match_transformers(kind):
    model = _model(kind)
    prompt = list(range(10, 40))
    tree = DraftTree(tokens=[11, 12, 13, 14, 15], parents=[-1, -1, 0, 0, 2])
    native, reference = open_runner(model), open_runner(model, runtime="transformers")
    for runner in (native, reference):
        runner.reset()
        runner.forward(prompt)
    assert _close(native.forward_tree(7, tree), reference.forward_tree(7, tree))
    for runner in (native, reference):
        runner.keep(len(prompt) + 1, [0, 2, 4])  # pending, then nodes 0 -> 2 -> 4
    fresh = open_runner(model, runtime="transformers")
    fresh.reset()
    fresh.forward(prompt + [7, 11, 13, 15])
    after = [native.forward([20]), reference.forward([20]), fresh.forward([20])]
    assert _close(after[0], after[2]) and _close(after[1], after[2])


def test_greedy_generation_equals_transformers_generate():
    model = _model("qwen2")
    prompt = list(range(20, 45))
    tokens = generate(open_runner(model), prompt, 40).tokens
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, pad_token_id=0,
                              eos_token_id=None)[0, len(prompt):].tolist()
    assert tokens == expected


def test_fused_weights_are_shared_not_copied(monkeypatch):
    from mtptrain.runtime import choice, runner

    # plain weights (F.linear), whatever this machine measured: the layouts of packed and native are copies
    monkeypatch.setattr(runner, "choose", lambda config, device, requested="auto": choice.Choice(
        torch.float32, "linear", "plain", "sdpa", "set"))
    model = _model("qwen2")
    before = sum(p.numel() for p in model.parameters())
    decoder = load_decoder(model)
    attn, mlp, fused = model.model.layers[1].self_attn, model.model.layers[1].mlp, decoder.layers[1]
    assert attn.q_proj.weight.data_ptr() == fused.qkv.data_ptr()
    assert attn.v_proj.weight.untyped_storage().data_ptr() == fused.qkv.untyped_storage().data_ptr()
    assert attn.k_proj.bias.untyped_storage().data_ptr() == fused.qkv_bias.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == fused.gate_up.untyped_storage().data_ptr()
    assert sum(p.numel() for p in model.parameters()) == before
    assert load_decoder(model).layers[1].qkv.data_ptr() == fused.qkv.data_ptr()  # a second decoder: the same memory


def test_a_cast_model_gets_a_new_decoder_and_the_old_one_keeps_its_own_weights():
    model = _model("llama")
    first = load_decoder(model)
    model.to(torch.float64)
    second = load_decoder(model)
    assert second is not first and second.dtype == torch.float64
    assert first.dtype == torch.float32 and first.layers[0].qkv.dtype == torch.float32
    prompt = list(range(5, 25))
    native, reference = open_runner(model), open_runner(model, runtime="transformers")
    native.reset(), reference.reset()
    assert _close(native.forward(prompt), reference.forward(prompt))


def test_other_architectures_fall_back_to_transformers_with_one_log_line(caplog):
    import transformers

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64)).eval()
    with caplog.at_level(logging.INFO, logger="mtptrain.runtime.runner"):
        runner = open_runner(model)
        open_runner(model)
    assert runner.runtime == "transformers"
    lines = [r.getMessage() for r in caplog.records if "transformers' forward" in r.getMessage()]
    assert len(lines) == 1 and "gpt2" in lines[0]
    with pytest.raises(ValueError, match="target.runtime=native cannot run this model"):
        open_runner(model, runtime="native")


def test_the_cache_grows_past_its_first_capacity():
    model = _model("llama")
    native, reference = open_runner(model), open_runner(model, runtime="transformers")
    native.reset(), reference.reset()
    native.cache.reserve(0)
    capacity = native.cache.capacity
    prompt = torch.randint(0, 96, (capacity + 50,), generator=torch.Generator().manual_seed(2)).tolist()
    assert _close(native.forward(prompt, last_only=True), reference.forward(prompt, last_only=True))
    assert native.cache.capacity >= capacity + 50


def test_the_dtype_choice_is_measured_once_per_machine_and_can_be_overridden(tmp_path, monkeypatch):
    from mtptrain.runtime import choice

    monkeypatch.setenv("MTPTRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(choice, "other_load", lambda start, end: 0.0)  # a quiet machine: test_choice_cache.py has load
    config = _model("llama").config
    first = choice.choose(config, torch.device("cpu"))
    assert first.source == "measured" and first.dtype in (torch.float32, torch.bfloat16)
    timings = first.timings[str(first.dtype).removeprefix("torch.")]
    assert first.product == min(timings["products"], key=timings["products"].get)
    again = choice.choose(config, torch.device("cpu"))
    assert again.source == "cached" and again.dtype == first.dtype and again.timings == first.timings
    assert (tmp_path / "runtime-choice.json").is_file()
    forced = choice.choose(config, torch.device("cpu"), "float32")
    assert forced.source == "set" and forced.dtype == torch.float32
    assert choice.choose(config, torch.device("cuda"), "auto").dtype == torch.bfloat16


def test_bfloat16_is_chosen_only_where_it_is_clearly_faster():
    from mtptrain.runtime.choice import _faster_dtype

    def timings(f32, bf16):
        return {"float32": {"products": {"linear": f32 * 2, "native": f32}},
                "bfloat16": {"products": {"packed": bf16}}}
    assert _faster_dtype(timings(1.0, 0.6)) == torch.bfloat16
    assert _faster_dtype(timings(1.0, 0.9)) == torch.bfloat16
    assert _faster_dtype(timings(1.0, 0.95)) == torch.float32  # a near tie: the finer rounding
    assert _faster_dtype(timings(1.0, 2.0)) == torch.float32


@pytest.mark.real_model
def test_bfloat16_speculation_matches_the_runtimes_own_greedy_decoding_up_to_rounding_ties(tmp_path):
    """In bfloat16 a verification forward over several tokens rounds differently from a one-token step: a
    speculative output equals the runtime's autoregressive one, or first differs where the two best logits are
    within a few bfloat16 rounding steps of each other (eval's near-tie bound)."""
    from mtptrain.config import load_recipe
    from mtptrain.eval.run import run_eval

    recipe = load_recipe(None, ["target.dtype=bfloat16", "eval.methods=[ngram,chain,tree]", "eval.k=[3]",
                                "eval.tree.budgets=[8]", "eval.max_prompts=3", "eval.max_turns=1",
                                "eval.max_new_tokens=40", "eval.repeats=1", f"eval.output_dir={tmp_path}",
                                "tracking.wandb=disabled", f"train.output_dir={tmp_path / 'none'}"])
    results = run_eval(recipe, show_progress=False)
    assert results["machine"]["dtype"] == "torch.bfloat16" and results["machine"]["runtime"].startswith("mtptrain")
    # The runtime's own products and attention give a token the same logits in a chain or a tree as alone (each
    # row's sums in a fixed order): where this CPU runs them in bfloat16, every method equals the baseline exactly.
    runtime = results["machine"]["runtime"]
    row_exact = "products native" in runtime and "/ fused /" in runtime
    for m in results["methods"][1:]:
        e = m["exactness"]
        assert e["checked"] == 3 and not e["failures"], m["label"]
        assert e["identical"] + len(e["near_ties"]) == 3
        for tie in e["near_ties"]:
            assert tie["top2_gap"] < tie["bound"] <= 4 * 2.0 ** -7 * 64  # 4 steps of a logit below 64
        if row_exact:
            assert e["identical"] == 3, (m["label"], e["near_ties"])
    assert any(m["tau"] > 1.1 for m in results["methods"][1:])


@pytest.fixture
def packed(monkeypatch):
    """The runtime packs weights for oneDNN whatever this machine measured."""
    from mtptrain.runtime import choice, runner

    def packing(config, device, requested="auto"):
        dtype = torch.float32 if requested == "auto" else getattr(torch, requested)
        return choice.Choice(dtype, "packed", "plain", "sdpa", "set")
    monkeypatch.setattr(runner, "choose", packing)


@pytest.fixture
def native_kernels(monkeypatch):
    """The runtime runs its own product and one-token attention kernel, whatever this machine measured (float32,
    so that transformers' logits are the reference within 1e-4); batches on oneDNN's packed product."""
    from mtptrain.runtime import choice, runner

    batch = "packed" if torch.backends.mkldnn.is_available() else "linear"
    def own(config, device, requested="auto"):
        dtype = torch.float32 if requested == "auto" else getattr(torch, requested)
        return choice.Choice(dtype, "native", "fused", "fused", "set", attention_batch="fused", product_batch=batch)
    monkeypatch.setattr(runner, "choose", own)


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_the_native_product_and_fused_attention_match_transformers(native_kernels, kind):
    kernels = open_runner(_model(kind)).decoder.kernels
    assert kernels.attention_one.__name__ == kernels.attention_many.__name__ == "fused_row"
    assert kernels.causal_after_cache  # a chain after the prefix runs without a mask
    test_logits_and_captured_states_match_transformers(kind)
    if kind in ("llama", "qwen3"):
        test_a_verified_tree_and_its_kept_path_match_transformers(kind)
    if kind == "qwen2":
        test_greedy_generation_equals_transformers_generate()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_verified_tree_gives_each_node_what_one_token_steps_along_its_path_give(native_kernels, kind, dtype):
    """On the runtime's own product and attention kernels, a tree's forward gives every node, bit for bit, the
    logits of one-token steps over its path: a tree's accepted path is what decoding it would have given, in
    bfloat16 too."""
    model = _model(kind).to(dtype)
    tree = DraftTree(tokens=[11, 12, 13, 14, 15, 16], parents=[-1, -1, 0, 0, 2, 4])
    prompt = list(range(10, 47))
    runner = open_runner(model)
    assert runner.decoder.dtype == dtype
    runner.reset()
    runner.forward(prompt)
    logits = runner.forward_tree(7, tree)
    for node in range(-1, len(tree)):
        path = []
        while node >= 0:
            path, node = [node, *path], tree.parents[node]
        steps = open_runner(model)
        steps.reset()
        steps.forward(prompt)
        for token in [7] + [tree.tokens[n] for n in path]:
            last = steps.forward([token])[-1]
        assert torch.equal(logits[(path[-1] + 1) if path else 0], last), (kind, dtype, path)


def test_a_cached_native_choice_without_its_kernel_runs_torchs_product(native_kernels, monkeypatch):
    """A machine's measured choice is cached; if the runtime's kernels no longer build there (the compiler gone),
    the decoder multiplies with oneDNN's packed product, or F.linear, instead of the native one."""
    from mtptrain.runtime import products

    monkeypatch.setattr(products, "blocked_linear_kernel", lambda dtype: None)
    model = _model("llama")
    native, reference = open_runner(model), open_runner(model, runtime="transformers")
    assert native.decoder.product == ("packed" if torch.backends.mkldnn.is_available() else "linear")
    prompt = list(range(3, 30))
    native.reset(), reference.reset()
    assert _close(native.forward(prompt), reference.forward(prompt))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_batches_run_packed_weights_beside_a_native_batch_one_decoder(native_kernels):
    """Where the measured batch product is another than the batch-1 one, a batched decoder (regenerate,
    precompute) holds its weights in the layout of its product and the batch-1 decoder in its own: the two run
    in turn on one model, each on its own weights."""
    from mtptrain.runtime.batch import capture_states

    model = _model("llama")
    ids = torch.randint(0, 96, (3, 20), generator=torch.Generator().manual_seed(4))
    reference = open_runner(model, (1,), runtime="transformers")
    reference.reset()
    reference.forward(ids[0].tolist())
    expected = reference.hidden[1]
    one = open_runner(model, (1,))
    batched = load_decoder(model, batched=True)
    assert one.decoder.product == "native" and batched.product == "packed"
    for _ in range(2):
        assert _close(capture_states(batched, ids, [1])[1][0], expected)
        one.reset()
        one.forward(ids[0].tolist())
        assert _close(one.hidden[1], expected)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_packed_weights_are_the_runtimes_own_and_the_model_is_left_as_it_was(packed, kind):
    model = _model(kind)
    prompt = list(range(10, 42))
    with torch.no_grad():
        before = model(torch.tensor([prompt])).logits[0]
    plain = {name: p.detach().clone() for name, p in model.named_parameters()}
    native = open_runner(model)
    assert native.decoder.product == "packed"
    assert not any(p.device.type == "meta" for p in model.parameters())
    native.reset()
    assert _close(native.forward(prompt), before)
    with torch.no_grad():  # transformers' forward runs the model's own weights, bit for bit as before
        assert torch.equal(model(torch.tensor([prompt])).logits[0], before)
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and torch.equal(p, plain[name]), name
    native.reset()  # and the runtime still runs its own
    assert _close(native.forward(prompt), before)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_a_truncated_draft_model_shares_the_packed_layers(packed):
    from mtptrain.engine.draft_model import truncated_target

    model = _model("llama")
    main = open_runner(model)
    draft = open_runner(main.decoder.truncated(2))
    assert draft.runtime == "native" and all(a is b for a, b in zip(draft.decoder.layers, main.decoder.layers))
    assert len(draft.decoder.layers) == 2 and len(main.decoder.layers) == 3
    reference = open_runner(truncated_target(model, 2), runtime="transformers")
    prompt = list(range(5, 30))
    for runner in (main, draft, reference):
        runner.reset()
    main.forward(prompt)
    assert _close(draft.forward(prompt), reference.forward(prompt))
    with pytest.raises(ValueError, match="keeps 1..2 of its 3 layers"):
        main.decoder.truncated(3)


def test_a_target_the_runtime_does_not_run_loads_in_float32_and_decodes_on_transformers(tmp_path):
    import transformers
    from conftest import make_tokenizer

    from mtptrain.config import TargetConfig
    from mtptrain.target import load_target

    tok = make_tokenizer()
    config = transformers.Phi3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                                     eos_token_id=3)
    transformers.Phi3ForCausalLM(config).save_pretrained(tmp_path)  # fused qkv_proj: not a layout the runtime runs
    tok.save_pretrained(tmp_path)
    target = load_target(TargetConfig(model=str(tmp_path)))  # dtype auto: nothing measured for a phi3
    assert next(target.model.parameters()).dtype == torch.float32
    runner = open_runner(target.model)
    assert runner.runtime == "transformers"
    assert len(generate(runner, [5, 6, 7], 6).tokens) == 6


def test_rotary_tables_take_their_size_from_the_host_not_from_the_positions(monkeypatch):
    """Reading the largest position from the tensor makes the host wait for the GPU on every forward (batch-1
    decoding is host-bound there): each forward, a chain's, a tree's and the head's steps alike, hands the rotary
    tables a bound its cache knows. Positions on the meta device hold no value to read."""
    from mtptrain.runtime.model import RopeTables

    model = _model("llama")
    tables = RopeTables(model.model.rotary_emb, torch.float32, torch.device("cpu"))
    with pytest.raises(Exception):
        tables(torch.arange(5, device="meta")[None])
    bounds = []
    original = RopeTables.__call__
    monkeypatch.setattr(RopeTables, "__call__", lambda self, positions, bound=None: bounds.append(bound) or
                        original(self, positions, bound))
    runner = open_runner(model)
    runner.reset()
    runner.forward([1, 2, 3, 4])
    runner.forward([5])
    runner.forward_tree(6, DraftTree([7, 8, 9], [-1, 0, -1]))
    assert bounds == [4, 5, 9]
    cos, _ = original(tables, torch.tensor([[0, 3]]), 4)
    torch.testing.assert_close(cos, original(tables, torch.tensor([[0, 3]]))[0])
