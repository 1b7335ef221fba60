"""The serving engine's compiled programs on a GPU, at gpt-oss-20b's size: `pytest -m gpu
tests/test_gpu_serving.py` on a machine with an NVIDIA Hopper GPU (H100 or H200, where "auto" picks
the Hopper kernels; tokamax installed: pip install -e ".[cuda]").

Deselected by default (pyproject's addopts); on a machine without a GPU these tests fail rather than
pass vacuously.
"""

import math
import re

import jax
import pytest

import gptoss_jax as gj
import gptoss_jax.serving.speculation as speculation
from gptoss_jax.serving import Engine, EngineConfig
from gptoss_jax.drafts.prompt_lookup import PromptLookup
from gptoss_jax.testing import random_params_on_device

pytestmark = pytest.mark.gpu

PAGES = 2000


@pytest.fixture(scope="module", autouse=True)
def _on_gpu():
    assert jax.default_backend() == "gpu", "these tests need an NVIDIA GPU"


def test_checked_steps_on_the_device_update_the_pool_in_place(monkeypatch):
    """The engine's device-drafted calls (a loop over checked steps, a branch per step) write each
    storage of the pool in place. Without the order attention.py imposes (its write after its read),
    XLA copied every storage before writing it, in each step: 48 copies of a storage in this program
    on one NVIDIA H200 with the oracle as the draft (24 storages, two branches), the whole pool a step."""
    config = gj.ModelConfig.preset("gpt-oss-20b")
    params = random_params_on_device(config, seed=0, dtype="mxfp4")
    engine = Engine(config, params,
                    EngineConfig(slots=1, max_len=2048, prefill_chunk=512, page_size=64, pages=PAGES, decode_sizes=(1,),
                                 speculate_steps=4),
                    draft=PromptLookup())
    checked_steps, calls = speculation.checked_steps, []

    def spy(*args):  # (the shapes of its arguments: the pool and the history are donated)
        calls.append(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                                  if isinstance(x, jax.Array) else x, args))
        return checked_steps(*args)

    monkeypatch.setattr(speculation, "checked_steps", spy)
    engine.warm_up()
    assert calls, "warm-up compiled no device-drafted steps"
    text = checked_steps.lower(*calls[0]).compile().as_text()
    size = PAGES * 64 * config.num_key_value_heads * config.head_dim  # a storage's values, in any shape

    def of_a_storage(shapes: str) -> bool:
        return any(math.prod(map(int, dims.split(","))) == size for dims in re.findall(r"bf16\[([\d,]+)\]", shapes))

    assert of_a_storage(text), "the pool's storages are not in the program"
    copies = [line.strip()[:160] for line in text.splitlines()
              if (m := re.search(r"= (.*?) copy(-start)?\(", line)) and of_a_storage(m.group(1))]
    assert not copies, f"{len(copies)} copies of a pool storage, e.g. {copies[0]}"
