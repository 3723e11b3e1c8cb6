"""The transformers backend (mla_cupy.integrations.transformers) on CPU: the ops' CPU kernel (the
float64 reference) runs the whole path, compared with transformers' eager attention on a tiny
random DeepseekV3 model (qk_nope 128, rope 64, v 128 as the kernel needs), with and without
padding, and in greedy generation."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import AttentionInterface, DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds  # noqa: E402

from mla_cupy.integrations import transformers as mt  # noqa: E402

mt.register()

SEQ = 9
PADDING = {  # attention masks of a batch of 3
    "none": None,
    "right": torch.tensor([[1] * 9, [1] * 6 + [0] * 3, [1] * 2 + [0] * 7]),
    "left": torch.tensor([[1] * 9, [0] * 3 + [1] * 6, [0] * 7 + [1] * 2]),
}


def tiny_config(**kw):
    cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=2, first_k_dense_replace=2, q_lora_rank=None, kv_lora_rank=32,
               qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=64, n_group=1,
               topk_group=1, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    cfg.update(kw)
    return DeepseekV3Config(**cfg)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(tiny_config()).float().eval()


def _logits(model, impl, ids, mask):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


def test_register_names_the_backend():
    assert AttentionInterface._global_mapping[mt.NAME] is mt.mla_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[mt.NAME] is mt.padding_mask


def test_sequence_ranges():
    assert mt.sequence_ranges(None, 2, 5) == [(0, 5), (0, 5)]
    m = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    assert mt.sequence_ranges(m, 3, 6) == [(0, 3), (2, 5), (0, 0)]
    assert mt.sequence_ranges(m, 3, 6) == [(0, 3), (2, 5), (0, 0)]  # the cached ranges of the same mask
    m[2, 4] = True  # the same mask object, changed in place: read again
    assert mt.sequence_ranges(m, 3, 6)[2] == (4, 5)
    with pytest.raises(ValueError, match="padding between"):
        mt.sequence_ranges(torch.tensor([[1, 0, 1]], dtype=torch.bool), 1, 3)
    with pytest.raises(ValueError, match="2-D"):
        mt.sequence_ranges(torch.ones(1, 1, 3, 3, dtype=torch.bool), 1, 3)


def _attention_inputs(batch, sq, sk, seed=0):
    """query/key/value as DeepseekV3Attention builds them: the rope is the same on every head."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 2, sq, 192, generator=g)
    kv = torch.randn(batch, sk, 2, 256, generator=g).transpose(1, 2)  # kv_b_proj's output, split
    rope = torch.randn(batch, 1, sk, 64, generator=g)
    key = torch.cat([kv[..., :128], rope.expand(-1, 2, -1, -1)], -1)
    return q, key, kv[..., 128:]


@pytest.mark.parametrize("name, sq", [("none", SEQ), ("right", SEQ), ("left", SEQ), ("none", 1), ("left", 1)],
                         ids=["prefill", "prefill-right", "prefill-left", "decode", "decode-left"])
def test_attention_function_matches_eager(name, sq):
    """The attention function alone against eager attention with transformers' 4-D mask, on the
    query rows that are real tokens; decode rows are the last position of the keys."""
    mask2d = PADDING[name]
    q, key, value = _attention_inputs(3, sq, SEQ)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training, module.is_causal = 1, False, True
    got, weights = mt.mla_attention_forward(module, q, key, value, None if mask2d is None else mask2d.bool(),
                                            scaling=0.11)
    assert weights is None and tuple(got.shape) == (3, sq, 2, 128)
    keep = torch.ones(3, SEQ, dtype=torch.bool) if mask2d is None else mask2d.bool()
    pos = torch.arange(SEQ - sq, SEQ)
    allowed = (torch.arange(SEQ)[None, :] <= pos[:, None])[None] & keep[:, None, :]
    bias = torch.zeros(3, 1, sq, SEQ).masked_fill(~allowed[:, None], -float("inf"))
    want, _ = ds.eager_attention_forward(module, q.double(), key.double(), value.double(), bias.double(), scaling=0.11)
    real = keep[:, SEQ - sq:]
    torch.testing.assert_close(got[real].double(), want[real], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(PADDING))
def test_model_logits_match_eager(model, name):
    ids = torch.randint(0, 128, (3, SEQ), generator=torch.Generator().manual_seed(1))
    mask = PADDING[name]
    want = _logits(model, "eager", ids, mask)
    got = _logits(model, mt.NAME, ids, mask)
    real = torch.ones(3, SEQ, dtype=torch.bool) if mask is None else mask.bool()
    assert not got[real].isnan().any()
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-5 * float(want.abs().max()))


def test_greedy_generate_matches_eager(model):
    ids = torch.randint(0, 128, (3, SEQ), generator=torch.Generator().manual_seed(2))
    mask = PADDING["left"]
    runs = []
    for impl in ("eager", mt.NAME):
        model.set_attn_implementation(impl)
        runs.append(model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, output_logits=True,
                                   return_dict_in_generate=True, pad_token_id=0))
    (want, got) = runs
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.logits, want.logits):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * float(w.abs().max()))


def test_refusals(model):
    q, key, value = _attention_inputs(1, 4, 4)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="dropout"):
        mt.mla_attention_forward(module, q, key, value, None, dropout=0.1)
    with pytest.raises(ValueError, match="sliding_window"):
        mt.mla_attention_forward(module, q.detach(), key, value, None, sliding_window=4)
    with pytest.raises(ValueError, match="query, key"):
        mt.mla_attention_forward(module, q.detach()[..., :128], key, value, None)
    with pytest.raises(ValueError, match="v_head_dim"):
        mt.mla_attention_forward(module, q.detach(), key, value[..., :64], None)
    model.set_attn_implementation(mt.NAME)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with torch.no_grad(), pytest.raises(ValueError, match="packed"):  # position ids restarting inside a row
        model(ids, position_ids=torch.tensor([[0, 1, 0, 1]]), use_cache=False)
    with torch.no_grad(), pytest.raises(ValueError, match="padding between"):
        model(ids, attention_mask=torch.tensor([[1, 0, 1, 1]]))


@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_training_gradients_match_eager(padding):
    """loss.backward() through the model with the backend (the backward's reference standing in for
    its kernels) gives eager attention's parameter gradients; sdpa's under left padding, where
    transformers' eager attention gives other gradients than its sdpa (by 20-70% here)."""
    torch.manual_seed(1)
    model = DeepseekV3ForCausalLM(tiny_config()).float().train()
    ids = torch.randint(1, 128, (3, SEQ), generator=torch.Generator().manual_seed(2))
    mask = PADDING[padding]
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)  # padding rows: no loss
    grads = []
    for impl in ("sdpa" if padding == "left" else "eager", mt.NAME):
        model.zero_grad()
        model.set_attn_implementation(impl)
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    want, got = grads
    assert set(got) == set(want) and any("kv_a_proj" in n for n in got)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-3, atol=1e-5 * float(want[n].abs().max()) + 1e-7, msg=n)
