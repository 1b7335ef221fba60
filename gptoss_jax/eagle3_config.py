"""An EAGLE-3 draft head's shape and the target layers it reads (eagle3.py has the head), read from a
published config.json. No JAX here: the command line checks a head against its model before anything
loads.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """A head's shape (the published gpt-oss heads' by default) and the target layers it reads."""

    hidden_size: int = 2880
    intermediate_size: int = 17280
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    vocab_size: int = 201088  # the target's
    draft_vocab_size: int = 32000
    target_hidden_size: int = 2880
    aux_layers: tuple[int, ...] = (1, 11, 21)  # the target layers whose outputs it reads, 0-indexed
    norm_before_fc: bool = False  # an RMSNorm over the captured states before fc

    def axis_sizes(self) -> dict[str, int]:
        return {"embed": self.hidden_size, "draft_in": 2 * self.hidden_size,
                "aux_embed": len(self.aux_layers) * self.target_hidden_size, "q_heads": self.num_attention_heads,
                "kv_heads": self.num_key_value_heads, "head_dim": self.head_dim, "mlp": self.intermediate_size,
                "draft_vocab": self.draft_vocab_size}

    @classmethod
    def from_json(cls, data: dict, target_layers: int, source: str = "config.json") -> "Eagle3Config":
        """A published head's config.json (SpecForge's and SGLang's layout, or vLLM speculators' with
        `transformer_layer_config`), for a target of `target_layers` layers.

        The layer ids (`eagle_aux_hidden_state_layer_ids`, under `eagle_config` as SGLang reads it,
        or at the top level as vLLM's speculators format has it) are read as SGLang's gpt-oss and
        Llama models read them: id k takes the output of layer k, counted from 0 (the residual
        stream before layer k + 1; SpecForge's gpt-oss-20b heads: [1, 11, 21]). With none given,
        SGLang's default takes the stream before layers 2, L // 2 and L - 3, i.e. the outputs of
        layers 1, L // 2 - 1 and L - 4."""
        layer = data.get("transformer_layer_config", data)
        eagle = data.get("eagle_config") or {}
        for unsupported in ("fc_norm", "norm_output"):
            if data.get(unsupported) or eagle.get(unsupported):
                raise ValueError(f"{source}: {unsupported} (EAGLE-3.1 heads) is not supported")
        if eagle.get("use_aux_hidden_state") is False:
            raise ValueError(f"{source}: a head reading the target's last hidden state alone "
                             f"(use_aux_hidden_state: false) is not supported")
        if data.get("draft_vocab_size") is None:
            raise ValueError(f"{source}: draft_vocab_size is null (a head that uses the target's own lm_head) "
                             f"is not supported")
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") or data.get("eagle_aux_hidden_state_layer_ids")
        if ids is None:
            layers = (1, target_layers // 2 - 1, target_layers - 4)
        else:
            layers = tuple(int(i) for i in ids)
        if sorted(layers) != list(layers) or not all(0 <= i < target_layers for i in layers):
            raise ValueError(f"{source}: eagle_aux_hidden_state_layer_ids {ids} name layers {list(layers)}, not "
                             f"ascending layers of a {target_layers}-layer target")
        hidden = int(layer["hidden_size"])
        heads = int(layer["num_attention_heads"])
        return cls(hidden_size=hidden, intermediate_size=int(layer["intermediate_size"]), num_attention_heads=heads,
                   num_key_value_heads=int(layer.get("num_key_value_heads", heads)),
                   head_dim=int(layer.get("head_dim") or hidden // heads),
                   rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
                   rope_theta=float(layer.get("rope_theta", 10000.0)), vocab_size=int(layer["vocab_size"]),
                   draft_vocab_size=int(data["draft_vocab_size"]),
                   target_hidden_size=int(data.get("target_hidden_size") or hidden), aux_layers=layers,
                   norm_before_fc=bool(data.get("norm_before_fc") or eagle.get("norm_before_fc")))
