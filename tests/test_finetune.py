"""finetune.py: harmony data, exact resume after Ctrl-C, the merged model for run_inference.py, and
one-line errors for bad input that leave earlier train states as they were."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from conftest import VOCAB, needs_vocab

import gptoss_jax as gj
from gptoss_jax.cli import finetune
from gptoss_jax.training import data as td

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = needs_vocab


@pytest.fixture(scope="module")
def encoding():
    from gptoss_jax.tokenizer import harmony_encoding

    return harmony_encoding(VOCAB)


def _conversation(a, b, thinking=True):
    reply = {"role": "assistant", "content": str(a + b)}
    if thinking:
        reply["thinking"] = "Add the two numbers."
    return {"messages": [{"role": "user", "content": f"What is {a} + {b}?"}, reply]}


def _write(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def test_conversations_render_as_harmony_trains_and_only_replies_are_learned(encoding):
    from openai_harmony import (Conversation, DeveloperContent, Message, RenderConversationConfig, Role,
                                SystemContent)

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello", "thinking": "greet"},
                {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "thinking": "add"}]
    example = td.render(messages, encoding)
    # harmony's own rendering for training; earlier turns' reasoning is dropped, the last reply's kept
    want = encoding.render_conversation_for_training(Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, SystemContent.new()),
        Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions("Be brief.")),
        Message.from_role_and_content(Role.USER, "hi"),
        Message.from_role_and_content(Role.ASSISTANT, "hello").with_channel("final"),
        Message.from_role_and_content(Role.USER, "2+2?"),
        Message.from_role_and_content(Role.ASSISTANT, "add").with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, "4").with_channel("final")]),
        RenderConversationConfig(auto_drop_analysis=False))
    assert list(example.tokens) == list(want)
    learned = encoding.decode([int(t) for t, m in zip(example.tokens, example.mask) if m])
    assert learned == ("<|channel|>final<|message|>hello<|end|><|channel|>analysis<|message|>add<|end|>"
                       "<|channel|>final<|message|>4<|return|>")


def test_long_conversations_are_cut_with_one_warning(tmp_path, encoding):
    path = _write(tmp_path / "d.jsonl", [_conversation(1, 2), {"text": "word " * 400}, _conversation(3, 4)])
    warnings = []
    examples = td.read_jsonl(path, encoding, max_length=200, warn=warnings.append)
    short = len(td.render(_conversation(1, 2)["messages"], encoding).tokens)
    assert short < 200 and [len(e.tokens) for e in examples] == [short, 200, short]
    assert len(warnings) == 1 and "1 of 3 conversations are longer than --max-length 200" in warnings[0], warnings


def test_the_order_of_examples_is_a_permutation_per_epoch_and_resumes_where_it_stopped():
    examples = [td.Example(np.full(3, i, np.int32), np.ones(3, bool)) for i in range(5)]
    straight = td.batches(examples, batch_size=2, length=4, seed=1)
    run = [next(straight) for _ in range(5)]  # two epochs of 5
    seen = [int(t[0]) for _, tokens, _, _ in run for t in tokens]
    assert sorted(seen[:5]) == sorted(seen[5:]) == list(range(5)) and seen[:5] != seen[5:]
    resumed = td.batches(examples, batch_size=2, length=4, seed=1, position=run[2][0])
    for a, b in zip(run[3:], (next(resumed) for _ in range(2))):
        assert a[0] == b[0] and (a[1] == b[1]).all() and (a[2] == b[2]).all()


def _finetune(args, **kw):
    env = dict(os.environ, TIKTOKEN_ENCODINGS_BASE=os.path.dirname(VOCAB), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "finetune.py"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _losses(stdout_lines):
    return {r["step"]: r["loss"] for r in map(json.loads, stdout_lines) if "loss" in r}


@pytest.mark.slow
def test_a_run_stopped_by_ctrl_c_and_resumed_follows_the_uninterrupted_one(tmp_path):
    """Loss trajectories bit-equal on CPU; then run_inference.py generates from the merged model."""
    data = _write(tmp_path / "train.jsonl", [_conversation(a, 2 * a + 1, thinking=a % 2 == 0) for a in range(10)])
    common = ["--data", data, "--steps", "6", "--batch-size", "2", "--lora-rank", "4", "--lr", "1e-2",
              "--json", "--quiet", "--save-every", "100"]
    straight = _finetune(common + ["--out", str(tmp_path / "a")])
    out, err = straight.communicate(timeout=900)
    assert straight.returncode == 0, err
    want = _losses(out.splitlines())
    assert sorted(want) == [1, 2, 3, 4, 5, 6]

    stopped = _finetune(common + ["--out", str(tmp_path / "b")])
    lines = []
    for line in stopped.stdout:
        lines.append(line)
        if json.loads(line)["step"] == 2:
            stopped.send_signal(signal.SIGINT)
            break
    rest, err = stopped.communicate(timeout=900)
    lines += rest.splitlines()
    assert stopped.returncode == 130, err
    assert "train state saved" in err and "--resume" in err
    first = _losses(lines)
    assert 2 <= max(first) < 6
    assert not os.path.exists(tmp_path / "b" / "gptoss_checkpoint.json")  # no model before the end

    resumed = _finetune(common + ["--out", str(tmp_path / "b"), "--resume"])
    out, err = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, err
    second = _losses(out.splitlines())
    assert sorted(second) == list(range(max(first) + 1, 7))
    assert {**first, **second} == want  # exactly: the JSON holds each loss's full float repr
    from gptoss_jax.training.adapter_files import read_adapter

    adapter = read_adapter(str(tmp_path / "b"), gj.ModelConfig.tiny())  # the adapters alone, in peft's format
    assert adapter.rank == 4 and adapter.targets == ("attention",)

    from gptoss_jax.cli.generate import main as generate

    assert generate(["--checkpoint", str(tmp_path / "b"), "--prompt-ids", "1,2,3", "--max-new-tokens", "3",
                     "--json", "--quiet", "--temperature", "0"]) == 0


def _one_error_line(capsys, code, args):
    assert finetune.main(args) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def _train_state(directory, meta):
    """A train state as a run of another model config would have left it."""
    import jax.numpy as jnp

    from gptoss_jax.training.state import TrainCheckpoints

    states = TrainCheckpoints(os.path.join(directory, "checkpoints"))
    states.save(3, {"w": jnp.ones(2)}, {"m": jnp.zeros(2)}, meta)
    states.close()


def _listing(directory):
    out = {}
    for root, _, files in os.walk(directory):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as h:
                out[os.path.relpath(p, directory)] = h.read()
    return out


def test_bad_input_is_one_line_and_leaves_train_states_intact(tmp_path, capsys, monkeypatch):
    import gptoss_jax as gj

    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", os.path.dirname(VOCAB))
    run = str(tmp_path / "run")
    tiny = gj.ModelConfig.tiny().to_json_dict()
    _train_state(run, {"config": tiny, "position": 6})
    before = _listing(run)
    good = _write(tmp_path / "good.jsonl", [_conversation(1, 2)] * 3)

    bad = _write(tmp_path / "bad.jsonl", [_conversation(1, 2), _conversation(2, 3), "{not json"])
    line = _one_error_line(capsys, 1, ["--data", bad, "--out", run, "--resume"])
    assert f"{bad}:3: not valid JSON" in line, line

    empty = _write(tmp_path / "empty.jsonl", [])
    line = _one_error_line(capsys, 1, ["--data", empty, "--out", run, "--resume"])
    assert f"{empty}: no conversations to train on (the file is empty)" in line, line

    no_reply = _write(tmp_path / "q.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    line = _one_error_line(capsys, 1, ["--data", no_reply, "--out", run, "--resume"])
    assert f"{no_reply}:1: no assistant message" in line, line

    line = _one_error_line(capsys, 1, ["--data", good, "--out", run, "--resume"])
    assert "another model config" in line and "vocab_size" in line, line

    line = _one_error_line(capsys, 2, ["--data", good, "--out", run])
    assert "already holds a training run" in line, line

    line = _one_error_line(capsys, 2, ["--data", good, "--out", str(tmp_path / "new"), "--resume"])
    assert "holds no train state" in line, line

    line = _one_error_line(capsys, 2, ["--data", good, "--out", str(tmp_path / "x"), "--lora-targets", "mlp"])
    assert "--lora-targets" in line, line

    # A mesh the devices cannot form (the tests see 8): refused before anything is read or written.
    line = _one_error_line(capsys, 2, ["--data", good, "--out", str(tmp_path / "y"), "--mesh", "data=3"])
    assert "--mesh" in line and "spans 3 devices" in line, line
    line = _one_error_line(capsys, 2, ["--data", good, "--out", run, "--resume", "--mesh", "data=3"])
    assert "spans 3 devices" in line, line
    assert not os.path.exists(tmp_path / "y")

    assert _listing(run) == before
