"""EAGLE-3 draft heads (gptoss_jax/model/eagle3.py, drafts/eagle3_load.py, drafts/eagle3.py): a head written in the published
layout (safetensors and config.json, as SpecForge exports them for SGLang) loads beside a gpt-oss
config and computes what the reference computes: the EAGLE-3 layer as SGLang's and vLLM's
`LlamaForCausalLMEagle3` wire it, built from Hugging Face transformers' Llama attention, MLP,
RMSNorm and rotary embedding, in float32 and float64 (tolerances from tests/noise.py). Its cache
gives what one pass over the whole sequence gives; bad folders are refused by name.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from eagle3_ref import D, F, N, U, Reference, write_head
from noise import Exact

from gptoss_jax.config import ModelConfig
from gptoss_jax.sources import SourceError
from gptoss_jax.model.eagle3 import Eagle3Head, captured, init_head_cache
from gptoss_jax.eagle3_config import Eagle3Config
from gptoss_jax.drafts.eagle3_load import load_eagle3
from gptoss_jax.drafts.base import Proposal
from gptoss_jax.drafts.eagle3 import Eagle3Draft
from gptoss_jax.sampling import Sampling


@pytest.fixture(scope="module")
def target():
    return ModelConfig(num_hidden_layers=8, num_experts=4, vocab_size=300, hidden_size=D, intermediate_size=32,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def reference_outputs(reference, embedded, states):
    """The reference's (logits, outputs) over the whole sequence in float64 and float32."""
    def theirs(dtype):
        ref = reference.to(dtype)
        logits, y = ref(torch.tensor(embedded, dtype=dtype), torch.tensor(states, dtype=dtype))
        return logits.detach().numpy(), y.detach().numpy()

    return theirs(torch.float64), theirs(torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("T", [12, 40], ids=["drafting-sized", "prompt-chunk-sized"])
@pytest.mark.parametrize("norm_before_fc", [False, True])
def test_a_published_head_computes_what_the_reference_computes(tmp_path, target, norm_before_fc, T):
    """Logits and outputs of T positions against the reference's, from the target's captured states
    (first draft step) and from the head's own outputs fed back (later steps); float32 within 8x the
    reference's float32 noise against float64. Both sizes of call: on CPU the jnp attention takes
    one dense pass up to 16 queries and key blocks beyond (on GPUs "auto" picks by the same size)."""
    torch.manual_seed(0)
    reference = Reference(norm_before_fc)
    hot = np.sort(np.random.default_rng(0).choice(300, U, replace=False))
    write_head(tmp_path, reference, hot, config_extra={"norm_before_fc": True} if norm_before_fc else None)
    config, params, loaded_hot = load_eagle3(str(tmp_path), target, dtype=jnp.float32)
    assert config.aux_layers == (1, 3, 5) and config.norm_before_fc == norm_before_fc
    np.testing.assert_array_equal(loaded_hot, hot)
    rng = np.random.default_rng(1)
    embedded, states = rng.normal(size=(2, T, D)), rng.normal(size=(2, T, 3 * D)) * 3
    (logits64, y64), (logits32, y32) = reference_outputs(reference, embedded, states)
    head = jax.jit(Eagle3Head(config, param_dtype=jnp.float32).apply)  # one program (eagerly: an op each)
    cache = init_head_cache(config, 2, 48, jnp.float32)
    logits, y, cache = head(params, jnp.asarray(embedded, jnp.float32), jnp.asarray(states, jnp.float32),
                            cache, jnp.ones((2, T), bool))
    Exact.measure(logits32, logits64).check(logits, "draft logits")
    Exact.measure(y32, y64).check(y, "draft outputs")
    assert (np.asarray(cache["lengths"]) == T).all()


@pytest.mark.slow
def test_the_cache_gives_what_one_pass_gives(tmp_path, target):
    """The head's cache: 20 positions (a prompt chunk), then 4, then 3, then 1 (drafting) give the reference's
    logits of one pass over the 28 (float32 within 8x its own noise against float64); a padding
    position writes nothing."""
    torch.manual_seed(1)
    reference = Reference(False)
    write_head(tmp_path, reference, np.arange(U) * 2)
    config, params, _ = load_eagle3(str(tmp_path), target, dtype=jnp.float32)
    head = jax.jit(Eagle3Head(config, param_dtype=jnp.float32).apply)
    rng = np.random.default_rng(2)
    embedded, states = rng.normal(size=(2, 28, D)), rng.normal(size=(2, 28, 3 * D))
    (logits64, _), (logits32, _) = reference_outputs(reference, embedded, states)
    cache = init_head_cache(config, 2, 32, jnp.float32)
    parts = []
    for a, b in ((0, 20), (20, 24), (24, 27), (27, 28)):
        out, _, cache = head(params, jnp.asarray(embedded[:, a:b], jnp.float32),
                             jnp.asarray(states[:, a:b], jnp.float32), cache, jnp.ones((2, b - a), bool))
        parts.append(out)
    Exact.measure(logits32, logits64).check(np.concatenate(parts, axis=1), "cached logits")
    embedded, states = jnp.asarray(embedded, jnp.float32), jnp.asarray(states, jnp.float32)
    cache = init_head_cache(config, 2, 16, jnp.float32)
    _, _, cache = head(params, embedded[:, :5], states[:, :5], cache, jnp.array([[True] * 5, [True] * 3 + [False] * 2]))
    assert list(np.asarray(cache["lengths"])) == [5, 3]
    assert not np.asarray(cache["k"])[1, 3:].any()


@pytest.mark.slow
def test_the_target_captures_its_layers_outputs_as_transformers_gives_them(tiny, tiny_params, long_tokens):
    """Transformer(capture=...) keeps the residual stream after the named blocks: transformers'
    hidden_states[i + 1] (float32, within 8x its own noise against float64), with and without a cache."""
    from refs import hf_model

    import gptoss_jax as gj
    from gptoss_jax.model.transformer import Transformer

    tokens = torch.from_numpy(long_tokens[:, :40]).long()
    with torch.no_grad():
        h32, h64 = (hf_model(tiny, tiny_params, dtype).to(getattr(torch, dtype))(tokens, output_hidden_states=True)
                    .hidden_states for dtype in ("float32", "float64"))
    model = jax.jit(functools.partial(Transformer(tiny, param_dtype=jnp.float32, capture=(0, 2)).apply,
                                      mutable=["intermediates"]))
    _, whole = model({"params": tiny_params}, jnp.asarray(long_tokens[:, :40]))
    (_, _), cached = model({"params": tiny_params}, jnp.asarray(long_tokens[:, :40]), gj.init_cache(tiny, 1, 64, jnp.float32))
    D = tiny.hidden_size
    for state in (whole, cached):
        states = captured(state, (0, 2))
        assert states.shape == (1, 40, 2 * D)
        for j, i in enumerate((0, 2)):
            Exact.measure(h32[i + 1][0].numpy(), h64[i + 1][0].numpy()).check(states[0, :, j * D:(j + 1) * D],
                                                                              f"layer {i}")


def test_layer_ids_are_read_as_sglang_reads_them():
    base = {"hidden_size": D, "intermediate_size": F, "num_attention_heads": N, "vocab_size": 300,
            "draft_vocab_size": U}
    assert Eagle3Config.from_json({**base, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 11, 21]}},
                                  24).aux_layers == (1, 11, 21)  # SpecForge's gpt-oss-20b head: the layers' outputs
    assert Eagle3Config.from_json({**base, "eagle_aux_hidden_state_layer_ids": [2, 12, 21]}, 24).aux_layers == (2, 12, 21)
    assert Eagle3Config.from_json(base, 36).aux_layers == (1, 17, 32)  # the default [2, L/2, L-3], before those layers
    both = {**base, "eagle_aux_hidden_state_layer_ids": [0, 1, 2],
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 4, 5]}}
    assert Eagle3Config.from_json(both, 24).aux_layers == (3, 4, 5)  # eagle_config's, as SGLang reads them
    for bad, match in (({"draft_vocab_size": None}, "draft_vocab_size"), ({"fc_norm": True}, "fc_norm"),
                       ({"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state"),
                       ({"eagle_aux_hidden_state_layer_ids": [1, 30, 40]}, "ascending layers")):
        with pytest.raises(ValueError, match=match):
            Eagle3Config.from_json({**base, **bad}, 24)


@pytest.mark.parametrize("change, match", [
    ({"drop": ["midlayer.mlp.up_proj.weight"]}, "missing midlayer.mlp.up_proj.weight"),
    ({"tensors_extra": {"midlayer.extra.weight": np.zeros(3, np.float32)}}, "unknown midlayer.extra.weight"),
    ({"tensors_extra": {"lm_head.weight": np.zeros((U, D + 1), np.float32)}}, r"lm_head.weight has shape \[50, 65\]"),
    ({"tensors_extra": {"t2d": np.zeros(300, bool)}}, "t2d does not mark"),
    ({"tensors_extra": {"d2t": np.full(U, 290, np.int64)}}, "d2t maps draft tokens outside"),
    ({"config_extra": {"vocab_size": 301}}, "vocabulary 301"),
])
def test_a_folder_that_is_not_such_a_head_is_refused_by_name(tmp_path, target, change, match):
    torch.manual_seed(2)
    write_head(tmp_path, Reference(False), np.arange(U), **change)
    with pytest.raises(SourceError, match=match):
        load_eagle3(str(tmp_path), target)


def tiny_head(folder, target, seed: int = 3):
    """A random head for the tiny target (its hidden size, 4 layers), written as published and loaded."""
    torch.manual_seed(seed)
    write_head(folder, Reference(False), np.sort(np.random.default_rng(seed).choice(300, U, replace=False)),
               layer_ids=(1, 2, 3))
    return Eagle3Draft.load(str(folder), target, dtype=jnp.float32)


@pytest.fixture(scope="module")
def tiny300():
    """The tiny config with a vocabulary of 300 (the heads' target) and its float32 parameters: 4 layers,
    whose outputs after layers 1, 2 and 3 the heads read (as tests/test_serving_eagle3.py has them)."""
    from gptoss_jax.testing import random_params

    config = ModelConfig(num_hidden_layers=4, num_experts=4, vocab_size=300, hidden_size=D, intermediate_size=32,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16)
    return config, random_params(config, seed=4, dtype=jnp.float32)


@pytest.mark.slow
def test_greedy_tokens_with_an_eagle3_head_are_those_without(tmp_path, tiny300):
    """Generator with a head drafting 3 tokens a step: the greedy tokens of 3 prompts (2 to 40 tokens, a
    prefill of 16-token chunks) over 40 new tokens are those of one token a step."""
    from gptoss_jax.decoding.generator import Generator

    config, params = tiny300
    draft = tiny_head(tmp_path, config)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 300, n).tolist() for n in (2, 17, 40)]
    generator = Generator(config, params, max_len=128, prefill_chunk=16)
    greedy = Sampling(temperature=0.0)
    want = [r.output_ids for r in generator.generate(prompts, max_new_tokens=40, sampling=greedy)]
    got = generator.generate(prompts, max_new_tokens=40, sampling=greedy, draft=draft, draft_tokens=3)
    assert [r.output_ids for r in got] == want
    assert all(r.timings["drafted_tokens"] > 0 for r in got)


@pytest.mark.slow
@pytest.mark.parametrize("steered", [False, True], ids=["its own drafts", "the target's reply proposed"])
@pytest.mark.parametrize("driver", ["Generator", "Engine"])
def test_each_step_drafts_what_the_head_gives_over_the_whole_sequence(tmp_path, tiny300, steered, driver):
    """The head's drafts at every step (its cache filled chunk by chunk at the prefill, then by each
    decode step's and checked step's kept tokens), under the command line's `Generator` and the
    serving engine (a paged cache, prompt chunks of 16, decode steps between the checked steps while
    a missing row backs off), are those of one pass of the head over the committed sequence's pairs
    (the target's states at p, uncached, with the token at p + 1), then its own chain. A random
    head's drafts are never accepted (one pair a step); steered, the head still runs but the target's
    own greedy reply is proposed in its place, so steps accept several drafts and commit several
    pairs at once."""
    from gptoss_jax.decoding.generator import Generator
    from gptoss_jax.model.transformer import Transformer
    from gptoss_jax.serving import Engine, EngineConfig, Settings

    config, params = tiny300
    loaded = tiny_head(tmp_path, config, seed=6)
    prompt = np.random.default_rng(7).integers(0, 300, 21).tolist()
    emitted, proposed = [], []

    generator = Generator(config, params, max_len=128, prefill_chunk=16, decode_steps=4)
    greedy = Sampling(temperature=0.0)
    reply = jnp.asarray(prompt + generator.generate([prompt], max_new_tokens=40, sampling=greedy)[0].output_ids)

    class Recording(Eagle3Draft):  # each step's drafts on the devices, with the pairs committed before them
        def propose(self, context, k):
            drafts, n, after = super().propose(context, k)
            pairs = context.lengths - 1  # x_0 .. x_pairs committed
            jax.debug.callback(lambda r, p, d: proposed.extend((int(p[i]), np.asarray(d)[i].tolist())
                                                               for i in range(len(r)) if r[i] == 0),
                               context.rows, pairs, drafts)
            if steered:  # x_0 .. x_pairs are committed: propose x_(pairs + 1) ..
                drafts = reply[jnp.minimum(pairs[:, None] + 1 + jnp.arange(k)[None], len(reply) - 1)]
            return Proposal(drafts, n, after)

    # fc scaled down: the first draft's hidden state is mostly what its attention reads from the cache
    # (the norm after fc undoes the scale), so a pair mispaired there changes the drafts.
    leaning = jax.tree_util.tree_map_with_path(lambda path, x: x * 1e-3 if path[-1].key == "fc" else x, loaded.params)
    draft = Recording(loaded.config, leaning, loaded.hot)
    if driver == "Generator":
        result, = generator.generate([prompt], max_new_tokens=30, sampling=greedy, draft=draft, draft_tokens=3,
                                     on_token=lambda b, t: emitted.append(t))
        accepted = result.timings["accepted_tokens"]
    else:
        engine = Engine(config, params, EngineConfig(slots=2, max_len=128, prefill_chunk=16, page_size=8,
                                                     decode_sizes=(2,), draft_tokens=3, speculate_steps=4),
                        draft=draft)
        request = engine.submit(prompt, Settings(max_new_tokens=30, sampling=greedy))
        engine.run_until_idle()
        stats = engine.stats()
        emitted, accepted = request.output_ids, stats["accepted_draft_tokens"]
        assert steered or stats["drafting_steps"] < 20  # backing off, the head follows decode steps
        assert engine.speculation.history is None  # a head drafts from its own state: no token history kept
    assert emitted == reply[len(prompt):len(prompt) + 30].tolist()
    assert (accepted >= 20) == steered, accepted
    head = Eagle3Head(draft.config, param_dtype=jnp.float32)
    target = Transformer(config, param_dtype=jnp.float32, capture=draft.config.aux_layers)
    embedding, S = params["embedding"], 64  # sequences padded to S: one compilation

    @jax.jit
    def slow(tokens, following, n):  # x_0 .. x_(n-1) and x_1 .. x_n, padded [1, S] -> 3 greedy drafts
        _, state = target.apply({"params": params}, tokens, mutable=["intermediates"])
        cache = init_head_cache(draft.config, 1, S + 3, jnp.float32)
        logits, y, cache = head.apply(draft.params, embedding[following], captured(state, draft.config.aux_layers),
                                      cache, jnp.arange(S)[None] < n)
        logits, y = logits[:, n - 1], jax.lax.dynamic_slice_in_dim(y, n - 1, 1, axis=1)
        out = []
        for _ in range(3):
            out.append(draft.hot[jnp.argmax(logits[0])])
            logits, y, cache = head.apply(draft.params, embedding[out[-1]][None, None], y, cache, jnp.ones((1, 1), bool))
            logits = logits[:, 0]
        return jnp.stack(out)

    assert len(proposed) >= 4  # (the engine's missing row backs off: steps 1, 2, 6 and 14 of 30 draft)
    for n, drafts in proposed:  # n pairs committed: x_0 .. x_n, x_n not yet in the target's cache
        committed = (prompt + emitted)[:n + 1]
        tokens, following = np.zeros((1, S), np.int32), np.zeros((1, S), np.int32)
        tokens[0, :n], following[0, :n] = committed[:-1], committed[1:]
        assert drafts == np.asarray(slow(tokens, following, n)).tolist(), (n, drafts)


@pytest.mark.slow
def test_a_head_beside_parameters_on_a_mesh_drafts_as_on_one_device(tmp_path, tiny300):
    """Parameters on a mesh of data=2, expert=2, tensor=2 (8 CPU devices), two prompts of several
    prefill chunks and a stop token: the tokens, drafts and acceptances of one device. The head is
    steered (it runs, the target's reply is proposed in its place), so steps accept drafts."""
    import gptoss_jax as gj
    from gptoss_jax.decoding.generator import Generator
    from gptoss_jax.params import param_shardings

    config, params = tiny300
    loaded = tiny_head(tmp_path, config, seed=8)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, 300, n).tolist() for n in (30, 45)]
    one = Generator(config, params, max_len=128, prefill_chunk=16, decode_steps=4)
    greedy = Sampling(temperature=0.0)
    plain = [r.output_ids for r in one.generate(prompts, max_new_tokens=24, sampling=greedy)]
    width = max(len(p) + len(r) for p, r in zip(prompts, plain))
    full = jnp.asarray([p + r + [0] * (width - len(p) - len(r)) for p, r in zip(prompts, plain)], jnp.int32)

    class Steered(Eagle3Draft):
        def propose(self, context, k):
            own, n, after = super().propose(context, k)
            pairs = context.lengths - 1  # x_0 .. x_pairs committed
            at = jnp.minimum(pairs[:, None] + 1 + jnp.arange(k)[None], width - 1)
            return Proposal(jnp.where(own >= 0, jnp.take_along_axis(full, at, axis=1), own), n, after)

    draft = Steered(loaded.config, loaded.params, loaded.hot)
    mesh = gj.make_mesh(data=2, expert=2, tensor=2)
    sharded = Generator(config, jax.device_put(params, param_shardings(config, mesh)), max_len=128, prefill_chunk=16,
                        decode_steps=4)
    stop = plain[1][12]
    runs = [[(r.output_ids, r.finish_reason, r.timings["drafted_tokens"], r.timings["accepted_tokens"])
             for r in g.generate(prompts, max_new_tokens=24, sampling=greedy, stop_tokens=[stop], draft=draft,
                                 draft_tokens=3)] for g in (one, sharded)]
    assert runs[0] == runs[1]
    assert [r[0] for r in runs[0]] == [p[:p.index(stop) + 1] if stop in p else p for p in plain]
    assert all(r[3] > 0 for r in runs[0])


@pytest.mark.slow
def test_beside_a_model_on_a_mesh_the_head_attends_with_the_jnp_path():
    """The fused attention variants see one device's part of their arrays (the model's cache, split
    by shard_map); the head's arrays are whole on every device, so on a mesh it takes the jnp
    variant, which XLA partitions, and on one device the model's own kernels."""
    import gptoss_jax as gj
    from gptoss_jax.drafts.eagle3 import _attending

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    named = gj.Kernels(attention="mosaic", moe="gather")
    assert _attending(named, None) is named
    assert _attending(named, mesh) == gj.Kernels(attention="blockwise", moe="gather")
