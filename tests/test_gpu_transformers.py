"""GPU tests of the transformers backend (pytest -m gpu): a small random DeepseekV3 model in
bfloat16, the kernel's logits against eager attention's, held to the error torch's SDPA has
against eager (at most twice it, or 1e-2), with and without padding; the parameter gradients of a
training step held to the same rule; and greedy generation (decode steps over a growing cache)
agreeing with eager at least as well as SDPA does."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

from mla_cupy.integrations import transformers as mt  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch without a CUDA device")]

SEQ = 48
PADDING = {
    "none": None,
    "right": [SEQ, SEQ - 13, 5],  # real tokens of each row, padding after them
    "left": [SEQ, SEQ - 13, 5],  # real tokens of each row, padding before them
}


@pytest.fixture(scope="module")
def model():
    mt.register()
    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=2, q_lora_rank=None,
                           kv_lora_rank=64, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                           max_position_embeddings=256, n_group=1, topk_group=1, n_routed_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=64, initializer_range=0.2)
    return DeepseekV3ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


def _mask(name, batch=3):
    lengths = PADDING[name]
    if lengths is None:
        return None
    m = torch.zeros(batch, SEQ, dtype=torch.long, device="cuda")
    for b, n in enumerate(lengths):
        if name == "right":
            m[b, :n] = 1
        else:
            m[b, SEQ - n:] = 1
    return m


def _logits(model, impl, ids, mask):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits.float()


def _error(x, ref):
    return float((x - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("name", list(PADDING))
def test_logits_as_close_to_eager_as_sdpa(model, name):
    ids = torch.randint(0, 256, (3, SEQ), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    mask = _mask(name)
    real = torch.ones(3, SEQ, dtype=torch.bool, device="cuda") if mask is None else mask.bool()
    eager = _logits(model, "eager", ids, mask)[real]
    sdpa = _logits(model, "sdpa", ids, mask)[real]
    ours = _logits(model, mt.NAME, ids, mask)[real]
    assert torch.isfinite(ours).all()
    bound = max(2 * _error(sdpa, eager), 1e-2)
    assert _error(ours, eager) <= bound, (_error(ours, eager), _error(sdpa, eager))


def _gradients(model, impl, ids, mask):
    """The parameter gradients of one training step, concatenated (float32)."""
    model.set_attn_implementation(impl)
    model.train()
    model.zero_grad(set_to_none=True)
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)  # padding rows: no loss
    try:
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        return torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()


@pytest.mark.parametrize("name", list(PADDING))
def test_training_gradients_as_close_to_eager_as_sdpa(model, name):
    """loss.backward() through the backend's backward kernels: the rope's gradient summed over the
    heads in the kernel, padding keys given none."""
    ids = torch.randint(1, 256, (3, SEQ), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    mask = _mask(name)
    eager = _gradients(model, "eager", ids, mask)
    sdpa = _gradients(model, "sdpa", ids, mask)
    ours = _gradients(model, mt.NAME, ids, mask)
    assert torch.isfinite(ours).all() and ours.numel() == eager.numel()

    def err(x):
        return float((x - eager).norm() / eager.norm())

    assert err(ours) <= max(2 * err(sdpa), 1e-2), (err(ours), err(sdpa))


def _generate(model, impl, ids, mask):
    model.set_attn_implementation(impl)
    return model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)[:, SEQ:]


def _agreement(tokens, ref):
    """Generated tokens equal to the reference's up to each row's first difference."""
    same = (tokens == ref).long()
    return int(same.cumprod(dim=1).sum())


def test_greedy_generate_agrees_with_eager_as_well_as_sdpa(model):
    """Left padding (as generate needs for a batch): a prefill, then one query per step over the
    growing cache."""
    ids = torch.randint(0, 256, (3, SEQ), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    mask = _mask("left")
    eager = _generate(model, "eager", ids, mask)
    sdpa = _generate(model, "sdpa", ids, mask)
    ours = _generate(model, mt.NAME, ids, mask)
    assert _agreement(ours, eager) >= _agreement(sdpa, eager), (ours, sdpa, eager)
