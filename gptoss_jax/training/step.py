"""The optimizer and the jitted train step (gradient accumulation inside one call).

What is trained (`trainable`) is float32 whatever the model runs in:
- full fine-tuning: float32 master weights; each step runs the model on a copy cast to the
  compute dtype (bf16 by default; norm scales stay float32, as loaded);
- LoRA: float32 adapters; the frozen base weights stay in the compute dtype and get no gradient.
The optimizer state (AdamW's two moments) is float32 like what it updates.

A step takes tokens and masks [A, B, T]: A micro-batches of B sequences, run one after the other
(a `lax.scan`), their gradients summed. The loss is the mean over every selected token of the A
micro-batches, so the update equals one over the whole batch of A * B sequences.

On a mesh (`StepConfig.mesh`; placement.py says where each array lives) the step is the same
program, laid out by XLA: each data-parallel group runs its share of the B sequences, what is
trained and the optimizer state stay split over `data` between steps and are gathered for the
model, and the gradients are summed over the groups as they are split back.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from ..config import ModelConfig
from ..kernels import Kernels
from ..sharding import replicated
from ..weight import Params
from . import placement
from .lora import LoraConfig, attach
from .loss import LOGITS_CHUNK, loss_terms


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-4  # peak learning rate
    steps: int = 1000  # the schedule's length
    warmup: int = 0  # steps of linear warm-up from 0 to lr; then cosine decay to lr * final_ratio
    final_ratio: float = 0.1
    weight_decay: float = 0.0  # AdamW's, on matrices only (not biases, norm scales, sinks)
    clip: float = 1.0  # global gradient norm clipping; 0 = none
    b1: float = 0.9
    b2: float = 0.999

    def schedule(self) -> optax.Schedule:
        warmup = min(self.warmup, self.steps)
        if self.steps <= warmup:
            return optax.linear_schedule(0.0, self.lr, max(warmup, 1))
        return optax.warmup_cosine_decay_schedule(0.0, self.lr, warmup_steps=warmup, decay_steps=self.steps,
                                                  end_value=self.lr * self.final_ratio)


def optimizer(opt: OptimizerConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with warm-up and cosine decay."""
    decay_mask = lambda tree: jax.tree.map(lambda x: x.ndim >= 2, tree)  # noqa: E731
    adamw = optax.adamw(opt.schedule(), b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay, mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(opt.clip), adamw) if opt.clip else adamw


def cast_for_compute(params: Params, dtype) -> Params:
    """Float32 master weights as the model runs them: in dtype, norm scales kept float32."""
    def one(path, x):
        return x if str(path[-1].key) == "scale" else x.astype(dtype)

    return jax.tree_util.tree_map_with_path(one, params)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    config: ModelConfig
    lora: LoraConfig | None = None  # None: full fine-tuning
    compute_dtype: str = "bfloat16"
    label_smoothing: float = 0.0
    kernels: Kernels = Kernels()
    remat: bool = True
    chunk: int = LOGITS_CHUNK
    mesh: Mesh | None = None  # the mesh the frozen weights and the train state are laid out on; None: one device

    def model_params(self, trainable: Params, frozen: Params | None) -> Params:
        """What the model runs: the frozen base with the adapters attached, or the cast master weights
        (on a mesh, gathered from their kept layout to the compute layout)."""
        layout = placement.compute_shardings(self.config, self.lora, self.mesh)
        if self.lora is None:
            return _constrain(cast_for_compute(trainable, jnp.dtype(self.compute_dtype)), layout)
        return attach(frozen, _constrain(trainable, layout), self.lora.scale)

    def state_shardings(self, tx: optax.GradientTransformation):
        """(trained tree, optimizer state) shardings between steps; (None, None) without a mesh."""
        return (placement.trainable_shardings(self.config, self.lora, self.mesh),
                placement.opt_state_shardings(tx, self.config, self.lora, self.mesh))


def _constrain(tree, shardings):
    return tree if shardings is None else jax.lax.with_sharding_constraint(tree, shardings)


def gradients(setup: StepConfig, trainable: Params, frozen: Params | None, tokens, mask):
    """(loss sum, selected tokens, gradient of the loss sum) over micro-batches tokens/mask [A, B, T]."""
    def sum_loss(trainable, tokens, mask):
        return loss_terms(setup.config, setup.model_params(trainable, frozen), tokens, mask,
                          label_smoothing=setup.label_smoothing, kernels=setup.kernels, remat=setup.remat,
                          chunk=setup.chunk, mesh=setup.mesh)

    grad_fn = jax.value_and_grad(sum_loss, has_aux=True)

    def micro(carry, xs):
        total, count, grads = carry
        (s, n), g = grad_fn(trainable, *xs)
        return (total + s, count + n, jax.tree.map(jnp.add, grads, g)), None

    zeros = jax.tree.map(jnp.zeros_like, trainable)
    (total, count, grads), _ = jax.lax.scan(micro, (jnp.zeros(()), jnp.zeros(()), zeros), (tokens, mask))
    return total, count, grads


def make_step(setup: StepConfig, tx: optax.GradientTransformation):
    """A jitted step(trainable, opt_state, frozen, tokens [A, B, T], mask [A, B, T]) ->
    (trainable, opt_state, metrics); trainable and opt_state are donated. On a mesh they come back
    in the layout of setup.state_shardings(tx), which is where they should be passed in
    (placement.place)."""
    trainable_layout, opt_layout = setup.state_shardings(tx)
    out_shardings = None if setup.mesh is None else (trainable_layout, opt_layout, replicated(setup.mesh))

    @functools.partial(jax.jit, donate_argnums=(0, 1), out_shardings=out_shardings)
    def step(trainable, opt_state, frozen, tokens, mask):
        total, count, grads = gradients(setup, trainable, frozen, tokens, mask)
        denom = jnp.maximum(count, 1.0)
        grads = _constrain(jax.tree.map(lambda g: g / denom, grads), trainable_layout)
        updates, opt_state = tx.update(grads, opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        metrics = {"loss": total / denom, "tokens": count, "grad_norm": _norm(grads)}
        return trainable, opt_state, metrics

    return step


def _norm(tree) -> jax.Array:
    """The global L2 norm of a pytree (what clipping sees)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def make_eval(setup: StepConfig):
    """A jitted eval(trainable, frozen, tokens [B, T], mask) -> (loss sum, selected tokens)."""

    @jax.jit
    def evaluate(trainable, frozen, tokens, mask):
        return loss_terms(setup.config, setup.model_params(trainable, frozen), tokens, mask,
                          kernels=setup.kernels, chunk=setup.chunk, mesh=setup.mesh)

    return evaluate
