"""Served LoRA adapters: a table of adapters beside the base weights (training/lora.attach_table), each
row of a call choosing its own (Transformer's `adapters`), against each adapter merged into the weights
(training/lora.merge) and run through transformers in float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gptoss_jax as gj
from gptoss_jax.decoding.generator import Generator
from gptoss_jax.sampling import Sampling
from gptoss_jax.serving import Engine, EngineConfig, Settings
from gptoss_jax.training.lora import LoraConfig, attach_table, init_adapters, merge
from conftest import compile_events
from refs import exact_logits

GREEDY = Sampling(temperature=0.0)

# Four adapters of different ranks and targets: attention, the router, the experts.
CONFIGS = (LoraConfig(rank=4, alpha=8.0, targets=("attention",)), LoraConfig(rank=2, alpha=3.0, targets=("attention", "router")),
           LoraConfig(rank=3, alpha=6.0, targets=("experts",)),
           LoraConfig(rank=1, alpha=2.0, targets=("attention", "router", "experts")))


def _trained(config, lora: LoraConfig, seed: int):
    """Adapters as after training: a as initialised, b random (init_adapters' b is zero)."""
    adapters = init_adapters(config, lora, jax.random.key(seed))
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


@pytest.fixture(scope="module")
def served(tiny_f32):
    config, params = tiny_f32
    adapters = [_trained(config, lora, seed) for seed, lora in enumerate(CONFIGS)]
    table = attach_table(config, params, [(a, lora.scale) for a, lora in zip(adapters, CONFIGS)], rank=4)
    merged = [merge(params, a, lora) for a, lora in zip(adapters, CONFIGS)] + [params]  # index -1: the base
    return config, table, merged


@pytest.mark.slow
def test_rows_of_different_adapters_each_get_their_adapter_merged(served):
    """One batch, rows under each of the 4 adapters, none, and adapter 1 again: a 20-token prompt
    (the experts' grouped path), then 3 decode steps (their gather path), each row's logits those
    of its adapter merged into the weights, within transformers' float32 noise of its float64
    logits; the table pads the ranks to 4."""
    config, table, merged = served
    rows = np.array([0, 1, -1, 2, 3, 1], np.int32)
    tokens = np.random.default_rng(5).integers(0, config.vocab_size, (len(rows), 23)).astype(np.int32)
    cache = gj.init_cache(config, len(rows), 64, jnp.float32)
    logits, cache = gj.extend(config, table, tokens[:, :20], cache, adapters=rows)
    steps = [logits]
    for t in range(20, 23):
        logits, cache = gj.extend(config, table, tokens[:, t:t + 1], cache, adapters=rows)
        steps.append(logits)
    got = np.concatenate([np.asarray(s) for s in steps], axis=1)  # [B, 23, V]: every position's logits
    for b, row in enumerate(rows):
        exact = exact_logits(config, merged[row], tokens[b:b + 1])
        exact.check(got[b:b + 1], f"row {b} (adapter {row})")
    # The adapters are there: each adapter's row differs from the base model's beyond the noise.
    for b in (0, 1, 3, 4):
        base = exact_logits(config, merged[-1], tokens[b:b + 1])
        assert float(np.abs(got[b] - base.value[0]).max()) > 100 * base.noise, b


def test_a_table_refuses_a_rank_above_its_own(tiny_f32):
    config, params = tiny_f32
    adapters = init_adapters(config, CONFIGS[0], jax.random.key(0))
    with pytest.raises(ValueError, match="rank 4 at block_0/attn/q_weight, above the table's 2"):
        attach_table(config, params, [(adapters, 1.0)], rank=2)


@pytest.mark.slow
def test_the_engine_gives_each_request_its_adapters_tokens_with_prefix_reuse_and_preemption(served):
    """The engine over the table: a shared system prompt under adapter 0, then under adapter 0 again,
    adapter 1, the base, adapters 2 and 3, in a pool too small for all at once (preemption): each request's greedy tokens
    are those of its adapter merged into the weights, alone; a prefix computed under one adapter is
    found only by a later request under the same one; nothing compiles after warm-up; an adapter the
    engine does not serve is refused."""
    config, table, merged = served
    engine = Engine(config, table, EngineConfig(slots=4, max_len=256, prefill_chunk=16, page_size=8, pages=30))
    assert engine.device.served == 4
    engine.warm_up()
    system = np.random.default_rng(40).integers(0, config.vocab_size, 40).tolist()
    prompts = [system + np.random.default_rng(41 + i).integers(0, config.vocab_size, 5 + 6 * i).tolist()
               for i in range(6)]
    adapters = [0, 0, 1, None, 2, 3]
    with compile_events() as compiled:
        first = engine.submit(prompts[0], Settings(max_new_tokens=30, sampling=GREEDY, adapter=0))
        engine.run_until_idle()
        rest = [engine.submit(p, Settings(max_new_tokens=40, sampling=GREEDY, adapter=a))
                for p, a in zip(prompts[1:], adapters[1:])]
        engine.run_until_idle()
    assert not compiled, compiled
    for r, a in zip([first] + rest, adapters):
        alone = Generator(config, merged[-1 if a is None else a], max_len=256)
        want = alone.generate([r.prompt_ids], max_new_tokens=len(r.output_ids), sampling=GREEDY)[0].output_ids
        assert r.output_ids == want, f"adapter {a}"
    assert [r.cached_tokens for r in rest] == [40, 0, 0, 0, 0]  # only adapter 0's second request finds the prefix
    assert engine.stats()["preemptions"] > 0
    with pytest.raises(ValueError, match="adapter 4: the engine serves 4 adapters"):
        engine.submit(prompts[0], Settings(max_new_tokens=4, adapter=4))


@pytest.mark.slow
def test_one_attached_adapter_is_read_as_before_and_a_table_without_rows_is_the_base(served, tiny_f32):
    """An engine's steps pass each row's adapter index (-1) even over parameters with one attached
    adapter (training/lora.attach: not a table), which then applies to every row as in training; a
    table read without indices gives the base model."""
    from gptoss_jax.training.lora import attach

    config, params = tiny_f32
    _, table, merged = served
    adapters = _trained(config, CONFIGS[0], 0)
    tokens = np.random.default_rng(9).integers(0, config.vocab_size, (2, 12)).astype(np.int32)

    def logits(p, rows):
        cache = gj.init_cache(config, 2, 32, jnp.float32)
        return np.asarray(gj.extend(config, p, tokens, cache, adapters=rows)[0])

    exact = exact_logits(config, merged[0], tokens)  # the table's adapter 0 is this same adapter
    exact.check(logits(attach(params, adapters, CONFIGS[0].scale), np.array([-1, -1], np.int32)), "attached")
    exact.check(logits(table, np.array([0, 0], np.int32)), "the table's adapter 0")
    np.testing.assert_array_equal(logits(table, None), logits(params, None))


@pytest.mark.slow
def test_on_a_mesh_of_8_devices_each_row_gets_its_adapter_merged(served, tiny_f32):
    """The table laid out on a mesh (data 2, expert 2, tensor 2: every adapter on every device, each
    split as its weight; the experts' under their shard_map): each row's logits those of its adapter
    merged, and the engine's greedy tokens those of the adapter merged and run alone."""
    from gptoss_jax.params import param_shardings

    config, params = tiny_f32
    _, _, merged = served
    adapters = [_trained(config, lora, seed) for seed, lora in enumerate(CONFIGS)]
    mesh = gj.make_mesh(data=2, expert=2, tensor=2)
    table = attach_table(config, jax.device_put(params, param_shardings(config, mesh)),
                         [(a, lora.scale) for a, lora in zip(adapters, CONFIGS)], rank=4)
    q = table["block_0"]["attn"]["q_weight_lora"]["b"]  # [adapters, lora, q_heads, head_dim]
    assert q.sharding.spec[:3] == (None, None, "tensor")
    rows = np.array([0, 1, -1, 2, 3, 1, 2, -1], np.int32)
    tokens = np.random.default_rng(7).integers(0, config.vocab_size, (len(rows), 12)).astype(np.int32)
    logits, _ = gj.extend(config, table, tokens, gj.init_cache(config, len(rows), 32, jnp.float32), adapters=rows)
    for b, row in enumerate(rows):
        exact_logits(config, merged[row], tokens[b:b + 1]).check(np.asarray(logits[b:b + 1]), f"row {b} (adapter {row})")

    engine = Engine(config, table, EngineConfig(slots=4, max_len=128, prefill_chunk=16, page_size=8))
    assert engine.mesh is not None and engine.device.served == 4
    prompts = [np.random.default_rng(60 + i).integers(0, config.vocab_size, 9 + 4 * i).tolist() for i in range(3)]
    requests = [engine.submit(p, Settings(max_new_tokens=12, sampling=GREEDY, adapter=a))
                for p, a in zip(prompts, (3, None, 2))]
    engine.run_until_idle()
    for r, a in zip(requests, (3, None, 2)):
        alone = Generator(config, merged[-1 if a is None else a], max_len=128)
        assert r.output_ids == alone.generate([r.prompt_ids], max_new_tokens=12, sampling=GREEDY)[0].output_ids, a


@pytest.mark.slow
def test_an_adapter_put_into_a_table_entry_replaces_the_one_there_without_compiling(served, tiny_f32):
    """An engine started with an empty table of 2 entries (training/lora.empty_table): adapter 0 put
    into entry 1, a request under it, then adapter 3 put into entry 1 in its place: each request's
    greedy tokens are those of the adapter its entry held (merged and run alone); the second request,
    with the same prompt, finds nothing cached (its prefix was computed under the other adapter);
    the second put and everything after it compile nothing; an adapter of a target the table does
    not hold is refused, naming the weight."""
    from gptoss_jax.training.lora import empty_table

    config, params = tiny_f32
    _, _, merged = served
    adapters = [_trained(config, lora, seed) for seed, lora in enumerate(CONFIGS)]
    table = empty_table(config, params, 2, 4, ("attention", "router", "experts"))
    engine = Engine(config, table, EngineConfig(slots=2, max_len=128, prefill_chunk=16, page_size=8))
    engine.warm_up()
    prompt = np.random.default_rng(70).integers(0, config.vocab_size, 30).tolist()
    outputs = []
    for n, a in enumerate((0, 3)):
        with compile_events() as compiled:
            engine.put_adapter(1, _scaled(adapters[a], CONFIGS[a].scale))
            request = engine.submit(prompt, Settings(max_new_tokens=10, sampling=GREEDY, adapter=1))
            engine.run_until_idle()
        assert n == 0 or not compiled, compiled
        alone = Generator(config, merged[a], max_len=128)
        assert request.output_ids == alone.generate([prompt], max_new_tokens=10, sampling=GREEDY)[0].output_ids, a
        outputs.append(request)
    assert outputs[1].cached_tokens == 0
    small = empty_table(config, params, 1, 4, ("attention",))
    engine = Engine(config, small, EngineConfig(slots=2, max_len=128, prefill_chunk=16, page_size=8))
    with pytest.raises(ValueError, match="adapts block_0/mlp/router_weight \\(router\\), which the served adapters' "
                                         "table does not hold \\(it adapts: attention\\)"):
        engine.put_adapter(0, _scaled(adapters[1], 1.0))


def _scaled(adapters, scale):
    """Adapters with their scale folded into b (as training/adapter_files.read_adapter gives them)."""
    return {layer: {m: {n: {"a": ab["a"], "b": ab["b"] * scale} for n, ab in ws.items()} for m, ws in mods.items()}
            for layer, mods in adapters.items()}
