"""Training on a mesh against one device: 8 CPU devices (conftest.py), and two processes of 4.

The gradients of every trained tensor (LoRA adapters on attention, router and experts, or every
weight) equal the one-device gradients; the optimizer state is kept split as STATE_RULES says
(the width over `data` as well) and AdamW's moments equal the one-device ones; two processes fine-
tuning through finetune.py follow the one-process loss trajectory and write one merged model: the
base with their own final adapters merged in.

Why moments and not the updated weights: AdamW's first update is lr * g / (|g| + eps) per element,
so an element whose gradient is near eps (1e-8) turns a rounding difference of the gradient into
an update difference of up to lr. The weights after a step are an elementwise function of the
moments, which are compared at 1e-5.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import VOCAB, expected_spec, free_port, needs_vocab, rel_err
from jax.sharding import NamedSharding

import gptoss_jax as gj
from gptoss_jax import sharding as sh
from gptoss_jax.params import at_path, path_name
from gptoss_jax.testing import random_params
from gptoss_jax.training import placement
from gptoss_jax.training.lora import LoraConfig, init_adapters, merge
from gptoss_jax.training.state import TrainCheckpoints
from gptoss_jax.training.step import OptimizerConfig, StepConfig, gradients, make_step, optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = gj.ModelConfig.tiny()  # sliding window 16; the batches below are 40 positions
ALL_TARGETS = LoraConfig(rank=4, targets=("attention", "router", "experts"))


def _batch(batch=4, length=40, accumulation=1, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CONFIG.vocab_size, (accumulation, batch, length)).astype(np.int32)
    return tokens, rng.random(tokens.shape) < 0.8


def _trainable(lora):
    """Adapters with non-zero b (so that every adapter gradient is non-trivial), or every weight."""
    params = random_params(CONFIG, seed=3, dtype=jnp.float32)
    if lora is None:
        return params, None
    adapters = init_adapters(CONFIG, lora, jax.random.key(1))
    adapters = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(2), x.shape), adapters)
    return adapters, params


def _laid_out(setup, tx, trainable, frozen):
    if setup.mesh is None:
        return trainable, frozen
    trainable = placement.place(trainable, setup.state_shardings(tx)[0])
    return trainable, None if frozen is None else jax.device_put(frozen, sh.param_shardings(CONFIG, setup.mesh))


def _grads(lora, mesh, tokens, mask):
    setup = StepConfig(CONFIG, lora=lora, compute_dtype="float32", remat=False, mesh=mesh,
                       kernels=gj.Kernels(attention_block=16))
    trainable, frozen = _laid_out(setup, optax.sgd(1.0), *_trainable(lora))
    run = jax.jit(lambda t, f, x, m: gradients(setup, t, f, x, m))
    return run(trainable, frozen, placement.put_batch(tokens, mesh), placement.put_batch(mask, mesh))


@pytest.mark.parametrize("sizes, lora", [(dict(data=2, expert=2, tensor=2), ALL_TARGETS),
                                         (dict(tensor=8), ALL_TARGETS),
                                         (dict(data=4, expert=2), None)],
                         ids=["data2-expert2-tensor2-lora", "tensor8-lora", "data4-expert2-full"])
def test_sharded_gradients_equal_one_device(sizes, lora):
    """Every trained tensor's gradient (sinks, router, experts and their adapters included) over two
    micro-batches of 4 sequences of 40 positions (past the 16-token window)."""
    tokens, mask = _batch(accumulation=2)
    total1, count1, one = _grads(lora, None, tokens, mask)
    total8, count8, eight = _grads(lora, sh.make_mesh(**sizes), tokens, mask)
    assert float(count8) == float(count1) == mask[:, :, 1:].sum()
    assert abs(float(total8) - float(total1)) <= 1e-6 * abs(float(total1))
    errors = {path_name(p): rel_err(g, w) for (p, g), w in
              zip(jax.tree_util.tree_leaves_with_path(eight), jax.tree.leaves(one), strict=True)}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, (worst, errors[worst])


@pytest.mark.parametrize("lora", [None, ALL_TARGETS], ids=["full", "lora"])
def test_a_sharded_adamw_step_keeps_its_state_split_and_equal_to_one_device(lora):
    mesh = sh.make_mesh(data=4, expert=2)
    tx = optimizer(OptimizerConfig(lr=1e-2, steps=10, weight_decay=0.1))
    tokens, mask = _batch()
    results = {}
    for where in (None, mesh):
        setup = StepConfig(CONFIG, lora=lora, compute_dtype="float32", mesh=where, kernels=gj.Kernels(attention_block=16))
        trainable, frozen = _laid_out(setup, tx, *_trainable(lora))
        opt_state = placement.place(tx.init(trainable), setup.state_shardings(tx)[1])
        trainable, opt_state, metrics = make_step(setup, tx)(trainable, opt_state, frozen,
                                                             placement.put_batch(tokens, where),
                                                             placement.put_batch(mask, where))
        results[where] = trainable, opt_state, float(metrics["loss"])
    (_, state1, loss1), (trainable8, state8, loss8) = results[None], results[mesh]
    assert abs(loss8 - loss1) <= 1e-6 * loss1

    # Laid out by STATE_RULES: the trained tree and both of AdamW's moments.
    axes = placement.trainable_axes(CONFIG, lora)
    moments = [t for t in jax.tree.leaves(state8, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
               if isinstance(t, optax.ScaleByAdamState)]
    assert len(moments) == 1
    split_over_data = 0
    for tree in (trainable8, moments[0].mu, moments[0].nu):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            want = expected_spec(tuple(at_path(axes, path)), leaf.shape, mesh, sh.STATE_RULES)
            assert isinstance(leaf.sharding, NamedSharding) and leaf.sharding.spec == want, path_name(path)
            split_over_data += "data" in want
    assert split_over_data >= len(jax.tree.leaves(trainable8))  # most of them: everything with a width

    one_moments = [t for t in jax.tree.leaves(state1, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
                   if isinstance(t, optax.ScaleByAdamState)][0]
    # After one step mu = (1 - b1) g and nu = (1 - b2) g^2: mu and sqrt(nu) carry g's relative error.
    for name, f in (("mu", np.asarray), ("nu", np.sqrt)):
        for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(getattr(moments[0], name)),
                                     jax.tree.leaves(getattr(one_moments, name)), strict=True):
            assert rel_err(f(got), f(want)) <= 1e-5, (name, path_name(path))


@needs_vocab
def test_two_processes_fine_tune_as_one(tmp_path):
    """finetune.py on two processes of 4 CPU devices (--mesh data=2,expert=4, LoRA on attention and
    experts) against one process on one device: the same loss at every step, one merged model."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {2 * a + 1}?"},
                                                     {"role": "assistant", "content": str(3 * a + 1)}]}) + "\n"
                            for a in range(10)))
    common = ["--data", str(data), "--steps", "3", "--batch-size", "2", "--lora-rank", "4", "--lora-targets",
              "attention,experts", "--lr", "1e-2", "--json", "--quiet", "--compile-cache", "none"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env.update(TIKTOKEN_ENCODINGS_BASE=os.path.dirname(VOCAB), PYTHONUNBUFFERED="1")
    finetune = [sys.executable, os.path.join(ROOT, "finetune.py")]
    one = subprocess.run(finetune + common + ["--out", str(tmp_path / "one")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr

    port, out = free_port(), str(tmp_path / "two")
    procs = [subprocess.Popen(finetune + common + ["--out", out, "--mesh", "data=2,expert=4", "--coordinator",
                                                   f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
                              cwd=ROOT, env=dict(env, JAX_NUM_CPU_DEVICES="4"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    assert "devices: data=2,expert=4,tensor=1 over 8 cpu devices (2 processes)" in outs[0][1]
    assert outs[1][0] == ""  # only process 0 prints
    losses = lambda text: [json.loads(line)["loss"] for line in text.splitlines()]  # noqa: E731
    want, got = losses(one.stdout), losses(outs[0][0])
    assert len(want) == len(got) == 3
    assert max(abs(g - w) / w for g, w in zip(got, want)) <= 1e-6, (got, want)

    # One merged model, written once from the two processes' shards: the demo model's weights with
    # the final train state's adapters merged in (the gathering and writing lose nothing).
    assert not [n for n in os.listdir(out) if n.startswith(".params-partial")]
    config, merged = gj.load_checkpoint(out, dtype="float32")
    lora = LoraConfig(rank=4, alpha=8.0, targets=("attention", "experts"))
    tx = optimizer(OptimizerConfig())
    adapters = init_adapters(config, lora, jax.random.key(0))
    states = TrainCheckpoints(os.path.join(out, "checkpoints"))
    adapters, _ = states.restore(states.latest(), adapters, tx.init(adapters))
    states.close()
    want = merge(random_params(config, seed=0, dtype=jnp.float32), adapters, lora)
    for (path, got), w in zip(jax.tree_util.tree_leaves_with_path(merged), jax.tree.leaves(want), strict=True):
        # float32 rounding alone: the run merged on its mesh, this on one device (measured: 7e-8).
        assert rel_err(got, w) <= 1e-6, path_name(path)
