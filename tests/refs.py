"""The two PyTorch references, built on CPU from our parameter pytree.

`openai_model` builds OpenAI's `gpt_oss.torch.model.Transformer`, `hf_model` builds transformers'
`GptOssForCausalLM`; both receive exactly our weights, re-laid out into their tensor names.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import torch

from gptoss_jax import ModelConfig, formats

TORCH_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def host(x) -> np.ndarray:
    """A JAX or numpy array on the host: float64 kept, anything else as float32 (bf16 values stay exact)."""
    x = np.asarray(x)
    return x if x.dtype == np.float64 else x.astype(np.float32)


def by_path(tree) -> dict[str, np.ndarray]:
    """A pytree as {"block_0/attn/qkv_weight": host array} (host(): float64 kept, else float32)."""
    return {"/".join(str(k.key) for k in path): host(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def t(x, dtype=torch.float32) -> torch.Tensor:
    """A JAX or numpy array as a torch tensor (through host(): float64 weights stay exact)."""
    return torch.from_numpy(host(x).copy()).to(dtype)


def openai_config(config: ModelConfig):
    from gpt_oss.torch.model import ModelConfig as RefConfig

    return RefConfig(**config.to_original_json())


def _state_dict(config: ModelConfig, params, layout: str) -> dict[str, np.ndarray]:
    """Our pytree in a layout's tensor names, through the converter's own rules (formats.py) run backwards.

    MXFP4 experts are given decoded, as the reference modules hold them: [E, out, in], like ours.
    """
    flat = by_path(params)
    sd = {}
    for rule in formats.rules(config, layout):
        if rule.packed:
            sd[rule.sources[0].name.removesuffix(".blocks")] = flat[rule.targets[0]]
            continue
        for src, value in zip(rule.sources, rule.from_ours(*(flat[t] for t in rule.targets)), strict=True):
            sd[src.name] = value
    return sd


def openai_state_dict(config: ModelConfig, params) -> dict[str, np.ndarray]:
    return _state_dict(config, params, formats.ORIGINAL)


def _load(model: torch.nn.Module, sd: dict[str, np.ndarray], dtype: torch.dtype) -> None:
    expected = dict(model.named_parameters())
    assert set(expected) == set(sd), (set(expected) ^ set(sd))
    with torch.no_grad():
        for name, param in expected.items():
            value = t(sd[name])
            assert tuple(value.shape) == tuple(param.shape), (name, value.shape, param.shape)
            # Norm scales stay float32 in both references; everything else takes the model dtype.
            param.copy_(value.to(param.dtype))


def openai_model(config: ModelConfig, params, dtype: str = "float32"):
    from gpt_oss.torch.model import Transformer

    torch.manual_seed(0)
    model = Transformer(openai_config(config), device=torch.device("cpu"))
    if dtype == "float32":
        model = model.to(torch.float32)
    _load(model, openai_state_dict(config, params), TORCH_DTYPES[dtype])
    return model.eval()


def hf_config(config: ModelConfig):
    from transformers import GptOssConfig

    return GptOssConfig(**config.to_hf_json(mxfp4=False), attn_implementation="eager")


def hf_state_dict(config: ModelConfig, params) -> dict[str, np.ndarray]:
    return _state_dict(config, params, formats.HF_BF16)


def hf_model(config: ModelConfig, params, dtype: str = "float32"):
    """float64: the exact reference for gradients (transformers' grouped-matmul experts take 32-bit
    and 16-bit floats only, so its eager experts run instead)."""
    from transformers import GptOssForCausalLM

    torch.manual_seed(0)
    hf = hf_config(config)
    if dtype == "float64":
        hf._experts_implementation = "eager"
    model = GptOssForCausalLM(hf).to(TORCH_DTYPES[dtype])
    _load(model, hf_state_dict(config, params), TORCH_DTYPES[dtype])
    return model.eval()


# --- float64 results: the exact side of every parity check (noise.py) -------------------------------

def attention_torch(q, k, v, sinks, q_pos, k_pos, window: int | None, *, dtype=torch.float64, with_lse=False):
    """Attention with sinks by its definition, in torch at `dtype` (float64: the exact side; float32:
    an independent float32 code, the noise): q [B, T, K, G, H], k and v [B, S, K, H], sinks [K, G]
    (None: no sink), positions [B, T] and [B, S] (negative: no key) -> o [B, T, K, G, H] (and lse
    [B, T, K, G] of the keys alone). Tensors given are used as they are (to differentiate)."""
    def tensor(x):
        return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x, np.float64)).to(dtype)

    q, k, v = (tensor(x) for x in (q, k, v))
    qp, kp = (torch.from_numpy(np.array(p))[..., None] for p in (q_pos, k_pos))
    keep = (kp.transpose(-1, -2) <= qp) & (kp.transpose(-1, -2) >= 0)  # [B, T, S]
    if window is not None:
        keep &= kp.transpose(-1, -2) > qp - window
    s = torch.einsum("btkgh,bskh->bkgts", q, k) / np.sqrt(q.shape[-1])
    s = s.masked_fill(~keep[:, None, None], -torch.inf)
    lse = torch.logsumexp(s, dim=-1)  # [B, K, G, T]
    total = lse if sinks is None else torch.logaddexp(lse, tensor(sinks)[None, :, :, None])
    p = torch.exp(s - total[..., None]).nan_to_num(0.0)  # a row with no key and no sink: zeros
    o = torch.einsum("bkgts,bskh->btkgh", p, v)
    return (o, lse.permute(0, 3, 1, 2)) if with_lse else o


def exact_attention(q, k, v, sinks, q_pos, k_pos, window: int | None, *, with_lse: bool = False,
                    precision: str = "float32"):
    """noise.Exact of attention_torch's o (and lse): float64, its `precision` run (float32, or bfloat16
    for 16-bit kernels) as the noise."""
    from noise import Exact

    runs = [attention_torch(q, k, v, sinks, q_pos, k_pos, window, dtype=TORCH_DTYPES[d], with_lse=True)
            for d in (precision, "float64")]
    o, lse = ((low.double().numpy(), r64.numpy()) for low, r64 in zip(*runs, strict=True))
    o = Exact.measure(*o, precision=precision)
    return (o, Exact.measure(*lse, precision=precision)) if with_lse else o  # lse: -inf where no key


def grouped_torch(x, w, sizes, dtype: str) -> np.ndarray:
    """A grouped matmul by its definition in torch at `dtype`: rows x [M, D] in consecutive groups of
    sizes [G] (rows past their sum ignored), w [G, F, D] -> [sum(sizes), F] float64 numpy."""
    dt = TORCH_DTYPES[dtype]
    x, w = t(x, dt), t(w, dt)
    ends = np.cumsum(np.asarray(sizes))
    return torch.cat([x[end - n:end] @ w[g].T for g, (n, end) in enumerate(zip(np.asarray(sizes), ends))]).double().numpy()


def hf_logits(config: ModelConfig, params, tokens, dtype: str) -> np.ndarray:
    """transformers' logits [B, T, V] (float64 numpy) for fresh sequences, no cache."""
    with torch.no_grad():
        out = hf_model(config, params, dtype)(input_ids=torch.from_numpy(np.asarray(tokens)).long()).logits
    return out.double().numpy()


def exact_logits(config: ModelConfig, params, tokens):
    """noise.Exact of the logits: transformers in float64, with its float32 run as the noise."""
    from noise import Exact

    return Exact.measure(hf_logits(config, params, tokens, "float32"), hf_logits(config, params, tokens, "float64"))


def hf_layer_outputs(config: ModelConfig, params, tokens, inputs, dtype: str) -> list[np.ndarray]:
    """transformers' decoder layer i applied to inputs[i] [B, T, D] (in place of its own input, within a
    run on `tokens`, which supplies the masks and rotary tables): each layer's output, float64 numpy."""
    model = hf_model(config, params, dtype)
    outputs = []
    for i, layer in enumerate(model.model.layers):
        given = t(inputs[i], TORCH_DTYPES[dtype])
        hooks = [layer.register_forward_pre_hook(lambda _, args, x=given: (x,) + args[1:]),
                 layer.register_forward_hook(lambda _, __, out: outputs.append(out.double().numpy()))]
        with torch.no_grad():
            model(input_ids=torch.from_numpy(np.asarray(tokens)).long())
        for h in hooks:
            h.remove()
    return outputs


def hf_gradients(config: ModelConfig, params, tokens, mask, dtype: str):
    """transformers' mean next-token loss over the selected tokens (mask [N, T]; HF shifts the labels)
    and its gradient for every parameter by HF name, both as float64 numpy."""
    model = hf_model(config, params, dtype=dtype)
    labels = torch.tensor(np.where(mask, tokens, -100)).long()
    out = model(input_ids=torch.tensor(np.asarray(tokens)).long(), labels=labels)
    out.loss.backward()
    return float(out.loss.detach()), {name: p.grad.double().numpy() for name, p in model.named_parameters()}


def ours_from_hf(config: ModelConfig, named: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """{HF name: tensor} (weights or their gradients) -> {our "/"-joined path: tensor}, by the converter's rules."""
    out = {}
    for rule in formats.rules(config, formats.HF_BF16):
        for target, value in zip(rule.targets, rule.to_ours(*(named[s.name] for s in rule.sources)), strict=True):
            out[target] = value
    return out


def _lora_sites(adapters):
    """(path of the weight, its adapter {"a", "b"}, the merge einsum "a,b->W") of every adapted weight."""
    from gptoss_jax.training.lora import _merge_einsum, _nodes

    for layer, module, name, ab in _nodes(adapters):
        yield f"{layer}/{module}/{name}", ab, _merge_einsum(module, name)


def merge_host(params, adapters, lora, dtype=np.float64):
    """Our params with the adapters folded in, W + scale * a @ b computed in numpy at `dtype` (float64:
    exactly; float32: an independent float32 merge, for the noise of ours)."""
    out = jax.tree.map(lambda x: np.asarray(x, dtype), params)
    for path, ab, spec in _lora_sites(adapters):
        *parents, leaf = path.split("/")
        node = functools.reduce(dict.__getitem__, parents, out)
        delta = dtype(lora.scale) * np.einsum(spec, *(np.asarray(ab[x], dtype) for x in "ab"))
        if leaf in node:
            node[leaf] = node[leaf] + delta
        else:  # q, k or v: a part of the fused attention weight
            fused = node["qkv_weight"].copy()
            G = fused.shape[-2] - 2
            if leaf[0] == "q":
                fused[..., :G, :] += delta.reshape(fused[..., :G, :].shape)
            else:
                fused[..., G if leaf[0] == "k" else G + 1, :] += delta
            node["qkv_weight"] = fused
    return out


def adapter_gradients(weight_grads: dict[str, np.ndarray], adapters, lora):
    """The adapters' gradients from the gradients of the merged weights (our paths), by the chain rule in
    float64: W' = W + s a b gives dL/da = s dL/dW' b^T and dL/db = s a^T dL/dW' (over the einsum's axes)."""
    out = {}
    for path, ab, spec in _lora_sites(adapters):
        a_word, rest = spec.split(",")
        b_word, w_word = rest.split("->")
        a, b = (np.asarray(ab[x], np.float64) for x in "ab")
        layer, module, name = path.split("/")
        g = np.asarray(weight_grads[path] if path in weight_grads else
                       formats.qkv_part(weight_grads[f"{layer}/{module}/qkv_weight"], name), np.float64)
        out[f"{path}/a"] = lora.scale * np.einsum(f"{w_word},{b_word}->{a_word}", g, b)
        out[f"{path}/b"] = lora.scale * np.einsum(f"{a_word},{w_word}->{b_word}", a, g)
    return out


def reference_gradients(config: ModelConfig, params, tokens, mask, dtype: str, lora=None, adapters=None):
    """transformers' mean loss and the gradient of what is trained, by our path ("block_0/attn/qkv_weight",
    or with LoRA "block_0/attn/q_weight/a"), float64 numpy. With adapters: transformers on the weights
    merged exactly (merge_host; rounded to float32 for a float32 run), the chain rule in float64."""
    weights = params if lora is None else merge_host(params, adapters, lora)
    if lora is not None and dtype != "float64":
        weights = jax.tree.map(lambda x: x.astype(np.float32), weights)
    value, grads = hf_gradients(config, weights, np.asarray(tokens), np.asarray(mask), dtype)
    grads = ours_from_hf(config, grads)
    return value, grads if lora is None else adapter_gradients(grads, adapters, lora)


def exact_gradients(config: ModelConfig, params, tokens, mask, *, lora=None, adapters=None, total: bool = False):
    """(noise.Exact of the loss, {our path: noise.Exact of its gradient}): reference_gradients in float64,
    its float32 run as the noise. total=True: of the loss summed over the selected tokens (what
    gptoss_jax.training.step.gradients returns) rather than their mean."""
    from noise import Exact, scalar

    n = float(np.asarray(mask)[:, 1:].sum()) if total else 1.0
    (l32, g32), (l64, g64) = (reference_gradients(config, params, tokens, mask, d, lora, adapters)
                              for d in ("float32", "float64"))
    return scalar(l32 * n, l64 * n), {k: Exact.measure(g32[k] * n, v * n) for k, v in g64.items()}


def exact_adapted_logits(config: ModelConfig, params, adapters, lora, tokens):
    """noise.Exact of the logits of the base with its adapters: transformers in float64 on the exactly
    merged weights, its float32 run on them rounded to float32 as the noise."""
    from noise import Exact

    merged = merge_host(params, adapters, lora)
    merged32 = jax.tree.map(lambda x: x.astype(np.float32), merged)
    return Exact.measure(hf_logits(config, merged32, tokens, "float32"), hf_logits(config, merged, tokens, "float64"))


def swiglu_torch(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[..., 2F] -> [..., F]: the clamped SwiGLU as transformers writes it (gate = h[..., ::2])."""
    gate, linear = h[..., ::2].clamp(max=limit), h[..., 1::2].clamp(-limit, limit)
    return gate * torch.sigmoid(gate * alpha) * (linear + 1)


def expert_matrices(weight) -> np.ndarray:
    """An expert weight [E, out, in] on the host as float32, a packed one decoded (exactly)."""
    from gptoss_jax.mxfp4 import decode_mxfp4, packed

    if packed(weight):
        return decode_mxfp4(np.asarray(weight.blocks), np.asarray(weight.scales), "float32")
    return host(weight)


def experts_torch(config: ModelConfig, mlp, x, idx, weights, dtype: str) -> np.ndarray:
    """The experts by their definition in torch at `dtype` (float64: the exact side; float32 or
    bfloat16: an independent low-precision code, the noise): our MLP parameters `mlp` (experts
    decoded or packed), x [N, D] the normed input, a given routing idx [N, A] and weights [N, A] ->
    sum_a weights[n, a] * expert idx[n, a] (x[n]), [N, D] float64 numpy."""
    dt = TORCH_DTYPES[dtype]
    idx, x, weights = np.asarray(idx), t(x, dt), t(weights, dt)
    out = torch.zeros(x.shape, dtype=dt)
    for name in ("mlp1_weight", "mlp2_weight"):
        mlp = {**mlp, name: t(expert_matrices(mlp[name]), dt)}
    for e in np.unique(idx):  # expert by expert, as transformers' eager experts
        n, a = (torch.from_numpy(i) for i in np.nonzero(idx == e))
        h = x[n] @ mlp["mlp1_weight"][e].T + t(mlp["mlp1_bias"][e], dt)
        y = swiglu_torch(h, config.swiglu_alpha, config.swiglu_limit) @ mlp["mlp2_weight"][e].T + t(mlp["mlp2_bias"][e], dt)
        out.index_add_(0, n, y * weights[n, a, None])
    return out.double().numpy()


def exact_experts(config: ModelConfig, mlp, x, idx, weights, *, precision: str = "float32"):
    """noise.Exact of experts_torch: float64, its `precision` run as the noise."""
    from noise import Exact

    runs = (experts_torch(config, mlp, x, idx, weights, d) for d in (precision, "float64"))
    return Exact.measure(*runs, precision=precision)


def exact_moe_block(config: ModelConfig, mlp, x, *, precision: str = "float32"):
    """noise.Exact of an MLPBlock's output [N, D] on x [B, T, D], for the experts our router picks.

    The norm and the routing are ours (gptoss_jax's RMSNorm and route, each checked against both
    references in test_layers.py and test_moe.py), so that a check of expert kernels does not hinge
    on a near-tie a low-precision reference resolves otherwise; the experts are experts_torch's."""
    from gptoss_jax.model.layers import RMSNorm
    from gptoss_jax.model.moe import route

    normed = RMSNorm(config).apply({"params": mlp["norm"]}, x).reshape(-1, x.shape[-1])  # x's dtype, as the block
    weights, idx = route(normed, mlp["router_weight"], mlp["router_bias"], config.experts_per_token)
    return exact_experts(config, mlp, normed, idx, weights, precision=precision)


def log_softmax(x) -> np.ndarray:
    """log softmax over the last axis, in float64 (log-probabilities from logits)."""
    x = np.asarray(x, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


# --- peft's LoRA adapters on transformers' model (tests/test_adapter_files.py, the served adapters) ---

# Every target peft takes on GptOssForCausalLM: the attention's Linear modules, and the router and
# the experts as parameters (peft's target_parameters).
PEFT_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
PEFT_PARAMETERS = ["mlp.router.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def peft_trained(config, params, folder: str, *, rank: int, rslora: bool, parameters=PEFT_PARAMETERS, steps: int = 3):
    """A peft LoRA adapter on transformers' model of `params`, trained `steps` steps of SGD on random
    tokens (so that lora_B is not zero), saved in `folder`."""
    from peft import LoraConfig as PeftLora, get_peft_model

    torch.manual_seed(1)
    model = get_peft_model(hf_model(config, params, "float32"),
                           PeftLora(r=rank, lora_alpha=2 * rank, target_modules=PEFT_MODULES,
                                    target_parameters=list(parameters) or None, use_rslora=rslora))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    tokens = torch.from_numpy(np.random.default_rng(3).integers(0, config.vocab_size, (2, 16))).long()
    for _ in range(steps):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(folder)
    return folder


def peft_runs(config, params, folder: str, tokens) -> list[np.ndarray]:
    """peft's model over transformers', with the adapter in `folder`: its logits in float32 and in
    float64 (numpy float64)."""
    from peft import PeftModel

    runs = []
    for dtype in ("float32", "float64"):
        model = PeftModel.from_pretrained(hf_model(config, params, dtype), folder).eval()
        with torch.no_grad():
            runs.append(model(input_ids=torch.from_numpy(np.asarray(tokens)).long()).logits.double().numpy())
    return runs


def peft_logits(config, params, folder: str, tokens):
    """noise.Exact of peft's logits: float64, its float32 run the noise (`peft_runs`)."""
    from noise import Exact

    return Exact.measure(*peft_runs(config, params, folder, tokens))
