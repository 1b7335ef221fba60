"""EAGLE-3 heads for the tests: the reference layer from Hugging Face transformers' Llama pieces, as
SGLang's and vLLM's `LlamaForCausalLMEagle3` wire it, and a writer of its published layout
(safetensors and config.json, as SpecForge exports them)."""

from __future__ import annotations

import json

import numpy as np
import torch
from safetensors.numpy import save_file

D, F, N, K, H, U = 64, 96, 4, 2, 16, 50  # a tiny head: hidden, MLP, heads, KV heads, head dim, draft vocab


class Reference(torch.nn.Module):
    """The EAGLE-3 layer from transformers' Llama pieces, q/k/v taking the 2D-wide input."""

    def __init__(self, norm_before_fc: bool):
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

        super().__init__()
        c = LlamaConfig(hidden_size=D, intermediate_size=F, num_attention_heads=N, num_key_value_heads=K, head_dim=H,
                        rms_norm_eps=1e-5, rope_theta=10000.0, vocab_size=300, max_position_embeddings=4096)
        c._attn_implementation = "eager"
        self.fc = torch.nn.Linear(3 * D, D, bias=False)
        self.input_norm = LlamaRMSNorm(3 * D, eps=1e-5) if norm_before_fc else None
        self.embed_norm, self.hidden_norm = LlamaRMSNorm(D, eps=1e-5), LlamaRMSNorm(D, eps=1e-5)
        self.attn = LlamaAttention(c, layer_idx=0)
        for name, out in (("q_proj", N * H), ("k_proj", K * H), ("v_proj", K * H)):
            setattr(self.attn, name, torch.nn.Linear(2 * D, out, bias=False))
        self.post_norm, self.norm = LlamaRMSNorm(D, eps=1e-5), LlamaRMSNorm(D, eps=1e-5)
        self.mlp, self.lm_head, self.rotary = LlamaMLP(c), torch.nn.Linear(D, U, bias=False), LlamaRotaryEmbedding(c)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 2 else 0.2) + (1.0 if p.ndim == 1 else 0.0))

    def forward(self, embedded, states):
        h = self.fc(self.input_norm(states) if self.input_norm is not None else states)
        x = torch.cat([self.embed_norm(embedded), self.hidden_norm(h)], dim=-1)
        T = x.shape[1]
        positions = torch.arange(T)[None]
        mask = torch.full((T, T), float("-inf"), dtype=x.dtype).triu(1)[None, None]
        a, _ = self.attn(x, position_embeddings=self.rotary(x, positions), attention_mask=mask)
        r = a + h
        y = r + self.mlp(self.post_norm(r))
        return self.lm_head(self.norm(y)), y

    def published(self) -> dict[str, np.ndarray]:
        """The tensors under the names SpecForge exports."""
        names = {"fc": "fc", "embed_norm": "midlayer.input_layernorm", "hidden_norm": "midlayer.hidden_norm",
                 "attn": "midlayer.self_attn", "post_norm": "midlayer.post_attention_layernorm",
                 "mlp": "midlayer.mlp", "norm": "norm", "lm_head": "lm_head", "input_norm": "input_norm"}
        out = {}
        for name, p in self.state_dict().items():
            head, _, rest = name.partition(".")
            if head != "rotary":
                out[f"{names[head]}.{rest}"] = p.detach().numpy().astype(np.float32)
        return out


def write_head(folder, reference: Reference, hot: np.ndarray, *, config_extra=None, tensors_extra=None, drop=(),
               vocab: int = 300, layer_ids=(1, 3, 5)):
    """The head's tensors and config.json as published (hot [U]: the target ids of its tokens), for a
    target of hidden size D and vocabulary `vocab` whose outputs of layers `layer_ids` (from 1) it reads."""
    tensors = {**reference.published(), "d2t": (hot - np.arange(U)).astype(np.int64),
               "t2d": np.isin(np.arange(vocab), hot), **(tensors_extra or {})}
    for name in drop:
        tensors.pop(name)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": D, "intermediate_size": F,
              "num_attention_heads": N, "num_key_value_heads": K, "head_dim": H, "rms_norm_eps": 1e-5,
              "vocab_size": vocab, "draft_vocab_size": U,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)},
              **(config_extra or {})}
    (folder / "config.json").write_text(json.dumps(config))
