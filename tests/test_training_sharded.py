"""Training on a mesh against one device: 8 CPU devices (conftest.py), and two processes of 4.

The gradients of every trained tensor (LoRA adapters on attention, router and experts, or every
weight) equal the one-device gradients; the optimizer state is kept split as STATE_RULES says
(the width over `data` as well) and AdamW's moments equal the one-device ones; two processes fine-
tuning through finetune.py follow the one-process loss trajectory and write one merged model: the
base with their own final adapters merged in.

Why moments and not the updated weights: AdamW's first update is lr * g / (|g| + eps) per element,
so an element whose gradient is near eps (1e-8) turns a rounding difference of the gradient into
an update difference of up to lr. The weights after a step are an elementwise function of the
moments, which are compared instead.

The bounds (noise.py): gradients and moments, on the mesh and on one device, each within
NOISE_FACTOR x transformers' own float32 error of its float64 result on the same weights (for
adapters: on the exactly merged weights, through the chain rule).
"""

import functools


import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import refs
from conftest import TWO_LAYERS, VOCAB, command_env, expected_spec, free_port, needs_vocab
from noise import Exact, scalar
from jax.sharding import NamedSharding

import gptoss_jax as gj
from gptoss_jax import sharding as sh
from gptoss_jax.params import param_shardings
from gptoss_jax.testing import random_params
from gptoss_jax.training import placement
from gptoss_jax.training.lora import LoraConfig, init_adapters
from gptoss_jax.training.state import TrainCheckpoints
from gptoss_jax.training.step import OptimizerConfig, StepConfig, gradients, make_step, optimizer
from gptoss_jax.weight import at_path, path_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = TWO_LAYERS  # sliding window 16, then a full layer; the batches below are 40 positions
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


@functools.lru_cache(maxsize=None)
def _reference(lora, accumulation):
    """transformers' (mean loss, {our path: gradient of the mean loss}) in float32 and float64 for the
    batch of _batch(accumulation=...) and the weights of _trainable(lora)."""
    tokens, mask = (x.reshape(-1, x.shape[-1]) for x in _batch(accumulation=accumulation))
    trainable, frozen = _trainable(lora)
    params, adapters = (trainable, None) if lora is None else (frozen, trainable)
    return tuple(refs.reference_gradients(CONFIG, params, tokens, mask, d, lora, adapters) for d in ("float32", "float64"))


def _laid_out(setup, tx, trainable, frozen):
    if setup.mesh is None:
        return trainable, frozen
    trainable = placement.place(trainable, setup.state_shardings(tx)[0])
    return trainable, None if frozen is None else jax.device_put(frozen, param_shardings(CONFIG, setup.mesh))


def _grads(lora, mesh, tokens, mask):
    setup = StepConfig(CONFIG, lora=lora, compute_dtype="float32", remat=False, mesh=mesh,
                       kernels=gj.Kernels(attention_block=16))
    trainable, frozen = _laid_out(setup, optax.sgd(1.0), *_trainable(lora))
    run = jax.jit(lambda t, f, x, m: gradients(setup, t, f, x, m))
    return run(trainable, frozen, placement.put_batch(tokens, mesh), placement.put_batch(mask, mesh))


@pytest.mark.slow
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
    n = mask[:, :, 1:].sum()
    assert float(count8) == float(count1) == n
    (l32, g32), (l64, g64) = _reference(lora, 2)
    exact_total = scalar(l32 * n, l64 * n)
    exact = {name: Exact.measure(g32[name] * n, want * n) for name, want in g64.items()}
    for where, total, grads in (("one device", total1, one), ("mesh", total8, eight)):
        exact_total.check([total], f"loss sum, {where}")
        got = refs.by_path(grads)
        assert set(got) == set(exact)
        for name, want in exact.items():
            want.check(got[name], f"{name}, {where}")


@pytest.mark.slow
@pytest.mark.parametrize("lora", [None, ALL_TARGETS], ids=["full", "lora"])
def test_a_sharded_adamw_step_keeps_its_state_split_and_equal_to_one_device(lora):
    mesh = sh.make_mesh(data=4, expert=2)
    opt = OptimizerConfig(lr=1e-2, steps=10, weight_decay=0.1)
    tx = optimizer(opt)
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
    (l32, g32), (l64, g64) = _reference(lora, 1)
    exact_loss = scalar(l32, l64)
    exact_loss.check([loss1], "loss, one device")
    exact_loss.check([loss8], "loss, mesh")

    # Laid out by STATE_RULES: the trained tree and both of AdamW's moments.
    axes = placement.trainable_axes(CONFIG, lora)
    def adam(state):
        found = [t for t in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
                 if isinstance(t, optax.ScaleByAdamState)]
        assert len(found) == 1
        return found[0]

    split_over_data = 0
    for tree in (trainable8, adam(state8).mu, adam(state8).nu):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            want = expected_spec(tuple(at_path(axes, path)), leaf.shape, mesh, sh.STATE_RULES)
            assert isinstance(leaf.sharding, NamedSharding) and leaf.sharding.spec == want, path_name(path)
            split_over_data += "data" in want
    assert split_over_data >= len(jax.tree.leaves(trainable8))  # most of them: everything with a width

    # After one step mu = (1 - b1) g and nu = (1 - b2) g^2, with g the mean gradient clipped to the
    # global norm `clip`: mu / (1 - b1) and sqrt(nu / (1 - b2)) are g and |g|.
    def clipped(grads):
        norm = np.sqrt(sum(np.sum(g ** 2) for g in grads.values()))
        return {k: g * min(1.0, opt.clip / norm) for k, g in grads.items()}

    c32, c64 = clipped(g32), clipped(g64)
    exact = {k: Exact.measure(c32[k], c64[k]) for k in c64}
    for where, state in (("one device", adam(state1)), ("mesh", adam(state8))):
        assert set(refs.by_path(state.mu)) == set(refs.by_path(state.nu)) == set(exact)
        for key, got in refs.by_path(state.mu).items():
            exact[key].check(np.float64(got) / (1 - opt.b1), f"mu {key}, {where}")
        for key, got in refs.by_path(state.nu).items():  # |x| moves no further than x: the same bound
            Exact(np.abs(exact[key].value), exact[key].noise).check(np.sqrt(np.float64(got) / (1 - opt.b2)),
                                                                    f"nu {key}, {where}")


@pytest.mark.slow
@needs_vocab
def test_two_processes_fine_tune_as_one(tmp_path):
    """finetune.py on two processes of 4 CPU devices (--mesh data=2,expert=4, LoRA on attention and
    experts) against one process on one device: the same loss at every step, one merged model."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {2 * a + 1}?"},
                                                     {"role": "assistant", "content": str(3 * a + 1)}]}) + "\n"
                            for a in range(10)))
    common = ["--data", str(data), "--steps", "3", "--lora-rank", "4", "--lora-targets", "attention,experts",
              "--lr", "1e-2", "--json", "--quiet"]
    pairs = ["--batch-size", "2"]  # two sequences a step
    env = command_env(TIKTOKEN_ENCODINGS_BASE=os.path.dirname(VOCAB), PYTHONUNBUFFERED="1")
    finetune = [sys.executable, os.path.join(ROOT, "finetune.py")]
    one = subprocess.run(finetune + common + pairs + ["--out", str(tmp_path / "one")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr
    # The trajectory's own float32 noise: the same run with each step's two sequences as two
    # micro-batches of one (the same sums in another order).
    split = ["--batch-size", "1", "--accumulation", "2"]
    noise_run = subprocess.run(finetune + common + split + ["--out", str(tmp_path / "split")], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=600)
    assert noise_run.returncode == 0, noise_run.stderr

    port, out = free_port(), str(tmp_path / "two")
    procs = [subprocess.Popen(finetune + common + pairs + ["--out", out, "--mesh", "data=2,expert=4", "--coordinator",
                                                   f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
                              cwd=ROOT, env=dict(env, JAX_NUM_CPU_DEVICES="4"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    assert "devices: data=2,expert=4,tensor=1 over 8 cpu devices (2 processes)" in outs[0][1]
    assert outs[1][0] == ""  # only process 0 prints
    losses = lambda text: [json.loads(line)["loss"] for line in text.splitlines()]  # noqa: E731
    want, got, other_order = losses(one.stdout), losses(outs[0][0]), losses(noise_run.stdout)
    assert len(want) == len(got) == len(other_order) == 3
    Exact.measure(np.array(other_order), np.array(want)).check(np.array(got), "loss trajectory")

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
    base = random_params(config, seed=0, dtype=jnp.float32)
    # float32 rounding alone: the run merged on its mesh, against the exact merge; the noise is a
    # float32 merge in numpy.
    noise, exact = refs.merge_host(base, adapters, lora, np.float32), refs.merge_host(base, adapters, lora)
    for (path, got), w, x in zip(jax.tree_util.tree_leaves_with_path(merged), jax.tree.leaves(noise),
                                 jax.tree.leaves(exact), strict=True):
        Exact.measure(w, x).check(got, path_name(path))
