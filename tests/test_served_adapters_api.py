"""LoRA adapters served by gptoss-serve (`--lora NAME=PATH`, server/adapters.py), through the openai
client: adapters trained by peft on transformers' model of the demo weights give peft's own model's
log-probabilities in float64 within its float32 noise, concurrently with each other and the base; an
adapter loaded while serving, used, and unloaded while a stream runs under it (the stream completes,
the next request gets 404); a folder we cannot serve refused in one message naming the file and the
field, at start-up and when loaded."""

from __future__ import annotations

import json
import os
import shutil
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import jax.numpy as jnp
import numpy as np
import openai
import pytest
from conftest import VOCAB, needs_vocab
from test_serve_command import MODEL, Process, ended, serve

import gptoss_jax as gj
from gptoss_jax import tokenizer as tk
from gptoss_jax.testing import random_params
from refs import hf_logits, log_softmax, peft_runs, peft_trained


@pytest.fixture(scope="module")
def demo():
    config = gj.ModelConfig.demo()
    return config, random_params(config, seed=0, dtype=jnp.float32)  # gptoss-serve's demo weights (--dtype float32)


@pytest.fixture(scope="module")
def folders(demo, tmp_path_factory):
    """Two adapters trained by peft on the demo model: "tuned" (rank 4, rsLoRA, attention, router and
    experts) and "small" (rank 2, attention only)."""
    config, params = demo
    root = tmp_path_factory.mktemp("adapters")
    return {"tuned": peft_trained(config, params, str(root / "tuned"), rank=4, rslora=True),
            "small": peft_trained(config, params, str(root / "small"), rank=2, rslora=False, parameters=())}


@pytest.fixture(scope="module")
def server(folders):
    process = serve("--dtype", "float32", "--slots", "4", "--lora", f"tuned={folders['tuned']}",
                    "--lora", f"small={folders['small']}", "--max-loras", "3")
    try:
        base = process.ready()
        yield base, process
    finally:
        process.stop()
        process.close()


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def _post(base: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@needs_vocab
@pytest.mark.slow
def test_adapters_and_the_base_concurrently_give_peft_models_logprobs(server, demo, folders):
    """Greedy chat replies under "tuned", "small", the base and "tuned" again at once (logprobs): each
    token's log-probability is peft's model's (transformers' alone for the base) float64 log-softmax,
    within its float32 run's noise; the adapters move it beyond that noise. /v1/models lists both
    adapters with the base as their parent; /metrics counts requests by model."""
    from noise import Exact

    from gptoss_jax.server import protocol
    from gptoss_jax.server.harmony import chat_prompt

    base, _ = server
    config, params = demo
    client = _client(base)
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt = chat_prompt(protocol.ChatCompletionRequest(model=MODEL, messages=messages), VOCAB, 128).tokens
    names = ["tuned", "small", MODEL, "tuned"]

    def ask(name):
        return client.chat.completions.create(model=name, messages=messages, max_tokens=5, temperature=0, logprobs=True)

    with ThreadPoolExecutor(len(names)) as pool:
        replies = list(pool.map(ask, names))
    tokenizer = tk.load_tokenizer(VOCAB)
    got = {}
    for name, reply in zip(names[:3], replies):
        assert reply.model == name
        content = reply.choices[0].logprobs.content
        ids = [tokenizer.encode_single_token(bytes(e.bytes)) for e in content]
        seq = np.array([prompt + ids[:-1]], np.int32)
        rows = slice(len(prompt) - 1, None)
        if name == MODEL:
            runs = [hf_logits(config, params, seq, dtype)[0, rows] for dtype in ("float32", "float64")]
        else:
            runs = [r[0, rows] for r in peft_runs(config, params, folders[name], seq)]
        exact = Exact.measure(*[log_softmax(r) for r in runs])
        exact[np.arange(len(ids)), ids].check([e.logprob for e in content], f"{name}: chosen")
        got[name] = (ids, exact)
    same = [e.logprob for e in replies[3].choices[0].logprobs.content]
    assert same == [e.logprob for e in replies[0].choices[0].logprobs.content]  # batched with others or not
    ids, exact = got[MODEL]
    tuned_ids, tuned = got["tuned"]
    if tuned_ids[:1] == ids[:1]:  # the first step's log-probabilities differ beyond the noise
        assert abs(tuned.value[0, ids[0]] - exact.value[0, ids[0]]) > 100 * max(exact.noise, tuned.noise)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL, "tuned", "small"}
    assert models["tuned"].model_extra["parent"] == MODEL and models["small"].model_extra["parent"] == MODEL
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    assert 'gptoss_model_requests_total{model="tuned"} 2.0' in text, text


@needs_vocab
@pytest.mark.slow
def test_an_adapter_loaded_while_serving_is_unloaded_once_its_stream_completes(server, folders, tmp_path):
    """/v1/load_lora_adapter takes a folder (a copy of "small") under a new name: requests under it
    run; its unload, sent while a stream runs under it, returns once that stream has completed (all
    its tokens), and the next request under the name gets 404 (openai.NotFoundError); the entry is
    free again (loaded once more under another name); a fourth adapter finds no free entry (400)."""
    base, _ = server
    client = _client(base)
    folder = str(tmp_path / "copy")
    shutil.copytree(folders["small"], folder)
    status, body = _post(base, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": folder})
    assert status == 200 and body["parent"] == MODEL, body
    assert client.completions.create(model="late", prompt=[1, 2, 3], max_tokens=3, temperature=0).model == "late"
    status, body = _post(base, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": folder})
    assert status == 400 and "already served" in body["error"]["message"], body

    first, order = threading.Event(), []

    def stream():
        tokens = 0
        for chunk in client.completions.create(model="late", prompt=[5, 6, 7], max_tokens=120, temperature=0,
                                               stream=True, stream_options={"include_usage": True}):
            first.set()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        order.append(("stream ended", tokens))

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(120)
    order.append(("unload sent", None))
    status, body = _post(base, "/v1/unload_lora_adapter", {"lora_name": "late"})
    order.append(("unloaded", status))
    reader.join(120)
    # The unload, sent while the stream ran (120 tokens of the demo model take seconds), returned after it ended whole.
    assert order == [("unload sent", None), ("stream ended", 120), ("unloaded", 200)], order
    with pytest.raises(openai.NotFoundError, match="late"):
        client.completions.create(model="late", prompt=[1, 2, 3], max_tokens=3)
    status, body = _post(base, "/v1/load_lora_adapter", {"lora_name": "again", "lora_path": folder})
    assert status == 200, body
    status, body = _post(base, "/v1/load_lora_adapter", {"lora_name": "more", "lora_path": folder})
    assert status == 400 and body["error"]["code"] == "lora_capacity_reached", body
    assert _post(base, "/v1/unload_lora_adapter", {"lora_name": "again"})[0] == 200


@needs_vocab
@pytest.mark.slow
def test_a_folder_we_cannot_serve_is_one_message_naming_the_file_and_field(server, folders, tmp_path):
    """A DoRA adapter: loaded while serving, a 400 whose message names its adapter_config.json and the
    field; given at start-up, gptoss-serve exits 2 with that message on one line, before the model
    loads."""
    base, _ = server
    folder = str(tmp_path / "dora")
    shutil.copytree(folders["small"], folder)
    path = os.path.join(folder, "adapter_config.json")
    with open(path) as f:
        settings = json.load(f)
    with open(path, "w") as f:
        json.dump(dict(settings, use_dora=True), f)
    status, body = _post(base, "/v1/load_lora_adapter", {"lora_name": "dora", "lora_path": folder})
    assert status == 400 and body["error"]["message"].startswith(f"{path}: field use_dora = true"), body
    assert body["error"]["param"] == "lora_path"
    process = Process("--port", "0", "--lora", f"dora={folder}")
    assert ended(process, 120) == 2
    errors = [line for line in process.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and path in errors[0] and "use_dora" in errors[0], process.stderr


def test_an_unload_waits_for_the_requests_holding_its_adapter():
    """ServedAdapters alone: an unload begun while two requests hold the adapter refuses new ones at
    once (404) and is done only when the second of them is released; its entry is then free to take."""
    from gptoss_jax.server.adapters import Named, ServedAdapters
    from gptoss_jax.server.errors import APIError

    served = ServedAdapters("base", 2, 8, ("attention",))
    served.names["a"] = Named(1, "/a", 0)
    assert served.hold("a") == 1 and served.hold("a") == 1 and served.hold("base") is None
    drained = served.unloading("a")
    with pytest.raises(APIError, match="does not exist") as e:
        served.hold("a")
    assert e.value.status == 404
    with pytest.raises(APIError, match="no adapter named 'a' is loaded"):
        served.unloading("a")  # (already being unloaded)
    served.release("a")
    assert not drained.is_set()
    served.release("a")
    assert drained.is_set()
    del served.names["a"]
    assert served.free_entry("b") == 0 and served.free_entry("c") == 1


@pytest.mark.parametrize("argv, message", [
    (["--lora", "nopath"], "--lora 'nopath': give NAME=PATH"),
    (["--lora", "a=x", "--lora", "a=y"], "the name 'a' is given twice"),
    (["--lora", "a=x", "--max-loras", "0"], "--max-loras must be at least the number of --lora (1), got 0"),
    (["--lora-targets", "attention,mlp"], "--lora-targets: mlp; choose from attention, router, experts"),
])
def test_gptoss_serve_lora_flags_are_checked_before_anything_loads(argv, message):
    from gptoss_jax.cli.inputs import UsageError
    from gptoss_jax.server import cli, lora_flags

    from gptoss_jax.training.lora import TARGETS

    assert lora_flags.GROUPS == tuple(TARGETS)  # (written out there so that the flags are checked before JAX loads)
    args = cli.build_parser().parse_args(argv)
    with pytest.raises(UsageError) as e:
        lora_flags.check_flags(args)
    assert message in str(e.value), str(e.value)
