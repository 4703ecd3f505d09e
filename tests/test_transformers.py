"""The transformers attention implementation "varlen" against transformers' own ones.

Tiny Llama (GQA 4:2) and Qwen2 (MQA 4:1, qkv bias, sliding-window layers) models built from
configs with random weights (nothing is downloaded), in float32 (against "eager") and float64
(against "sdpa"), and tiny gpt-oss (learnable attention sinks, alternating sliding-window
layers) and DeepSeek-V3 (MLA: query/key head dim 24, value head dim 16) in float32 against
"eager" (their experts run in float32 only): logits and every
parameter's gradient on padded batches (left and right padding; holes for Llama, whose layers
have no window that would count the holes) and packed batches (documents marked by position
ids or by `DataCollatorWithFlattening`'s kwargs, with and without a cache), greedy generation
with a cache, and decoding without a mask. Attention dropout in training: repeatable under
one torch.manual_seed, the core API's pairs for the drawn seed, a plausible dropped fraction,
and eval mode still eager's.
"""
import inspect

import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import varlen.torch as vt  # noqa: E402

vt.register_transformers()

VOCAB = 101


def llama():
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def qwen2():
    # Layers from max_window_layers on use a sliding window of 4 tokens.
    return transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, use_sliding_window=True, sliding_window=4,
        max_window_layers=1, max_position_embeddings=128)


def gpt_oss():
    # sliding-window (4 tokens) and full layers; one sink logit per query head
    return transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128)


def deepseek_v3():
    # MLA: q/k heads of 16 + 8 (no rope + rope) dims, v heads of 16; one dense, one MoE layer
    return transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
        topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=128)


CONFIGS = {"llama": llama, "qwen2": qwen2, "gpt-oss": gpt_oss, "deepseek-v3": deepseek_v3}
# Largest error allowed, relative to the largest reference value: float64 differs only in
# summation order; float32 by a few hundred ulps through the layers.
RTOL = {torch.float32: 2e-5, torch.float64: 1e-11}


# The implementation compared with: eager in float32; sdpa in float64, where eager's additive
# mask (the dtype's lowest value) overflows to -inf on left-padded rows and spreads NaN.
REFERENCE = {torch.float32: "eager", torch.float64: "sdpa"}


def pair(name, dtype, reference=None):
    """The same random model twice: with the reference attn_implementation and "varlen"."""
    models = []
    for impl in (reference or REFERENCE[dtype], "varlen"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](),
                                                              attn_implementation=impl)
        with torch.no_grad():       # sinks start at 0: make them matter
            for pname, p in model.named_parameters():
                if pname.endswith("sinks"):
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
        models.append(model.to(dtype).eval())
    assert models[1].config._attn_implementation == "varlen"
    return models


def assert_close(label, got, want, dtype):
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= RTOL[dtype] * max(scale, 1e-30), (
        f"{label}: max abs error {err:.3e} > {RTOL[dtype]:.0e} x max |reference| {scale:.3e}")


def logits_and_grads(model, keep, **inputs):
    """Logits at the positions `keep` marks, and every parameter's gradient of a fixed random
    weighting of them (so that each position and vocabulary entry matters)."""
    model.zero_grad()
    logits = model(**inputs).logits
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1),
                          dtype=logits.dtype)
    (logits * weights)[keep].sum().backward()
    return logits[keep].detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_model_outputs(label, got, want, dtype):
    assert_close(f"{label} logits", got[0], want[0], dtype)
    assert want[1].keys() == got[1].keys()
    for name, g in want[1].items():
        assert_close(f"{label} grad {name}", got[1][name], g, dtype)


def ids(*shape, seed=2):
    return torch.randint(1, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def padding_masks(S, holes):
    pos = torch.arange(S)
    rows = [pos >= 4, pos < S - 3, pos >= 0, pos >= S - 1]  # left, right, none, one token
    if holes:
        rows.append((pos % 3 != 1) & (pos != S - 2))
    return torch.stack(rows).long()


DTYPE_IDS = {torch.float32: "float32", torch.float64: "float64"}
both = pytest.mark.parametrize("name", ["llama", "qwen2"])
dtypes = pytest.mark.parametrize("dtype", DTYPE_IDS, ids=DTYPE_IDS.get)


@both
@dtypes
def test_padded_batch(name, dtype):
    reference, varlen_model = pair(name, dtype)
    mask = padding_masks(13, holes=name == "llama")
    inputs = dict(input_ids=ids(*mask.shape), attention_mask=mask)
    keep = mask.bool()
    assert_same_model_outputs(f"{name} padded", logits_and_grads(varlen_model, keep, **inputs),
                              logits_and_grads(reference, keep, **inputs), dtype)


@pytest.mark.parametrize("name", ["gpt-oss", "deepseek-v3"])
def test_sinks_and_mla_models(name):
    """gpt-oss's sinks (and their gradients) and DeepSeek-V3's value head dim below the
    query's: padded batches (left, right, one token; holes where no layer has a window)
    against eager, logits and gradients; packed documents against each run alone."""
    dtype = torch.float32
    reference, varlen_model = pair(name, dtype, reference="eager")
    mask = padding_masks(13, holes=name == "deepseek-v3")
    inputs = dict(input_ids=ids(*mask.shape), attention_mask=mask)
    keep = mask.bool()
    got = logits_and_grads(varlen_model, keep, **inputs)
    assert_same_model_outputs(f"{name} padded", got,
                              logits_and_grads(reference, keep, **inputs), dtype)
    if name == "gpt-oss":
        assert any(n.endswith("sinks") and g.abs().max() > 0 for n, g in got[1].items())
    # packed documents (transformers' eager path may not split them): each as run alone
    inputs = packed_inputs()
    with torch.no_grad():
        got = varlen_model(**inputs, use_cache=False).logits[0]
        start = 0
        for n in DOCS:
            alone = reference(input_ids=inputs["input_ids"][:, start:start + n]).logits[0]
            assert_close(f"{name} document at {start}", got[start:start + n], alone, dtype)
            start += n


def test_sliding_window_with_holes_is_refused():
    """A hole in a padding mask with a sliding window: transformers counts the window in
    positions, varlen counted the packed tokens (logits 0.15 off); refused with its reason.
    Without holes (left and right padding) the sliding-window model matches exactly
    (test_padded_batch)."""
    _, varlen_model = pair("qwen2", torch.float32)
    mask = padding_masks(13, holes=True)
    with pytest.raises(ValueError, match=r"sliding window with a padding mask that has holes"):
        varlen_model(input_ids=ids(*mask.shape), attention_mask=mask)
    assert varlen_model(input_ids=ids(4, 13), attention_mask=mask[:4]).logits.isfinite().all()


def test_output_attentions_gives_no_weights_as_documented():
    """docs/dropin.md: no weights, `attentions` an empty tuple (as sdpa gives); it said
    per-layer None."""
    _, varlen_model = pair("llama", torch.float32)
    out = varlen_model(input_ids=ids(1, 5), output_attentions=True)
    assert out.attentions == ()
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "dropin.md")) as f:
        assert "`attentions` is an empty tuple" in f.read().replace("\n", " ")


DOCS = (5, 3, 1, 9, 2)


def packed_inputs():
    position_ids = torch.cat([torch.arange(n) for n in DOCS])[None]
    return dict(input_ids=ids(1, sum(DOCS)), position_ids=position_ids)


@both
@dtypes
@pytest.mark.parametrize("use_cache", [False, True], ids=["no-cache", "cache"])
def test_packed_batch(name, dtype, use_cache):
    """Documents apart, with or without a cache (eager and sdpa keep them apart only without
    one, so they run without)."""
    reference, varlen_model = pair(name, dtype)
    inputs = packed_inputs()
    keep = torch.ones(1, sum(DOCS), dtype=torch.bool)
    want = logits_and_grads(reference, keep, use_cache=False, **inputs)
    got = logits_and_grads(varlen_model, keep, use_cache=use_cache, **inputs)
    assert_same_model_outputs(f"{name} packed", got, want, dtype)
    # Each document alone gives the same logits.
    start = 0
    with torch.no_grad():
        for n in DOCS:
            alone = reference(input_ids=inputs["input_ids"][:, start:start + n]).logits[0]
            assert_close(f"{name} document at {start}", got[0][start:start + n], alone, dtype)
            start += n


@both
def test_data_collator_with_flattening_kwargs(name):
    """`cu_seq_lens_q/k` alone keep documents apart (positions run on across them here)."""
    dtype = torch.float64
    reference, varlen_model = pair(name, dtype)
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    tokens = ids(sum(DOCS))
    starts = [sum(DOCS[:i]) for i in range(len(DOCS))]
    batch = collator([{"input_ids": tokens[s:s + n].tolist()} for s, n in zip(starts, DOCS)])
    assert "cu_seq_lens_q" in batch
    for name_ in ("labels", "position_ids"):
        batch.pop(name_)
    with torch.no_grad():
        got = varlen_model(**batch, use_cache=False).logits[0]
        for s, n in zip(starts, DOCS):
            alone = reference(input_ids=tokens[None, s:s + n],
                              position_ids=torch.arange(s, s + n)[None]).logits[0]
            assert_close(f"{name} document at {s}", got[s:s + n], alone, dtype)


@both
def test_greedy_generation_with_left_padding(name):
    dtype = torch.float64
    reference, varlen_model = pair(name, dtype)
    mask = torch.stack([torch.arange(9) >= 3, torch.arange(9) >= 0, torch.arange(9) >= 7]).long()
    prompt = dict(input_ids=ids(*mask.shape, seed=5), attention_mask=mask, max_new_tokens=6,
                  do_sample=False, output_scores=True, return_dict_in_generate=True,
                  pad_token_id=0)
    want, got = reference.generate(**prompt), varlen_model.generate(**prompt)
    assert torch.equal(got.sequences, want.sequences)
    for step, (g, w) in enumerate(zip(got.scores, want.scores)):
        assert_close(f"{name} step {step} scores", g, w, dtype)


@both
def test_decoding_with_a_cache_and_no_mask(name):
    """Queries are the last keys: causal aligned bottom-right."""
    dtype = torch.float64
    reference, varlen_model = pair(name, dtype)
    tokens = ids(2, 11, seed=7)
    outs = []
    for model in (reference, varlen_model):
        with torch.no_grad():
            first = model(input_ids=tokens[:, :8], use_cache=True)
            # transformers 5 renames `past_key_values` to `cache`
            name_ = "cache" if "cache" in inspect.signature(model.forward).parameters \
                else "past_key_values"
            outs.append(model(input_ids=tokens[:, 8:], use_cache=True,
                              **{name_: first.past_key_values}).logits)
    assert_close(f"{name} decode", outs[1], outs[0], dtype)


# --------------------------------------------------------------------------------------------
# Attention dropout in training (FlashAttention 2's semantics, varlen's keep bits)
# --------------------------------------------------------------------------------------------

def dropout_model(name, impl="varlen", p=0.1):
    config = CONFIGS[name]()
    config.attention_dropout = p
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)


@both
def test_training_with_attention_dropout(name):
    """Train mode with attention_dropout = 0.1 on a padded batch: finite logits and gradients,
    bitwise repeatable under one torch.manual_seed, other logits under another seed and in
    eval mode."""
    model = dropout_model(name).train()
    mask = padding_masks(13, holes=False)
    inputs = dict(input_ids=ids(*mask.shape), attention_mask=mask)
    keep = mask.bool()
    runs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        runs.append(logits_and_grads(model, keep, **inputs))
    logits, grads = runs[0]
    assert logits.isfinite().all() and all(g.isfinite().all() for g in grads.values())
    assert any(g.abs().max() > 0 for n, g in grads.items() if "self_attn" in n)
    assert torch.equal(runs[1][0], logits), "one seed, other logits"
    assert all(torch.equal(runs[1][1][n], g) for n, g in grads.items()), "one seed, other grads"
    assert not torch.equal(runs[2][0], logits), "another seed dropped the same pairs"
    with torch.no_grad():
        evaluated = model.eval()(**inputs).logits[keep]
    assert not torch.allclose(evaluated, logits), "train mode dropped nothing"


@both
def test_eval_mode_with_attention_dropout_is_eager(name):
    """attention_dropout > 0 changes nothing outside training: eager's logits and grads."""
    dtype = torch.float32
    reference, varlen_model = (dropout_model(name, impl).to(dtype).eval()
                               for impl in ("eager", "varlen"))
    mask = padding_masks(13, holes=name == "llama")
    inputs = dict(input_ids=ids(*mask.shape), attention_mask=mask)
    keep = mask.bool()
    assert_same_model_outputs(f"{name} eval", logits_and_grads(varlen_model, keep, **inputs),
                              logits_and_grads(reference, keep, **inputs), dtype)


class Layer(torch.nn.Module):
    is_causal = True


def test_layer_dropout_is_the_core_api_with_the_drawn_seed():
    """One layer call in training on a left-padded batch equals the core API on the packed
    tokens (positions counted from each row's first token) with the seed torch's generator
    gives after the same torch.manual_seed; in eval mode no pair is dropped."""
    import varlen
    from varlen.integrations.transformers import varlen_attention_forward
    rng = torch.Generator().manual_seed(4)
    B, Hq, Hk, S, D = 2, 4, 2, 11, 8
    q = torch.randn(B, Hq, S, D, generator=rng, dtype=torch.float64)
    k, v = (torch.randn(B, Hk, S, D, generator=rng, dtype=torch.float64) for _ in range(2))
    mask = torch.stack([torch.arange(S) >= 3, torch.arange(S) >= 0]).long()
    layer = Layer().train()
    torch.manual_seed(9)
    out = varlen_attention_forward(layer, q, k, v, mask, dropout=0.3)[0].view(B, S, Hq, D)
    torch.manual_seed(9)
    seed = vt.draw_seed()
    lengths = mask.sum(1).tolist()

    def rows(x):        # [B, H, S, D] -> the packed tokens [T, H, D]
        return torch.cat([x[b, :, S - n:].transpose(0, 1) for b, n in enumerate(lengths)])
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32).numpy()
    want, _ = varlen.attention_forward(*(rows(x).numpy() for x in (q, k, v)), cu, cu,
                                       mask="causal", dropout_p=0.3, seed=seed)
    got = torch.cat([out[b, S - n:] for b, n in enumerate(lengths)]).numpy()
    assert abs(got - want).max() < 1e-12, "the layer drew other pairs than the core API"
    assert (out[0, :3] == 0).all(), "padding positions get output 0"
    undropped, _ = varlen.attention_forward(*(rows(x).numpy() for x in (q, k, v)), cu, cu,
                                            mask="causal")
    assert abs(got - undropped).max() > 0.1
    evaluated = varlen_attention_forward(layer.eval(), q, k, v, mask, dropout=0.3)[0]
    evaluated = evaluated.view(B, S, Hq, D)
    got = torch.cat([evaluated[b, S - n:] for b, n in enumerate(lengths)]).numpy()
    assert abs(got - undropped).max() < 1e-12, "eval mode dropped pairs"


def test_layer_dropout_drops_a_plausible_fraction():
    """q = 0 spreads each row evenly over its keys and v = 1, so an output entry is the row's
    kept fraction times 1 / (1 - p): over 2 x 4 x 64 x 64 pairs about 1 - p are kept."""
    from varlen.integrations.transformers import varlen_attention_forward
    B, H, S, p = 2, 4, 64, 0.1
    q = torch.zeros(B, H, S, 8)
    layer = Layer().train()
    layer.is_causal = False
    torch.manual_seed(1)
    out, _ = varlen_attention_forward(layer, q, q, torch.ones(B, H, S, 8), None, dropout=p)
    kept = (out[..., 0] * (1 - p)).mean().item()
    assert abs(kept - (1 - p)) < 0.01, f"kept fraction {kept:.4f} for p = {p}"


def test_a_4d_mask_is_refused():
    _, model = pair("llama", torch.float32)
    with pytest.raises(ValueError, match="2-D padding mask"):
        model(input_ids=ids(1, 5), attention_mask=torch.ones(1, 1, 5, 5, dtype=torch.bool))


def test_registering_again_is_harmless():
    vt.register_transformers()
    import varlen.integrations.transformers  # noqa: F401  (registers on import)
    assert "varlen" in transformers.AttentionInterface._global_mapping
