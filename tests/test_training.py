"""Training: gradients against transformers (and peft's LoRA), the attention's own backward pass,
accumulation, adapters merged into a checkpoint, and learning on real text.

Losses, logits and gradients are checked against the references run in float64 on the same weights
and tokens, within NOISE_FACTOR x the references' own float32 error on those inputs (noise.py).
Float32 gradients at these magnitudes carry rounding of about 1e-5 of their largest entry whichever
code computes them, so a fixed bound there passes on one machine and fails on the next."""

import glob
import os
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import refs
import torch
from conftest import optimisation_level, rel_err
from noise import Exact, scalar

import gptoss_jax as gj
from gptoss_jax.kernels.attention.vjp import causal_attention
from gptoss_jax.kernels.combine import combine
from gptoss_jax.kernels.attention.xla import dense, visible
from gptoss_jax.testing import random_params
from gptoss_jax.training.lora import LoraConfig, attach, init_adapters, merge
from gptoss_jax.training.loss import loss
from gptoss_jax.training.step import OptimizerConfig, StepConfig, gradients, make_eval, make_step, optimizer

CONFIG = gj.ModelConfig.tiny()  # sliding window 16


def _tokens(rng, batch, length, config=CONFIG):
    return rng.integers(0, config.vocab_size, (batch, length)).astype(np.int32)


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 7, 16])
@pytest.mark.parametrize("with_sinks", [True, False])
def test_blockwise_attention_backward_equals_autodiff_of_the_dense_definition(window, with_sinks):
    """The custom VJP, over several key blocks (45 positions, blocks of 8: a partial last block), and
    JAX's autodiff of the plain [T, S] definition, for q, k, v and the sinks, against torch's
    autodiff of the definition in float64 (its float32 run the noise); sinks either inside the
    kernel or folded in after it by `combine` (a cotangent on lse)."""
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

    def torch_grads(dtype):
        inputs = [torch.tensor(np.asarray(x), dtype=dtype, requires_grad=True) for x in (q, k, v, sinks)]
        out = refs.attention_torch(*inputs, pos, pos, window, dtype=dtype)
        (out * torch.tensor(np.asarray(weights), dtype=dtype)).sum().backward()
        return [x.grad.double().numpy() for x in inputs]

    dense_grads = jax.jit(jax.grad(reference, argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    blockwise_grads = jax.jit(jax.grad(blockwise, argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    for name, g32, g64, d, b in zip("q k v sinks".split(), torch_grads(torch.float32), torch_grads(torch.float64),
                                    dense_grads, blockwise_grads):
        exact = Exact.measure(g32, g64)
        exact.check(d, f"{name}, dense")
        exact.check(b, f"{name}, blockwise")


@pytest.mark.slow
def test_gradients_equal_transformers_for_every_parameter():
    """jax.grad of the loss against GptOssForCausalLM's, on the same weights (trained-like
    magnitudes), tokens and mask, 80 positions (5 sliding windows), attention blocks of 32.

    Each tensor's gradient within NOISE_FACTOR x transformers' own float32 error of its float64
    gradient (5e-6 to 2e-5 of the largest entry over five weight draws; in one tensor of one draw 16%,
    where float32 rounding flips a top-4 expert choice: these weights flip none).
    """
    params = random_params(CONFIG, seed=3, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    tokens = _tokens(rng, 2, 80)
    mask = rng.random((2, 80)) < 0.7
    kernels = gj.Kernels(attention="blockwise", attention_block=32)
    ours, grads = jax.value_and_grad(lambda p: loss(CONFIG, p, jnp.asarray(tokens), jnp.asarray(mask),
                                                    kernels=kernels))(params)
    exact_loss, exact = refs.exact_gradients(CONFIG, params, tokens, mask)
    exact_loss.check([ours], "loss")
    ours_by_path = refs.by_path(grads)
    assert set(ours_by_path) == set(exact)
    for path, want in exact.items():
        want.check(ours_by_path[path], path)
    # Every kind of parameter was compared: sinks, router, experts, norms, embeddings.
    for part in ("sinks", "router_weight", "mlp1_weight", "mlp2_weight", "norm/scale", "embedding", "unembedding"):
        assert any(part in path for path in exact), part


@pytest.mark.slow
def test_label_smoothing_is_torch_cross_entropy_with_label_smoothing():
    """The same logits into both: torch's loss in float64 exact, its float32 run the noise."""
    params = random_params(CONFIG, seed=1, dtype=jnp.float32)
    rng = np.random.default_rng(1)
    tokens = _tokens(rng, 2, 24)
    mask = rng.random((2, 24)) < 0.8
    ours = loss(CONFIG, params, jnp.asarray(tokens), jnp.asarray(mask), label_smoothing=0.1, chunk=5)
    logits = torch.tensor(np.asarray(gj.forward(CONFIG, params, tokens)))[:, :-1]
    targets = torch.tensor(np.where(mask, tokens, -100)).long()[:, 1:]

    def torch_loss(x):
        return float(torch.nn.functional.cross_entropy(x.reshape(-1, CONFIG.vocab_size), targets.reshape(-1),
                                                       ignore_index=-100, label_smoothing=0.1))

    scalar(torch_loss(logits), torch_loss(logits.double())).check([ours])


@pytest.mark.slow
def test_activation_checkpointing_and_logit_chunks_leave_the_gradient_unchanged():
    """Both against transformers' float64 gradient (the bound of noise.py)."""
    params = random_params(CONFIG, seed=2, dtype=jnp.float32)
    rng = np.random.default_rng(2)
    tokens, mask = _tokens(rng, 2, 40), rng.random((2, 40)) < 0.5
    _, exact = refs.exact_gradients(CONFIG, params, tokens, mask)

    def grad(**kw):
        return refs.by_path(jax.grad(lambda p: loss(CONFIG, p, jnp.asarray(tokens), jnp.asarray(mask), **kw))(params))

    plain, checkpointed = grad(chunk=4096), grad(remat=True, chunk=7)  # 39 predictions: 6 chunks, padded
    for name, want in exact.items():
        want.check(plain[name], f"{name}, plain")
        want.check(checkpointed[name], f"{name}, checkpointed in chunks")


@pytest.mark.slow
def test_no_selected_token_gives_zero_loss():
    params = random_params(CONFIG, seed=2, dtype=jnp.float32)
    tokens = jnp.asarray(_tokens(np.random.default_rng(3), 1, 8))
    assert float(loss(CONFIG, params, tokens, jnp.zeros((1, 8), bool))) == 0.0


def _peft_model(params, adapters, lora, dtype="float32"):
    """transformers' model with peft's LoRA on q, k, v and o, holding our adapters."""
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
    if dtype == "float64":  # after the copies, so that both runs hold the same float32 numbers
        model = model.to(torch.float64)
        model.base_model.model.config._experts_implementation = "eager"
    return model


def _random_adapters(lora, seed=0):
    adapters = init_adapters(CONFIG, lora, jax.random.key(seed))
    # Fresh adapters have b = 0 (no change, no gradient for a): give b values so both are tested.
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def _peft_run(params, adapters, lora, tokens, dtype):
    """peft's loss, logits and adapter gradients, each by our name ("block_i/x_weight/a"), float64 numpy."""
    model = _peft_model(params, adapters, lora, dtype)
    out = model(input_ids=torch.tensor(tokens).long(), labels=torch.tensor(tokens).long())
    out.loss.backward()
    r, grads = lora.rank, {}
    for i, layer in enumerate(model.base_model.model.model.layers):
        for x, proj in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("out", "o_proj")):
            module = getattr(layer.self_attn, proj)
            a, b = (getattr(module, f"lora_{n}")["default"].weight.grad.double().numpy().T for n in "AB")
            grads[f"block_{i}/{x}_weight/a"] = a.reshape(-1, r) if x == "out" else a
            grads[f"block_{i}/{x}_weight/b"] = b if x == "out" else b.reshape(r, -1)
    return float(out.loss.detach()), out.logits.detach().double().numpy(), grads


@pytest.mark.slow
def test_lora_logits_and_adapter_gradients_equal_peft():
    """peft in float64 exact, its float32 run the noise (noise.py)."""
    lora = LoraConfig(rank=4, alpha=8.0, targets=("attention",))
    params = random_params(CONFIG, seed=1, dtype=jnp.float32)
    adapters = _random_adapters(lora)
    tokens = _tokens(np.random.default_rng(4), 2, 40)
    mask = np.ones(tokens.shape, bool)
    ours, grads = jax.value_and_grad(lambda a: loss(CONFIG, attach(params, a, lora.scale), jnp.asarray(tokens),
                                                    jnp.asarray(mask)))(adapters)
    (loss32, logits32, grads32), (loss64, logits64, grads64) = (_peft_run(params, adapters, lora, tokens, d)
                                                                 for d in ("float32", "float64"))
    scalar(loss32, loss64).check([ours], "loss")
    Exact.measure(logits32, logits64).check(gj.forward(CONFIG, attach(params, adapters, lora.scale), tokens), "logits")
    r = lora.rank
    for name, want in grads64.items():
        layer, weight, ab = name.split("/")
        got = np.asarray(grads[layer]["attn"][weight][ab])
        got = got.reshape(-1, r) if (weight, ab) == ("out_weight", "a") else got
        got = got.reshape(r, -1) if ab == "b" and weight != "out_weight" else got
        Exact.measure(grads32[name], want).check(got, name)


@pytest.mark.slow
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
    # Both against transformers on the exactly merged weights (float64), its float32 run the noise.
    exact = refs.exact_adapted_logits(CONFIG, params, adapters, lora, tokens)
    exact.check(with_adapters, "base + adapters")
    exact.check(gj.forward(CONFIG, merged, tokens), "merged")


@pytest.mark.slow
def test_expert_adapters_are_the_same_on_the_gather_and_grouped_paths():
    lora = LoraConfig(rank=2, alpha=2.0, targets=("experts", "router"))
    base, adapters = random_params(CONFIG, seed=5, dtype=jnp.float32), _random_adapters(lora, seed=3)
    params = attach(base, adapters, lora.scale)
    tokens = _tokens(np.random.default_rng(6), 2, 24)
    exact = refs.exact_adapted_logits(CONFIG, base, adapters, lora, tokens)
    exact.check(gj.forward(CONFIG, params, tokens, kernels=gj.Kernels(moe="gather")), "gather")
    exact.check(gj.forward(CONFIG, params, tokens, kernels=gj.Kernels(moe="grouped", moe_block=8)), "grouped")


@pytest.mark.slow
def test_accumulated_micro_batches_make_the_gradient_of_one_batch():
    """Two micro-batches of 2 sequences against one batch of 4: the same loss, token count and
    gradient (compared before AdamW, whose first update, about lr * sign(g), would magnify rounding
    in gradients near 0). Both against transformers' float64 gradient of the loss summed over the 4
    sequences, within NOISE_FACTOR x its float32 error (noise.py). Mutation tried: only the last
    micro-batch's gradient kept fails by more than 10^5 x."""
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
    exact_total, exact = refs.exact_gradients(CONFIG, params, tokens, mask, total=True)
    for what, total, grads in (("one batch", total1, one), ("two micro-batches", total2, two)):
        exact_total.check([total], f"loss sum, {what}")
        by_path = refs.by_path(grads)
        for path, want in exact.items():
            want.check(by_path[path], f"{path}, {what}")


@pytest.mark.slow
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


def initial_params():
    """The tiny model's init, as `learning_run` starts from it."""
    return gj.init_params(CONFIG, jax.random.key(0), dtype=jnp.float32)


def learning_run(steps=120, batch=8, length=128, lr=3e-3, log=None, params=None):
    """The tiny model (trained from `params`, by default its init) on bytes of the standard library's
    sources: (held-out loss before, after)."""
    train_files, held_files = stdlib_split()
    train = _byte_chunks(train_files, length, steps * batch, seed=0).reshape(steps, 1, batch, length)
    held = jnp.asarray(_byte_chunks(held_files, length, 64, seed=1))
    params = initial_params() if params is None else params
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


@pytest.mark.slow
@pytest.mark.optimized  # 40 steps run: 26 s at XLA's default level, 35 s at the tests' lowest (tests/conftest.py)
def test_the_tiny_model_learns_python_source_text():
    """Held-out bytes of the standard library: from uniform guessing (ln 1024 = 6.93 nats) to below
    3.5 nats a byte in 40 steps of 1,024 bytes (measured: 3.07; 2.61 after 120 steps, as
    `python bench/learning_curve.py` draws it for docs/training.md)."""
    with optimisation_level(lowest=True):  # the init's random draws, run once: 2 s to compile at the lowest level, 13 s at the default
        params = initial_params()
    before, after = learning_run(steps=40, params=params)
    assert before > 6.5
    assert after < 3.5, after
