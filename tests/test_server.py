"""The OpenAI-compatible server over the real engine (the demo model: tiny, the genuine vocabulary,
float32, random weights), through the official openai client: the same greedy text as the command
line, usage counts, disconnects, load, and `gptoss-serve` itself (ready line, SIGTERM)."""

import gc
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import urllib.request
import weakref
from concurrent.futures import ThreadPoolExecutor

import jax.numpy as jnp
import numpy as np
import openai
import pytest
from conftest import VOCAB, needs_vocab, until
from server_util import serving_engine

import gptoss_jax as gj
import run_inference
from gptoss_jax import tokenizer as tk
from gptoss_jax.sampling import Sampling
from gptoss_jax.serving import Engine, EngineConfig, Settings
from gptoss_jax.testing import random_params

pytestmark = [needs_vocab, pytest.mark.optimized]  # many steps of the demo model: tests/conftest.py
MODEL = "gpt-oss-demo"
MAX_LEN = 256


@pytest.fixture(scope="module")
def engine():
    config = gj.ModelConfig.demo()
    params = random_params(config, seed=0, dtype=jnp.float32)  # what the command line runs for the demo
    engine = Engine(config, params,
                    EngineConfig(slots=8, max_len=MAX_LEN, prefill_chunk=64, prefill_rows=4, max_waiting=256),
                    tokenizer=tk.load_tokenizer(VOCAB))
    engine.warm_up()
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def url(engine):
    with serving_engine(engine, MODEL) as base:
        yield base


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0)


def cli_json(capsys, argv) -> dict:
    """The command line's --json record for one prompt (greedy, the demo model)."""
    capsys.readouterr()
    assert run_inference.main(argv + ["--tokenizer", VOCAB, "--temperature", "0", "--json", "--max-context",
                                      str(MAX_LEN)]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.slow
def test_chat_is_the_command_lines_greedy_text(client, capsys):
    record = cli_json(capsys, ["--chat", "--prompt", "What is JAX?", "--system", "Be brief.", "--reasoning-effort",
                               "low", "--max-new-tokens", "12"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is JAX?"}]
    kw = dict(model=MODEL, messages=messages, temperature=0, max_tokens=12, reasoning_effort="low")
    r = client.chat.completions.create(**kw)
    # A random model's reply is no harmony: the content is its raw text, as the command line shows it.
    assert r.choices[0].message.content == record["text"]
    assert r.usage.prompt_tokens == len(record["prompt_ids"])
    assert r.usage.completion_tokens == len(record["output_ids"]) == 12
    assert r.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == record["text"]
    assert chunks[-1].usage.completion_tokens == 12


@pytest.mark.slow
def test_completions_and_responses(client, capsys):
    record = cli_json(capsys, ["--prompt", "The capital of France is", "--max-new-tokens", "10"])
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=10, temperature=0)
    assert r.choices[0].text == record["text"] and r.usage.completion_tokens == 10
    ids = client.completions.create(model=MODEL, prompt=record["prompt_ids"], max_tokens=10, temperature=0)
    assert ids.choices[0].text == record["text"]
    streamed = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=10,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == record["text"]

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                          max_tokens=9)
    resp = client.responses.create(model=MODEL, input="Hi", temperature=0, max_output_tokens=9)
    assert resp.output_text == chat.choices[0].message.content and resp.status == "incomplete"
    assert resp.usage.input_tokens == chat.usage.prompt_tokens and resp.usage.output_tokens == 9
    events = list(client.responses.create(model=MODEL, input="Hi", temperature=0, max_output_tokens=9, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == resp.output_text


@pytest.mark.slow
def test_seeded_sampling_repeats(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=1.0, top_p=0.9)
    a, b = (client.chat.completions.create(**kw, seed=7).choices[0].message.content for _ in range(2))
    c = client.chat.completions.create(**kw, seed=8).choices[0].message.content
    assert a == b != c


@pytest.mark.slow
def test_a_shared_prefix_is_reported_as_cached(client, engine):
    """Two chats one after the other with the same long system message (a text no other test sends):
    the first finds nothing cached, the second the whole pages of its prefix, counted in
    usage.prompt_tokens_details.cached_tokens (streamed: in the usage chunk); the same for the
    Responses API's usage.input_tokens_details.cached_tokens, and completions."""
    page = engine.page_size

    def chat(system, question, **kw):
        return client.chat.completions.create(model=MODEL, temperature=0, max_tokens=4, **kw, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}])

    system = "You answer questions about the tides of the northern sea, in two sentences at most. " * 6
    first = chat(system, "When is the next high tide?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = chat(system, "How high will it be?")
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert page <= cached < second.usage.prompt_tokens and cached % page == 0, cached
    chunks = list(chat(system, "And the low tide?", stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached

    instructions = "You name the lighthouses along a coast, one a line, nothing more. " * 6
    first = client.responses.create(model=MODEL, instructions=instructions, input="The west coast?", temperature=0,
                                    max_output_tokens=4)
    assert first.usage.input_tokens_details.cached_tokens == 0
    second = client.responses.create(model=MODEL, instructions=instructions, input="The east coast?", temperature=0,
                                     max_output_tokens=4)
    cached = second.usage.input_tokens_details.cached_tokens
    assert page <= cached < second.usage.input_tokens and cached % page == 0, cached
    events = list(client.responses.create(model=MODEL, instructions=instructions, input="The north coast?",
                                          temperature=0, max_output_tokens=4, stream=True))
    assert events[-1].response.usage.input_tokens_details.cached_tokens == cached

    prompt = list(range(1000, 1000 + 2 * page + 5))
    counts = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
              .usage.prompt_tokens_details.cached_tokens for _ in range(2)]
    assert counts == [0, 2 * page]


def wait_idle(engine, timeout=60.0) -> dict:
    """-> the engine's stats once no request runs or waits."""
    def idle():
        stats = engine.stats()
        return None if stats["slots_in_use"] or stats["waiting"] else stats

    return until(idle, "the engine is idle", timeout, every=0.02)


@pytest.mark.slow
def test_a_client_gone_mid_stream_frees_its_slot(client, engine):
    cancelled = engine.stats()["finished"].get("cancelled", 0)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=MAX_LEN - 100, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    stats = wait_idle(engine)
    assert stats["finished"].get("cancelled", 0) == cancelled + 1
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert r.usage.completion_tokens == 3


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) / 1024


@pytest.mark.slow
def test_load_64_streaming_clients_with_disconnects(client, engine):
    """500 streamed requests, 64 at a time, a quarter of the clients leaving mid-stream: every
    finished stream is whole and is the request's greedy reply; no slot stays taken; nothing piles
    up (no request object outlives its reply, and memory stops growing)."""
    prompts = [f"Question {i}: what is {i} + {i}?" for i in range(8)]
    reference = {}
    for p in prompts:
        for n in (4, 12, 24):
            r = client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0).choices[0]
            reference[p, n] = r.text, r.finish_reason
    requests = weakref.WeakSet()
    original_submit = engine.submit

    def tracked_submit(*args, **kw):
        request = original_submit(*args, **kw)
        requests.add(request)
        return request

    engine.submit = tracked_submit
    rng = random.Random(0)
    plan = [(rng.choice(prompts), rng.choice([4, 12, 24]), rng.random() < 0.25) for _ in range(500)]

    def one(job):
        prompt, n, leave = job
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True)
        text, finish = "", None
        for i, chunk in enumerate(stream):
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
            if leave and i == 1:
                stream.close()
                return None
        return prompt, n, text, finish

    try:
        with ThreadPoolExecutor(64) as pool:
            first = list(pool.map(one, plan[:250]))
            wait_idle(engine)
            gc.collect()
            middle = rss_mib()
            second = list(pool.map(one, plan[250:]))
    finally:
        engine.submit = original_submit
    wait_idle(engine)
    done = [r for r in first + second if r is not None]
    assert len(done) > 300
    for prompt, n, text, finish in done:  # whole, and the request's greedy reply
        assert (text, finish) == reference[prompt, n], (prompt, n)
    gc.collect()
    assert len(requests) == 0  # the server and the engine keep no finished request
    assert rss_mib() - middle < 64, (middle, rss_mib())


@pytest.mark.slow
def test_metrics_are_prometheus_text(url, client, engine):
    prompt = list(range(2000, 2000 + engine.page_size + 5))  # the second finds a page cached
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=3)
    with urllib.request.urlopen(url[:-len("/v1")] + "/metrics", timeout=10) as r:
        text = r.read().decode()
    stats = engine.stats()
    samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    assert samples["gptoss_kv_slots"] == stats["slots"] == 8
    assert samples["gptoss_kv_slots_in_use"] == samples["gptoss_running_requests"] == 0
    assert samples["gptoss_kv_pages"] == stats["pages"] == engine.scheduler.pages.count
    assert samples["gptoss_kv_pages_in_use"] == stats["pages_in_use"] == 0  # nothing runs: every page free or cached
    assert samples["gptoss_kv_pages_cached"] == stats["pages_cached"] > 0
    assert samples["gptoss_kv_page_size"] == engine.page_size
    assert samples["gptoss_cached_prompt_tokens_total"] == stats["cached_prompt_tokens"] >= engine.page_size
    assert 0 < samples["gptoss_prefix_hit_rate"] == stats["prefix_hit_rate"] < 1
    assert samples["gptoss_preemptions_total"] == stats["preemptions"]
    assert samples["gptoss_kv_pages_evicted_total"] == stats["pages_evicted"]
    assert samples["gptoss_generated_tokens_total"] == stats["generated_tokens"] > 0
    for key in ("draft_tokens", "accepted_draft_tokens", "speculative_steps", "drafting_steps"):
        assert samples[f"gptoss_{key}_total"] == stats[key]
    assert samples['gptoss_finished_requests_total{reason="length"}'] == stats["finished"]["length"]
    assert 'gptoss_inter_token_latency_seconds{quantile="0.5"}' in samples


def readme_client_example() -> str:
    text = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    serving = text[text.index("## Serving"):text.index("## How fast")]
    return serving.split("```python\n")[1].split("```")[0]


@pytest.mark.slow
def test_gptoss_serve_command(tmp_path):
    """The installed command: it says when it is ready (with its URL), answers the README's client
    example as written (on a free port rather than 8000), and on SIGTERM lets a running request
    finish and exits 0."""
    env = {**os.environ, "TIKTOKEN_ENCODINGS_BASE": os.path.dirname(os.path.abspath(VOCAB))}
    process = subprocess.Popen([sys.executable, "-m", "gptoss_jax.server", "--port", "0", "--slots", "2",
                                "--max-context", "128"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = process.stdout.readline()
        assert line.startswith("gptoss-serve: ready at http://127.0.0.1:"), (line, process.stderr.read())
        base = line.split()[3]
        example = readme_client_example()
        assert "http://127.0.0.1:8000/v1" in example
        run = subprocess.run([sys.executable, "-c", example.replace("http://127.0.0.1:8000/v1", base)],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and run.stdout.strip(), run.stderr
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
        box = {}
        stream = client.chat.completions.create(model="gpt-oss-demo", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=60, temperature=0, stream=True)
        first = next(iter(stream))
        reader = threading.Thread(target=lambda: box.setdefault("chunks", list(stream)))
        reader.start()
        process.send_signal(signal.SIGTERM)
        reader.join(60)
        assert process.wait(60) == 0, process.stderr.read()
        assert first.choices[0].delta.role == "assistant"
        assert box["chunks"][-1].choices[0].finish_reason == "length"  # the running request finished
    finally:
        if process.poll() is None:
            process.kill()


# A context of 128 and a KV cache of 20 pages of 16 positions (the float32 demo model's page: 8,192
# bytes): one request of the whole context needs 17 at most. With it the test's requests have short
# prompts (61 to 85 tokens, past the 16-token window) and replies of 34 to 40 (some 7 pages each of
# the two layer groups at their end), so any two running at once run out and the latest is
# preempted, whatever order they arrive in.
SMALL_POOL = ["--max-context", "128", "--page-size", "16", "--kv-memory-gb", str(20 * 8192 / 2**30)]


@pytest.mark.slow
def test_two_processes_serve_as_one(client, tmp_path):
    """`gptoss-serve` over two processes (2 CPU devices each, joined by --coordinator, slots split over
    data=2 and heads over tensor=2): process 0 serves, process 1 follows its steps. Concurrent
    requests, one of them dropped mid-stream while the others run, give the one-process server's
    greedy text, and SIGTERM to process 0 ends both with exit 0. The test fails if process 1 misses a
    step (its collectives would hang, then the requests time out). The pool is too small for
    everything running, so requests are preempted and resumed on both processes alike (counted: more
    than none), beside the dropped one's cancellation (counted: one). (One pair of processes checks
    both: each pair's start compiles every step of the demo model twice over, a minute of a 2-core
    machine.)"""
    from conftest import command_env, free_port

    env = command_env(TIKTOKEN_ENCODINGS_BASE=os.path.dirname(os.path.abspath(VOCAB)), JAX_NUM_CPU_DEVICES="2")
    common = [sys.executable, "-m", "gptoss_jax.server", "--port", "0", "--slots", "4", *SMALL_POOL,
              "--mesh", "data=2,tensor=2", "--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2",
              "--process-id"]
    procs = [subprocess.Popen(common + [str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(2)]
    try:
        line = procs[0].stdout.readline()
        assert line.startswith("gptoss-serve: ready at http://127.0.0.1:"), (line, procs[0].stderr.read())
        two = openai.OpenAI(base_url=line.split()[3], api_key="unused", max_retries=0, timeout=60)
        kws = [dict(model=MODEL, messages=[{"role": "user", "content": "Tell me more. " * (1 + i)}],
                    temperature=0, max_tokens=40 - i)  # replies that outgrow the small pool
               for i in range(7)]

        def ask(kw):
            return two.chat.completions.create(**kw).choices[0].message.content

        dropped = two.chat.completions.create(**dict(kws[0], max_tokens=60), stream=True)
        next(iter(dropped))
        with ThreadPoolExecutor(len(kws)) as pool:
            replies = [pool.submit(ask, kw) for kw in kws]
            dropped.close()  # mid-stream: 59 of its tokens still to come, the others submitted
            got = [r.result() for r in replies]
        want = [client.chat.completions.create(**kw).choices[0].message.content for kw in kws]
        assert got == want
        assert ask(kws[3]) == want[3]  # and after the dropped stream's slot was freed on both processes
        metrics = urllib.request.urlopen(line.split()[3].removesuffix("/v1") + "/metrics", timeout=10).read().decode()
        assert 'gptoss_finished_requests_total{reason="cancelled"} 1.0' in metrics
        preemptions = float(re.search(r"^gptoss_preemptions_total (\S+)$", metrics, re.M).group(1))
        assert preemptions > 0, metrics
        procs[0].send_signal(signal.SIGTERM)
        codes = [p.wait(60) for p in procs]
        assert codes == [0, 0], [p.stderr.read() for p in procs]
        assert procs[1].stdout.read() == ""  # only process 0 speaks
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.mark.slow
def test_logprobs_are_the_models_through_every_api(client, engine):
    """completions (logprobs=3), chat (logprobs, top_logprobs=2) and Responses (include
    message.output_text.logprobs, top_logprobs=2), streamed and not, on the demo model (its random
    replies are raw text: every token is the answer's): each token's log-probability is transformers'
    float64 log-softmax of the model's logits / temperature, within NOISE_FACTOR x its float32 run's
    own error, and the alternatives are the most likely tokens, in order."""
    from noise import Exact
    from refs import hf_logits, log_softmax

    from gptoss_jax.server import protocol
    from gptoss_jax.server.harmony import chat_prompt, responses_prompt

    tokenizer = tk.load_tokenizer(VOCAB)

    def check(prompt: list[int], entries: list[dict], temperature: float, top: int | None, what: str):
        """entries: [{"token_bytes", "logprob", "top": [(bytes, logprob)]}] of the reply's tokens."""
        ids = [tokenizer.encode_single_token(bytes(e["token_bytes"])) for e in entries]
        seq = [prompt + ids[:-1]]
        rows = slice(len(prompt) - 1, None)
        exact = Exact.measure(log_softmax(hf_logits(engine.config, engine.params, seq, "float32")[0, rows] / temperature),
                              log_softmax(hf_logits(engine.config, engine.params, seq, "float64")[0, rows] / temperature))
        steps = np.arange(len(ids))
        exact[steps, ids].check([e["logprob"] for e in entries], f"{what}: chosen")
        if top is None:
            return ids
        alternatives = np.array([[tokenizer.encode_single_token(bytes(b)) for b, _ in e["top"]] for e in entries])
        assert alternatives.shape == (len(ids), top), what
        exact[steps[:, None], alternatives].check([[v for _, v in e["top"]] for e in entries], f"{what}: top")
        assert (alternatives == np.argsort(-exact.value, axis=-1)[:, :top]).all(), what
        return ids

    prompt = tokenizer.encode("The capital of France is")
    kw = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0.8, seed=5, logprobs=3)
    whole = client.completions.create(**kw).choices[0]
    lp = whole.logprobs
    direct = engine.submit(prompt, Settings(max_new_tokens=6, sampling=Sampling(temperature=0.8), seed=5,
                                            stop_ids=tk.STOP_TOKENS))
    ids = direct.result(timeout=60)  # seeded: the tokens the server drew
    check(prompt, [{"token_bytes": tokenizer.decode_single_token_bytes(i), "logprob": v, "top": None}
                   for i, v in zip(ids, lp.token_logprobs)], 0.8, None, "completions")
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6 and lp.text_offset[0] == 0
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)  # 3 tokens (two may read as the same text)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(6)] or "\ufffd" in "".join(lp.tokens)
    streamed = [c.choices[0].logprobs for c in client.completions.create(**kw, stream=True) if c.choices[0].logprobs]
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs

    messages = [{"role": "user", "content": "Hi"}]
    chat_ids = chat_prompt(protocol.ChatCompletionRequest(model=MODEL, messages=messages), VOCAB, MAX_LEN).tokens
    kw = dict(model=MODEL, messages=messages, temperature=0, max_tokens=7, logprobs=True, top_logprobs=2)
    got = client.chat.completions.create(**kw).choices[0].logprobs.content
    as_entries = lambda content: [{"token_bytes": e.bytes, "logprob": e.logprob,  # noqa: E731
                                   "top": [(t.bytes, t.logprob) for t in e.top_logprobs]} for e in content]
    ids = check(chat_ids, as_entries(got), 1.0, 2, "chat")
    assert len(ids) == 7
    chunks = client.chat.completions.create(**kw, stream=True)
    assert [e.logprob for c in chunks for e in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])] \
        == [e.logprob for e in got]

    input_ids = responses_prompt(protocol.ResponsesRequest(model=MODEL, input="Hi"), VOCAB, MAX_LEN).tokens
    kw = dict(model=MODEL, input="Hi", temperature=0.5, extra_body={"seed": 2}, max_output_tokens=5, top_logprobs=2,
              include=["message.output_text.logprobs"])
    r = client.responses.create(**kw)
    content = r.output[-1].content[0].logprobs
    check(input_ids, as_entries(content), 0.5, 2, "responses")
    events = list(client.responses.create(**kw, stream=True))
    assert [e.logprob for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs] \
        == [e.logprob for e in content]
    plain = client.responses.create(model=MODEL, input="Hi", temperature=0.5, extra_body={"seed": 2}, max_output_tokens=5)
    assert plain.output_text == r.output_text and plain.output[-1].content[0].logprobs == []


@pytest.mark.slow
def test_echo_gives_the_prompt_and_its_tokens_log_probabilities(client, engine, monkeypatch):
    """completions with echo: the text is the prompt's, then the completion's. With logprobs=2 the
    prompt's tokens come first: the first with null (nothing predicts it), each other with transformers'
    float64 log-softmax of the model's logits at the position before it, within NOISE_FACTOR x its
    float32 run's own error, and its 2 most likely tokens'. max_tokens=0 scores the prompt alone;
    with new tokens their entries follow, as without echo; streamed the same. A prompt longer than
    the padded length's first class (64) and one shorter both. A reply ended at once by its stop token
    keeps that token's entry (text empty); n=2 echoes in each choice; a prompt past the longest that
    echo scores is a 400 naming echo (its text alone is still echoed)."""
    from noise import Exact
    from refs import hf_logits, log_softmax

    from gptoss_jax.server import app as app_module

    tokenizer = tk.load_tokenizer(VOCAB)
    for prompt in (tokenizer.encode("The capital of France is Paris."),
                   tokenizer.encode("Egypt: \U00013000\U00013050 done."),  # two characters of 4 one-byte tokens
                   np.random.default_rng(4).integers(0, 200_000, 90).tolist()):
        n = len(prompt)
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
        only = r.choices[0]
        assert only.text == tokenizer.decode(prompt) and only.finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n, 0)
        lp = only.logprobs
        assert len(lp.tokens) == n and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        exact = Exact.measure(log_softmax(hf_logits(engine.config, engine.params, [prompt], "float32")[0, :-1]),
                              log_softmax(hf_logits(engine.config, engine.params, [prompt], "float64")[0, :-1]))
        steps = np.arange(n - 1)
        exact[steps, prompt[1:]].check(lp.token_logprobs[1:], "echo: the prompt's tokens")
        best = np.argsort(-exact.value, axis=-1)[:, :2]
        distinct = [i for i, top in enumerate(lp.top_logprobs[1:]) if len(top) == 2]  # two may read the same
        assert len(distinct) > n // 2
        exact[steps[distinct, None], best[distinct]].check(
            [sorted(lp.top_logprobs[1 + i].values(), reverse=True) for i in distinct], "echo: top 2")

        kw = dict(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
        both = client.completions.create(**kw).choices[0]
        plain = client.completions.create(**{**kw, "echo": False}).choices[0]
        assert both.text == only.text + plain.text
        assert both.logprobs.token_logprobs == lp.token_logprobs + plain.logprobs.token_logprobs
        assert both.logprobs.text_offset == lp.text_offset + [len(only.text) + o for o in plain.logprobs.text_offset]
        chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True)]
        assert "".join(c.text for c in chunks) == both.text
        assert sum((c.logprobs.token_logprobs for c in chunks if c.logprobs), []) == both.logprobs.token_logprobs
        # Each token's entry is its own text (a part of a character split over tokens: U+FFFD), and its
        # offset where the text it adds to the prompt's text as streamed starts (a split character
        # goes with its last token).
        decoder = tk.StreamDecoder(tokenizer)
        pieces = [decoder.add(t) for t in prompt]
        assert "".join(pieces) + decoder.flush() == only.text
        assert lp.tokens == [tokenizer.decode_single_token_bytes(t).decode("utf-8", errors="replace") for t in prompt]
        assert lp.text_offset == [len("".join(pieces[:i])) for i in range(n)]
        if "\U00013000" in only.text:  # the split characters: their first tokens add no text yet
            assert pieces != lp.tokens and "\ufffd" in lp.tokens
    # A reply that ends at once (its stop token forced by logit_bias): the stop token's entry is there,
    # its text empty, so that the prompt's entries are all but the last (how harnesses slice them).
    prompt = tokenizer.encode("Hello world")
    stop = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=1,
                                     logit_bias={str(tk.STOP_TOKENS[0]): 100}).choices[0]
    assert stop.finish_reason == "stop" and stop.text == "Hello world"
    assert len(stop.logprobs.tokens) == len(prompt) + 1 and stop.logprobs.tokens[-1] == tokenizer.decode([tk.STOP_TOKENS[0]])
    assert stop.logprobs.text_offset[-1] == len(stop.text)
    echoed = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, echo=True, n=2)
    assert [c.text[:5] for c in echoed.choices] == ["Hello"] * 2 and echoed.choices[0].logprobs is None
    monkeypatch.setattr(app_module, "SCORED_MOST", 8)  # the longest prompt echo scores
    with pytest.raises(openai.BadRequestError, match="at most 8 tokens") as refused:
        client.completions.create(model=MODEL, prompt=list(range(9)), max_tokens=1, echo=True, logprobs=1)
    assert refused.value.body["param"] == "echo"
    assert client.completions.create(model=MODEL, prompt=list(range(9)), max_tokens=1, echo=True).choices
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=0)


@pytest.mark.slow
def test_logit_bias_forces_a_token_through_the_api(client):
    """logit_bias of +100 on one token: every token of the reply is it (completions and chat)."""
    tokenizer = tk.load_tokenizer(VOCAB)
    word = tokenizer.encode(" banana")
    assert len(word) == 1
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=1.0,
                                  logit_bias={str(word[0]): 100})
    assert r.choices[0].text == " banana" * 4
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       logit_bias={str(word[0]): 100})
    assert r.choices[0].message.content == " banana" * 3  # a random model: its raw text


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "member"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                                "maximum": 120},
                         "member": {"type": "boolean"}, "tags": {"type": "array", "maxItems": 2,
                                                                 "items": {"enum": ["a", "b"]}}}}


@pytest.mark.slow
def test_structured_outputs_follow_their_schema_where_the_model_alone_writes_no_json(client):
    """response_format json_schema (chat, whole and streamed) and json_object, and the Responses API's
    text.format: the demo model's random weights write no JSON alone, and with the format every
    answer parses and validates against its schema (the reasoning before it is left free)."""
    import jsonschema

    messages = [{"role": "user", "content": "Who are you?"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=100, temperature=0)
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain.choices[0].message.content)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=100, temperature=1.0,
                                           seed=seed, response_format=fmt)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=100, temperature=0,
                                            response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    done = 0
    for seed in range(4):  # any object: the model may write a string until the budget runs out
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=100, temperature=1.0,
                                           seed=seed, response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
            done += 1
        else:
            assert r.choices[0].message.content.startswith("{")
    assert done >= 2
    r = client.responses.create(model=MODEL, input="Who are you?", max_output_tokens=100, temperature=0,
                                text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)


@pytest.mark.slow
def test_a_strict_tools_arguments_follow_its_parameters(client):
    """Strict function tools: the call's arguments validate against the tool's parameters (a named
    call, and a required one whose tool the model names); without strict, the same call's arguments
    are the model's own (random text)."""
    import jsonschema

    city = {"type": "object", "properties": {"city": {"enum": ["Rome", "Paris", "Oslo"]},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"], "additionalProperties": False}

    def tool(name, strict):
        return {"type": "function", "function": {"name": name, "parameters": city, "strict": strict}}

    messages = [{"role": "user", "content": "Weather?"}]
    for choice in ("required", {"type": "function", "function": {"name": "forecast"}}):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                           tools=[tool("forecast", True), tool("history", True)], tool_choice=choice)
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name in ("forecast", "history")
        jsonschema.validate(json.loads(call.function.arguments), city)
    loose = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                           tools=[tool("forecast", False)], tool_choice="required")
    assert loose.choices[0].message.tool_calls is None or not _valid(loose.choices[0].message.tool_calls[0], city)


def _valid(call, schema) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(call.function.arguments), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


@pytest.mark.slow
def test_penalties_change_greedy_output_in_their_direction(client):
    """A logit bias of +3 on " banana" makes the greedy reply repeat it: a frequency or presence penalty
    of 2 makes it repeat it less; one of -2 makes the reply repeat its own tokens more (counted over
    its tokens); chat's reply changes with them too."""
    word = str(tk.load_tokenizer(VOCAB).encode(" banana")[0])

    def reply(**kw):
        r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=40, temperature=0, logprobs=0,
                                      logit_bias={word: 3}, **kw)
        tokens = r.choices[0].logprobs.tokens
        return r.choices[0].text.count(" banana"), len(tokens) - len(set(tokens))

    (base, repeats) = reply()
    assert 2 < base < 38
    assert reply(frequency_penalty=2.0)[0] < base and reply(presence_penalty=2.0)[0] < base
    assert reply(frequency_penalty=-2.0)[1] > repeats and reply(presence_penalty=-2.0)[1] > repeats
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=40,
                                       temperature=0, frequency_penalty=-2.0)
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=40,
                                           temperature=0)
    assert r.choices[0].message.content != plain.choices[0].message.content  # chat honours them too


@pytest.mark.slow
def test_n_choices_are_the_request_with_each_seed_alone(client):
    """n=3 with a seed: three different choices, numbered 0 to 2, choice i the same request alone with
    seed + i (chat, whole and streamed; completions); usage counts the prompt once and every choice's
    tokens."""
    messages = [{"role": "user", "content": "Tell me a story."}]
    kw = dict(model=MODEL, messages=messages, max_tokens=12, temperature=1.0)
    r = client.chat.completions.create(n=3, seed=41, **kw)
    got = [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(got)) == 3
    alone = [client.chat.completions.create(seed=41 + i, **kw) for i in range(3)]
    assert got == [a.choices[0].message.content for a in alone]
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    streamed = ["", "", ""]
    for c in client.chat.completions.create(n=3, seed=41, stream=True, **kw):
        for choice in c.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == got
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0)
    r = client.completions.create(n=2, seed=-2**31, **kw)  # seed + 1 stays a 32-bit seed
    assert [c.text for c in r.choices] == [client.completions.create(seed=-2**31 + i, **kw).choices[0].text
                                          for i in range(2)]


@pytest.mark.slow
def test_best_of_returns_the_candidates_of_highest_mean_log_probability(client):
    """best_of=4, n=2: the two of the four candidates (seeds seed to seed + 3) whose tokens have the
    highest mean log-probability, best first, without log-probabilities unless asked for."""
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0)
    candidates = [client.completions.create(seed=7 + i, logprobs=0, **kw).choices[0] for i in range(4)]
    means = [np.mean(c.logprobs.token_logprobs) for c in candidates]
    r = client.completions.create(seed=7, n=2, best_of=4, **kw)
    assert [c.text for c in r.choices] == [candidates[i].text for i in np.argsort(means)[::-1][:2]]
    assert [c.index for c in r.choices] == [0, 1] and all(c.logprobs is None for c in r.choices)
    assert len(set(c.text for c in candidates)) == 4
