"""Training: gradients against transformers (and peft's LoRA), the attention's own backward pass,
accumulation, adapters merged into a checkpoint, and learning on real text."""

import glob
import os
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import assert_rel_close, rel_err

import gptoss_jax as gj
from gptoss_jax.kernels.attention_vjp import causal_attention
from gptoss_jax.kernels.combine import combine
from gptoss_jax.kernels.xla import dense, visible
from gptoss_jax.testing import random_params
from gptoss_jax.training.lora import LoraConfig, attach, init_adapters, merge
from gptoss_jax.training.loss import loss
from gptoss_jax.training.step import OptimizerConfig, StepConfig, gradients, make_eval, make_step, optimizer

CONFIG = gj.ModelConfig.tiny()  # sliding window 16


def _tokens(rng, batch, length, config=CONFIG):
    return rng.integers(0, config.vocab_size, (batch, length)).astype(np.int32)


@pytest.mark.parametrize("window", [None, 7, 16])
@pytest.mark.parametrize("with_sinks", [True, False])
def test_blockwise_attention_backward_equals_autodiff_of_the_dense_definition(window, with_sinks):
    """The custom VJP, over several key blocks (45 positions, blocks of 8: a partial last block),
    against JAX's autodiff of the plain [T, S] definition, for q, k, v and the sinks; sinks either
    inside the kernel or folded in after it by `combine` (a cotangent on lse)."""
    B, T, K, G, H = 2, 45, 2, 3, 8
    rng = np.random.default_rng(0)
    q, weights = (jnp.asarray(rng.normal(size=(B, T, K, G, H)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32) for _ in range(2))
    sinks = jnp.asarray(rng.normal(size=(K, G)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))

    def reference(q, k, v, sinks):
        return jnp.sum(combine([dense(q, k, v, visible(pos, pos, window))], sinks, jnp.float32) * weights)

    def blockwise(q, k, v, sinks):
        if with_sinks:
            return jnp.sum(causal_attention(q, k, v, window, 8, sinks)[0] * weights)
        return jnp.sum(combine([causal_attention(q, k, v, window, 8)], sinks, jnp.float32) * weights)

    want = jax.grad(reference, argnums=(0, 1, 2, 3))(q, k, v, sinks)
    got = jax.grad(blockwise, argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for name, g, w in zip("q k v sinks".split(), got, want):
        assert rel_err(g, w) < 1e-5, name


def _hf_gradients(params, tokens, mask, dtype):
    import refs

    model = refs.hf_model(CONFIG, params, dtype=dtype)
    labels = torch.tensor(np.where(mask, tokens, -100)).long()
    out = model(input_ids=torch.tensor(tokens).long(), labels=labels)
    out.loss.backward()
    return float(out.loss.detach()), {name: p.grad.double().numpy() for name, p in model.named_parameters()}


def test_gradients_equal_transformers_for_every_parameter():
    """jax.grad of the loss against GptOssForCausalLM's, on the same weights (trained-like
    magnitudes), tokens and mask, 80 positions (5 sliding windows), attention blocks of 32.

    The reference gradient is transformers' computed in float64: float32 gradients at these
    magnitudes carry rounding of about 1e-5 of the largest entry whichever code computes them
    (transformers' own float32 gradient differs from its float64 one by 5e-6 to 2e-5 per tensor over
    five weight draws, and by 16% in one tensor of one draw where float32 rounding flips a top-4
    expert choice), so it says which code is right. The loss is compared in float32 too.
    """
    import refs

    params = random_params(CONFIG, seed=3, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    tokens = _tokens(rng, 2, 80)
    mask = rng.random((2, 80)) < 0.7
    kernels = gj.Kernels(attention="blockwise", attention_block=32)
    ours, grads = jax.value_and_grad(lambda p: loss(CONFIG, p, jnp.asarray(tokens), jnp.asarray(mask),
                                                    kernels=kernels))(params)
    hf_loss32, _ = _hf_gradients(params, tokens, mask, "float32")
    hf_loss64, hf_grads = _hf_gradients(params, tokens, mask, "float64")
    assert abs(float(ours) - hf_loss32) <= 1e-6 * hf_loss32
    assert abs(float(ours) - hf_loss64) <= 1e-6 * hf_loss64
    ours_by_name = refs.hf_state_dict(CONFIG, grads)
    assert set(ours_by_name) == set(hf_grads)
    errors = {name: rel_err(ours_by_name[name], ref) for name, ref in hf_grads.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, (worst, errors[worst])
    # Every kind of parameter was compared: sinks, router, experts, norms, embeddings.
    for part in ("sinks", "router.weight", "experts.gate_up_proj", "experts.down_proj", "layernorm", "lm_head"):
        assert any(part in name for name in errors), part


def test_label_smoothing_is_torch_cross_entropy_with_label_smoothing():
    params = random_params(CONFIG, seed=1, dtype=jnp.float32)
    rng = np.random.default_rng(1)
    tokens = _tokens(rng, 2, 24)
    mask = rng.random((2, 24)) < 0.8
    ours = loss(CONFIG, params, jnp.asarray(tokens), jnp.asarray(mask), label_smoothing=0.1, chunk=5)
    logits = torch.tensor(np.asarray(gj.forward(CONFIG, params, tokens)))[:, :-1]
    targets = torch.tensor(np.where(mask, tokens, -100)).long()[:, 1:]
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), targets.reshape(-1),
                                             ignore_index=-100, label_smoothing=0.1)
    assert abs(float(ours) - float(want)) <= 1e-6 * float(want)


def test_activation_checkpointing_and_logit_chunks_leave_the_gradient_unchanged():
    params = random_params(CONFIG, seed=2, dtype=jnp.float32)
    rng = np.random.default_rng(2)
    tokens, mask = jnp.asarray(_tokens(rng, 2, 40)), jnp.asarray(rng.random((2, 40)) < 0.5)

    def grad(**kw):
        return jax.grad(lambda p: loss(CONFIG, p, tokens, mask, **kw))(params)

    plain, checkpointed = grad(chunk=4096), grad(remat=True, chunk=7)  # 39 predictions: 6 chunks, padded
    for g, w in zip(jax.tree.leaves(checkpointed), jax.tree.leaves(plain)):
        assert rel_err(g, w) < 1e-5  # float32 sums in another order (measured: at most 1.4e-6)


def test_no_selected_token_gives_zero_loss():
    params = random_params(CONFIG, seed=2, dtype=jnp.float32)
    tokens = jnp.asarray(_tokens(np.random.default_rng(3), 1, 8))
    assert float(loss(CONFIG, params, tokens, jnp.zeros((1, 8), bool))) == 0.0


def _peft_model(params, adapters, lora):
    """transformers' model with peft's LoRA on q, k, v and o, holding our adapters."""
    import refs
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    model = get_peft_model(refs.hf_model(CONFIG, params), PeftLoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    r = lora.rank
    with torch.no_grad():
        for i, layer in enumerate(model.base_model.model.model.layers):
            ours = adapters[f"block_{i}"]["attn"]
            for x in "qkv":
                proj = getattr(layer.self_attn, f"{x}_proj")
                proj.lora_A["default"].weight.copy_(torch.tensor(np.asarray(ours[f"{x}_weight"]["a"]).T))
                proj.lora_B["default"].weight.copy_(torch.tensor(np.asarray(ours[f"{x}_weight"]["b"]).reshape(r, -1).T))
            o = layer.self_attn.o_proj
            o.lora_A["default"].weight.copy_(torch.tensor(np.asarray(ours["out_weight"]["a"]).reshape(-1, r).T))
            o.lora_B["default"].weight.copy_(torch.tensor(np.asarray(ours["out_weight"]["b"]).T))
    return model


def _random_adapters(lora, seed=0):
    adapters = init_adapters(CONFIG, lora, jax.random.key(seed))
    # Fresh adapters have b = 0 (no change, no gradient for a): give b values so both are tested.
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def test_lora_logits_and_adapter_gradients_equal_peft():
    lora = LoraConfig(rank=4, alpha=8.0, targets=("attention",))
    params = random_params(CONFIG, seed=1, dtype=jnp.float32)
    adapters = _random_adapters(lora)
    tokens = _tokens(np.random.default_rng(4), 2, 40)
    mask = np.ones(tokens.shape, bool)
    ours, grads = jax.value_and_grad(lambda a: loss(CONFIG, attach(params, a, lora.scale), jnp.asarray(tokens),
                                                    jnp.asarray(mask)))(adapters)
    model = _peft_model(params, adapters, lora)
    out = model(input_ids=torch.tensor(tokens).long(), labels=torch.tensor(tokens).long())
    out.loss.backward()
    assert abs(float(ours) - float(out.loss)) <= 1e-6 * float(out.loss)
    logits = gj.forward(CONFIG, attach(params, adapters, lora.scale), tokens)
    assert_rel_close(logits, out.logits.detach().numpy(), rtol=1e-5)
    r = lora.rank
    for i, layer in enumerate(model.base_model.model.model.layers):
        g = grads[f"block_{i}"]["attn"]
        for x in "qkv":
            proj = getattr(layer.self_attn, f"{x}_proj")
            assert_rel_close(g[f"{x}_weight"]["a"], proj.lora_A["default"].weight.grad.numpy().T, rtol=1e-5)
            assert_rel_close(np.asarray(g[f"{x}_weight"]["b"]).reshape(r, -1),
                             proj.lora_B["default"].weight.grad.numpy().T, rtol=1e-5)
        o = layer.self_attn.o_proj
        assert_rel_close(np.asarray(g["out_weight"]["a"]).reshape(-1, r), o.lora_A["default"].weight.grad.numpy().T,
                         rtol=1e-5)
        assert_rel_close(g["out_weight"]["b"], o.lora_B["default"].weight.grad.numpy().T, rtol=1e-5)


@pytest.mark.parametrize("targets", [("attention", "router", "experts")])
def test_merged_adapters_equal_base_plus_adapters(targets, tmp_path):
    """Adapters on every target, merged and written as a checkpoint, loaded back: the logits equal
    the base model running beside its adapters, on a sequence past the sliding window."""
    from gptoss_jax.checkpoint import load_checkpoint, save_checkpoint

    lora = LoraConfig(rank=3, alpha=6.0, targets=targets)
    params = random_params(CONFIG, seed=4, dtype=jnp.float32)
    adapters = _random_adapters(lora, seed=2)
    tokens = _tokens(np.random.default_rng(5), 2, 40)
    with_adapters = gj.forward(CONFIG, attach(params, adapters, lora.scale), tokens)
    base = gj.forward(CONFIG, params, tokens)
    assert rel_err(with_adapters, base) > 1e-2  # the adapters matter
    save_checkpoint(tmp_path / "merged", CONFIG, merge(params, adapters, lora))
    _, merged = load_checkpoint(tmp_path / "merged", dtype="float32")
    assert_rel_close(gj.forward(CONFIG, merged, tokens), with_adapters, rtol=1e-5)


def test_expert_adapters_are_the_same_on_the_gather_and_grouped_paths():
    lora = LoraConfig(rank=2, alpha=2.0, targets=("experts", "router"))
    params = attach(random_params(CONFIG, seed=5, dtype=jnp.float32), _random_adapters(lora, seed=3), lora.scale)
    tokens = _tokens(np.random.default_rng(6), 2, 24)
    gather = gj.forward(CONFIG, params, tokens, kernels=gj.Kernels(moe="gather"))
    grouped = gj.forward(CONFIG, params, tokens, kernels=gj.Kernels(moe="grouped", moe_block=8))
    assert_rel_close(grouped, gather, rtol=1e-5)


def test_accumulated_micro_batches_make_the_gradient_of_one_batch():
    """Two micro-batches of 2 sequences against one batch of 4: the same loss, token count and
    gradient (compared before AdamW, whose first update, about lr * sign(g), would magnify rounding
    in gradients near 0)."""
    params = random_params(CONFIG, seed=6, dtype=jnp.float32)
    rng = np.random.default_rng(7)
    tokens, mask = _tokens(rng, 4, 24), rng.random((4, 24)) < 0.6
    setup = StepConfig(CONFIG, compute_dtype="float32", remat=False)

    def run(shape):
        return jax.jit(lambda t, m: gradients(setup, params, None, t, m))(jnp.asarray(tokens.reshape(shape)),
                                                                          jnp.asarray(mask.reshape(shape)))

    total1, count1, one = run((1, 4, 24))
    total2, count2, two = run((2, 2, 24))
    assert float(count1) == float(count2) == mask[:, 1:].sum()
    assert abs(float(total1) - float(total2)) <= 1e-6 * float(total1)
    for a, b in zip(jax.tree.leaves(two), jax.tree.leaves(one)):
        assert rel_err(a, b) < 1e-5


def test_a_train_step_lowers_the_loss_on_its_batch():
    params = random_params(CONFIG, seed=6, dtype=jnp.float32)
    rng = np.random.default_rng(8)
    tokens, mask = jnp.asarray(_tokens(rng, 2, 24)[None]), jnp.ones((1, 2, 24), bool)
    setup = StepConfig(CONFIG, compute_dtype="float32", remat=False)
    tx = optimizer(OptimizerConfig(lr=1e-3, steps=10))
    step = make_step(setup, tx)
    trainable, opt_state = params, tx.init(params)
    losses = []
    for _ in range(3):
        trainable, opt_state, metrics = step(trainable, opt_state, None, tokens, mask)
        losses.append(float(metrics["loss"]))
    assert losses[2] < losses[1] < losses[0]


def _byte_chunks(files, length, count, seed):
    data = np.frombuffer(b"".join(open(f, "rb").read() for f in files), np.uint8).astype(np.int32)
    starts = np.random.default_rng(seed).integers(0, len(data) - length, count)
    return np.stack([data[s:s + length] for s in starts])


def stdlib_split():
    """The Python standard library's top-level modules, every tenth held out (text nobody wrote for
    this test)."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    assert len(files) > 100
    return [f for i, f in enumerate(files) if i % 10], [f for i, f in enumerate(files) if i % 10 == 0]


def learning_run(steps=120, batch=8, length=128, lr=3e-3, log=None):
    """The tiny model (trained from its init) on bytes of the standard library's sources:
    (held-out loss before, after)."""
    train_files, held_files = stdlib_split()
    train = _byte_chunks(train_files, length, steps * batch, seed=0).reshape(steps, 1, batch, length)
    held = jnp.asarray(_byte_chunks(held_files, length, 64, seed=1))
    params = gj.init_params(CONFIG, jax.random.key(0), dtype=jnp.float32)
    setup = StepConfig(CONFIG, compute_dtype="float32", kernels=gj.Kernels(attention_block=64))
    tx = optimizer(OptimizerConfig(lr=lr, steps=steps, warmup=10))
    step, evaluate = make_step(setup, tx), make_eval(setup)

    def held_out(p):
        total, count = evaluate(p, None, held, jnp.ones(held.shape, bool))
        return float(total / count)

    before, opt_state, mask = held_out(params), tx.init(params), jnp.ones((1, batch, length), bool)
    for i in range(steps):
        params, opt_state, metrics = step(params, opt_state, None, jnp.asarray(train[i]), mask)
        if log is not None:
            log(i + 1, float(metrics["loss"]), held_out(params) if (i + 1) % 20 == 0 else None)
    return before, held_out(params)


def test_the_tiny_model_learns_python_source_text():
    """Held-out bytes of the standard library: from uniform guessing (ln 1024 = 6.93 nats) to below
    3.5 nats a byte in 120 steps of 1,024 bytes (measured: 2.6)."""
    before, after = learning_run()
    assert before > 6.5
    assert after < 3.5, after
