"""run_inference.py end to end: the demo, greedy parity with transformers' generate, batches, errors."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import run_inference
from gptoss_jax.convert.cli import main as convert_main
from gptoss_jax import ModelConfig
from gptoss_jax.testing import write_synthetic_checkpoint

from conftest import VOCAB, needs_vocab, until, wait_for_signal_handlers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny model (window 128) as a dequantized HF checkpoint, and its conversion."""
    root = tmp_path_factory.mktemp("ckpt")
    config = ModelConfig.tiny().replace(sliding_window=128, max_context_length=2048)
    write_synthetic_checkpoint(config, root / "hf", "hf-bf16", seed=6)
    assert convert_main([str(root / "hf"), str(root / "converted"), "--quiet"]) == 0
    return root


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_demo_runs_without_a_tokenizer(capsys, monkeypatch):
    import tiktoken.load

    def offline(url):  # as on a machine with no network: no vocabulary can be found or fetched
        raise OSError(f"no network to fetch {url}")

    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "/nonexistent")
    monkeypatch.setattr(tiktoken.load, "read_file", offline)
    assert run_inference.main(["--max-new-tokens", "3"]) == 0
    captured = capsys.readouterr()
    assert "RANDOM weights" in captured.err and "token ids" in captured.err
    timing = captured.err.strip().splitlines()[-1]
    assert timing.startswith("compilation ") and "; prefill 8 tokens in " in timing
    assert "; decode 2 tokens in " in timing and "0.0 tokens/s" not in timing


@pytest.mark.slow
def test_greedy_matches_transformers_generate(checkpoint, capsys):
    from transformers import GptOssForCausalLM

    prompt = np.random.default_rng(6).integers(0, 1024, 150).tolist()  # longer than the window
    argv = ["--checkpoint", str(checkpoint / "converted"), "--prompt-ids", ",".join(map(str, prompt)),
            "--temperature", "0", "--dtype", "float32", "--json", "--max-new-tokens", "64", "--max-context", "256"]
    assert run_inference.main(argv) == 0
    (record,) = _json_lines(capsys.readouterr().out)
    assert record["prompt_ids"] == prompt and len(record["output_ids"]) == 64
    assert set(record["timings"]) >= {"compile_s", "prefill_s", "decode_s", "time_to_first_token_s",
                                      "prefill_tokens_per_s", "decode_tokens_per_s"}
    model = GptOssForCausalLM.from_pretrained(str(checkpoint / "hf"), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, min_new_tokens=64)
    assert record["output_ids"] == out[0, len(prompt):].tolist()


@pytest.mark.slow
@needs_vocab
def test_batch_file_gives_one_json_object_per_prompt_and_batch_equals_single(tmp_path, capsys):
    prompts = ["Hello there", "A longer prompt about JAX, XLA and accelerators", "Bonjour 🎉"]
    (tmp_path / "batch.txt").write_text("\n".join(prompts) + "\n")
    common = ["--tokenizer", VOCAB, "--temperature", "0", "--max-new-tokens", "6", "--json"]
    assert run_inference.main(["--batch-file", str(tmp_path / "batch.txt")] + common) == 0
    batch = _json_lines(capsys.readouterr().out)
    assert len(batch) == 3 and all(isinstance(r["text"], str) for r in batch)
    timings = [r["timings"] for r in batch]  # each prompt its own
    assert [t["prompt_tokens"] for t in timings] == [len(r["prompt_ids"]) for r in batch]
    assert len({t["prompt_tokens"] for t in timings}) == 3
    assert run_inference.main(["--prompt", prompts[1]] + common) == 0
    (single,) = _json_lines(capsys.readouterr().out)
    assert single["output_ids"] == batch[1]["output_ids"]


@pytest.mark.slow
@needs_vocab
def test_chat_json_has_channels(capsys):
    argv = ["--tokenizer", VOCAB, "--chat", "--prompt", "What is 2+2?", "--reasoning-effort", "low",
            "--system", "Be brief.", "--max-new-tokens", "4", "--json"]
    assert run_inference.main(argv) == 0
    (record,) = _json_lines(capsys.readouterr().out)
    assert {"analysis", "final"} <= set(record)
    assert record["prompt_ids"][-2:] == [200006, 173781]  # ... <|start|>assistant


@pytest.mark.parametrize("argv, message", [
    (["--prompt-ids", "1,2,3,4,5", "--max-context", "4", "--json"], "exceeds the max context of 4"),
    (["--prompt-ids", "1,2", "--top-p", "0", "--json"], "top-p must be in (0, 1]"),
    (["--prompt-ids", "1,2", "--top-p", "1.5", "--json"], "top-p must be in (0, 1]"),
    (["--prompt-ids", "1,2", "--temperature", "-1", "--json"], "temperature must be >= 0"),
    (["--checkpoint", "/nonexistent/ckpt", "--prompt-ids", "1", "--json"], "checkpoint directory not found"),
    (["--prompt-ids", "1,2", "--max-new-tokens", "0", "--json"], "--max-new-tokens must be at least 1"),
    (["--prompt-ids", "1,2", "--decode-steps", "0", "--json"], "--decode-steps must be at least 1"),
    (["--prompt-ids", "1,2", "--temperature", "0", "--draft", "prompt-lookup", "--draft-tokens", "0", "--json"],
     "--draft-tokens must be at least 1"),
])
def test_bad_input_exits_non_zero_with_a_message(capsys, argv, message):
    assert run_inference.main(argv) != 0
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


# Each case must fail (or warn) before anything is loaded: one process runs them all and checks that
# JAX was never imported, let alone a model loaded.
_CHECKS = """
import json, sys
import run_inference
codes = [run_inference.main(argv) for argv in json.loads(sys.argv[1])]
assert "jax" not in sys.modules, "JAX was imported"
print(json.dumps(codes))
"""


def test_inputs_are_checked_before_anything_loads(checkpoint, tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "batch.txt").write_text("")
    (tmp_path / "binary.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    ckpt = str(checkpoint / "converted")
    head = tmp_path / "head"  # an EAGLE-3 head's config.json for another model (vocabulary 300)
    head.mkdir()
    (head / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "draft_vocab_size": 50,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}))
    eagle = ["--checkpoint", ckpt, "--prompt-ids", "1", "--temperature", "0"]
    cases = [  # (argv, exit code, what the one error line says)
        (["--chat", "--prompt-ids", "1,2"], 2, "--chat needs text (--prompt, --prompt-file or --batch-file), not --prompt-ids"),
        (["--prompt-file", str(tmp_path / "missing.txt")], 1, f"--prompt-file {tmp_path}/missing.txt: no such file"),
        (["--prompt-file", str(tmp_path / "empty.txt")], 1, f"--prompt-file {tmp_path}/empty.txt: is empty"),
        (["--batch-file", str(tmp_path / "batch.txt")], 1, f"--batch-file {tmp_path}/batch.txt: is empty"),
        (["--prompt-file", str(tmp_path)], 1, f"--prompt-file {tmp_path}: is a folder, not a file"),
        (["--batch-file", str(tmp_path)], 1, f"--batch-file {tmp_path}: is a folder, not a file"),
        (["--prompt-file", str(tmp_path / "binary.txt")], 1, "binary.txt: looks binary (it holds NUL bytes)"),
        (["--prompt-file", str(tmp_path / "latin1.txt")], 1, "latin1.txt: is not UTF-8 text (byte 3)"),
        (["--checkpoint", ckpt, "--prompt-ids", "1", "--max-context", "4096"], 2,
         "--max-context 4096 exceeds the model's context of 2048 tokens"),
        (["--max-context", "200000"], 2, "--max-context 200000 exceeds the model's context of 8192 tokens"),
        (["--temperature", "0", "--draft", "prompt-lookup", "--draft-tokens", "16"], 2,
         "--draft-tokens must be less than 16 for this model"),
        (eagle + ["--draft", "eagle3"], 2, "--draft: choose none, prompt-lookup or eagle3:DIR"),
        (eagle + ["--draft", f"eagle3:{tmp_path / 'nowhere'}"], 2,
         f"--draft eagle3:{tmp_path}/nowhere: no such folder"),
        (eagle + ["--draft", f"eagle3:{tmp_path}"], 2,
         f"--draft eagle3:{tmp_path}: {tmp_path}/config.json: config.json not found"),
        (eagle + ["--draft", f"eagle3:{head}"], 2,
         f"--draft eagle3:{head}: a head for a model of vocabulary 300 and hidden size 64, not 1024 and 64"),
        (["--checkpoint", str(tmp_path / "nowhere"), "--prompt-ids", "1"], 1, "checkpoint directory not found"),
        (["--checkpoint", str(tmp_path), "--prompt-ids", "1"], 1, "not a gptoss-jax checkpoint"),
        (["--mesh", "gpus=2"], 2, "--mesh gpus=2: unknown mesh axis 'gpus'; the axes are data, expert, tensor"),
        (["--mesh", "tensor=0"], 2, "--mesh tensor=0: mesh axis tensor must be at least 1, got 0"),
        (["--coordinator", "10.0.0.1:1234"], 2, "--coordinator needs --num-processes and --process-id too"),
        (["--coordinator", "10.0.0.1", "--num-processes", "2", "--process-id", "0"], 2,
         "--coordinator: expected HOST:PORT, got '10.0.0.1'"),
        (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], 2,
         "--process-id must lie in [0, 1] for 2 processes, got 2"),
    ]
    run = subprocess.run([sys.executable, "-c", _CHECKS, json.dumps([argv for argv, _, _ in cases])], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    errors = run.stderr.strip().splitlines()
    assert len(errors) == len(cases), run.stderr  # one line each
    for (argv, code, message), got, line in zip(cases, json.loads(run.stdout), errors, strict=True):
        assert got == code and line.startswith("error: ") and message in line, (argv, got, line)


def _cache_log(stderr: str) -> dict[str, list[str]]:
    """The keys of the programs JAX's persistent cache missed, wrote and read back, from its log lines
    (JAX_EXPLAIN_CACHE_MISSES and JAX_LOG_COMPILES on)."""
    said = {"missed": r"PERSISTENT COMPILATION CACHE MISS for '.+?' with key '(.+?)'",
            "written": r"Writing .+ to persistent compilation cache with key '(.+?)'",
            "read back": r"Persistent compilation cache hit for '.+?' with key '(.+?)'"}
    return {what: sorted(re.findall(pattern, stderr)) for what, pattern in said.items()}


@pytest.mark.slow
def test_a_second_start_reuses_the_compiled_steps(checkpoint, tmp_path):
    """Two separate processes: the first writes each program that took 0.5 s or more to compile into
    the --compile-cache folder, the second reads every one of them back, compiles only the others again,
    and gives the same tokens; with --compile-cache none nothing is looked up. Told by JAX's own log of
    the cache, not by the time compiling took (which a busy machine changes)."""
    argv = [sys.executable, "run_inference.py", "--checkpoint", str(checkpoint / "converted"), "--prompt-ids", "5,6,7",
            "--max-new-tokens", "4", "--json", "--quiet", "--compile-cache", str(tmp_path / "xla")]
    mine = ("JAX_COMPILATION_CACHE_DIR", "JAX_ENABLE_COMPILATION_CACHE", "JAX_LOGGING_LEVEL",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")  # a caller's, which could keep the log or the files away
    env = {**{k: v for k, v in os.environ.items() if k not in mine}, "JAX_EXPLAIN_CACHE_MISSES": "1",
           "JAX_LOG_COMPILES": "1"}
    runs = [subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    first, second = (json.loads(run.stdout) for run in runs)
    assert first["output_ids"] == second["output_ids"]
    first_log, second_log = (_cache_log(run.stderr) for run in runs)
    assert first_log["written"] and not first_log["read back"], runs[0].stderr[-3000:]  # the steps kept
    kept = sorted(f.name.removesuffix("-cache") for f in (tmp_path / "xla").glob("*-cache"))  # JAX's files: KEY-cache
    assert kept == sorted(set(first_log["written"]) | set(second_log["written"]))  # in the folder given
    assert second_log["read back"] == first_log["written"]  # each read back,
    assert set(second_log["missed"]) == set(first_log["missed"]) - set(first_log["written"])  # the rest compiled again
    off = subprocess.run(argv[:-2] + ["--compile-cache", "none"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=env)
    assert off.returncode == 0 and json.loads(off.stdout)["output_ids"] == first["output_ids"], off.stderr[-3000:]
    assert not any(_cache_log(off.stderr).values()), off.stderr[-3000:]


@pytest.mark.slow
def test_chat_only_flags_warn_without_chat(checkpoint, capsys):
    argv = ["--checkpoint", str(checkpoint / "converted"), "--prompt-ids", "5,6", "--max-new-tokens", "2",
            "--json", "--system", "Be brief.", "--reasoning-effort", "high"]
    assert run_inference.main(argv) == 0
    err = capsys.readouterr().err
    assert "warning: --system has no effect without --chat" in err
    assert "warning: --reasoning-effort has no effect without --chat" in err


def test_default_max_context_is_the_models_when_shorter(checkpoint, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    os.symlink(checkpoint / "converted", tmp_path / "ckpt")
    assert run_inference.main(["--checkpoint", "~/ckpt", "--prompt-ids", "5,6", "--max-new-tokens", "2",
                               "--json"]) == 0  # ~ is expanded
    assert "max context 2048" in capsys.readouterr().err


@pytest.mark.slow
@needs_vocab
def test_prompt_file_dash_reads_standard_input_and_paths_expand_home(checkpoint, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    common = ["--checkpoint", str(checkpoint / "converted"), "--temperature", "0", "--max-new-tokens", "3", "--json",
              "--tokenizer", "~/vocab"]
    (tmp_path / "vocab").mkdir()
    os.symlink(os.path.abspath(VOCAB), tmp_path / "vocab" / "o200k_base.tiktoken")
    (tmp_path / "prompt.txt").write_text("hello")
    assert run_inference.main(common + ["--prompt-ids", "1,2"]) == 0  # the tokenizer is found under ~
    capsys.readouterr()
    assert run_inference.main(common + ["--prompt", "hi"]) == 2  # a 1024-token test vocabulary takes ids only
    assert "give --prompt-ids" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello")))
    assert run_inference.main(["--prompt-file", "-", "--tokenizer", "~/vocab", "--max-new-tokens", "2", "--json",
                               "--temperature", "0"]) == 0
    from_stdin = _json_lines(capsys.readouterr().out)[0]
    assert run_inference.main(["--prompt-file", "~/prompt.txt", "--tokenizer", "~/vocab", "--max-new-tokens", "2",
                               "--json", "--temperature", "0"]) == 0
    from_file = _json_lines(capsys.readouterr().out)[0]
    assert from_stdin["prompt_ids"] == from_file["prompt_ids"] and from_file["output_ids"] == from_stdin["output_ids"]


@pytest.mark.slow
@needs_vocab
def test_chat_reads_a_piped_prompt(capsys, monkeypatch):
    """`echo PROMPT | gptoss-generate --chat`: off a terminal, with no prompt flag, standard input is the prompt."""
    from gptoss_jax import tokenizer as tk

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("What is 2+2?\n".encode())))
    assert run_inference.main(["--chat", "--tokenizer", VOCAB, "--max-new-tokens", "1", "--json"]) == 0
    (record,) = _json_lines(capsys.readouterr().out)
    assert record["prompt_ids"] == tk.render_chat([("user", "What is 2+2?\n")], reasoning_effort="medium",
                                                  vocab=VOCAB)


def test_chat_with_nothing_piped_in_asks_for_a_prompt(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b" \n")))  # a script's empty or closed input
    assert run_inference.main(["--chat", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err == ("error: --chat: no prompt given (--prompt, --prompt-file or --batch-file), and standard input, "
                   "not a terminal, is empty\n")


def test_tokenizer_with_the_wrong_hash_is_refused(tmp_path, capsys):
    bad = tmp_path / "o200k_base.tiktoken"
    bad.write_bytes(b"aGVsbG8= 0\n")
    assert run_inference.main(["--tokenizer", str(bad), "--prompt", "hi"]) != 0
    assert "is not o200k_base's" in capsys.readouterr().err


def test_unparseable_ids_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        run_inference.main(["--prompt-ids", "1,x"])
    assert info.value.code == 2 and "comma-separated integers" in capsys.readouterr().err


@pytest.mark.slow
def test_prompt_file_equals_prompt_ids(checkpoint, tmp_path, capsys):
    common = ["--checkpoint", str(checkpoint / "converted"), "--temperature", "0", "--max-new-tokens", "4",
              "--json", "--max-context", "64"]
    assert run_inference.main(common + ["--prompt-ids", "5,6,7"]) == 0
    (by_ids,) = _json_lines(capsys.readouterr().out)
    assert by_ids["finish_reason"] == "length" and by_ids["text"] is None  # a 1024-token test vocabulary
    missing = tmp_path / "nope.txt"
    assert run_inference.main(common + ["--prompt-file", str(missing)]) != 0
    assert "error:" in capsys.readouterr().err


@pytest.mark.slow
def test_prompt_lookup_drafts_give_the_same_tokens(checkpoint, capsys):
    common = ["--checkpoint", str(checkpoint / "converted"), "--temperature", "0", "--max-new-tokens", "24",
              "--json", "--max-context", "128", "--prompt-ids", ",".join(["5", "6", "7", "8"] * 6)]
    records = []
    for extra in ([], ["--draft", "prompt-lookup", "--draft-tokens", "3"]):
        assert run_inference.main(common + extra) == 0
        (record,) = _json_lines(capsys.readouterr().out)
        records.append(record)
    plain, drafted = records
    assert drafted["output_ids"] == plain["output_ids"] and "drafted_tokens" not in plain["timings"]
    assert drafted["timings"]["accepted_tokens"] <= drafted["timings"]["drafted_tokens"]


@pytest.mark.slow
def test_eagle3_drafts_give_the_same_tokens(checkpoint, tmp_path, capsys):
    """--draft eagle3:DIR: a random head in the published layout for the tiny model
    drafts 3 tokens a step; the greedy tokens are those without it."""
    from eagle3_ref import U, Reference, write_head

    torch.manual_seed(0)
    write_head(tmp_path, Reference(False), np.sort(np.random.default_rng(0).choice(1024, U, replace=False)),
               vocab=1024, layer_ids=(1, 2, 3))
    common = ["--checkpoint", str(checkpoint / "converted"), "--temperature", "0", "--max-new-tokens", "24",
              "--json", "--max-context", "128", "--prompt-ids", "5,6,7,8,9"]
    records = []
    for extra in ([], ["--draft", f"eagle3:{tmp_path}", "--draft-tokens", "3"]):
        assert run_inference.main(common + extra) == 0
        (record,) = _json_lines(capsys.readouterr().out)
        records.append(record)
    plain, drafted = records
    assert drafted["output_ids"] == plain["output_ids"] and drafted["timings"]["drafted_tokens"] >= 3 * 8


@pytest.mark.slow
@pytest.mark.parametrize("signum, moment", [(signal.SIGINT, "start"), (signal.SIGINT, "loaded"),
                                            (signal.SIGINT, "compiling"), (signal.SIGINT, "generating"),
                                            (signal.SIGTERM, "generating")])
def test_a_signal_during_compilation_or_generation_is_one_line(signum, moment):
    """A signal once the handlers are in, once the model is made (its line said), amid compilation (the
    devices' line said: compiling follows) and amid generation (the first token printed): one line."""
    process = subprocess.Popen([sys.executable, "run_inference.py", "--max-new-tokens", "3000", "--compile-cache", "none"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # (it compiles)
    out, err = [], []
    readers = [threading.Thread(target=lambda f=f, to=to: to.extend(iter(lambda: f.read(1), "")), daemon=True)
               for f, to in ((process.stdout, out), (process.stderr, err))]
    for reader in readers:
        reader.start()
    wait_for_signal_handlers(process)
    said = {"start": lambda: True, "loaded": lambda: "model: " in "".join(err),
            "compiling": lambda: "devices: " in "".join(err), "generating": lambda: "".join(out).strip()}[moment]
    def reached():
        assert process.poll() is None, f"the command ended before {moment!r}: {''.join(err)[-2000:]}"
        return said()

    until(reached, f"the command reached {moment!r}")
    process.send_signal(signum)
    process.wait(120)
    for reader in readers:
        reader.join(30)
    err = "".join(err)
    what = "interrupted" if signum == signal.SIGINT else "terminated"
    assert process.returncode == 128 + signum, err
    assert err.rstrip().splitlines()[-1] == f"error: {what}" and "Traceback" not in err and "Exception" not in err, err


def _fake_terminal(lines):
    stdin = io.StringIO("".join(line + "\n" for line in lines))
    stdin.isatty = lambda: True
    return stdin


@needs_vocab
def test_interactive_chat_keeps_the_model_and_compiled_steps_across_turns(monkeypatch, capsys):
    from gptoss_jax import tokenizer as tk
    from gptoss_jax.decoding.generator import Generator

    calls = []
    generate = Generator.generate

    def recording(self, prompts, **kwargs):
        results = generate(self, prompts, **kwargs)
        calls.append((id(self), prompts[0], results[0]))
        return results

    monkeypatch.setattr(Generator, "generate", recording)
    monkeypatch.setattr(sys, "stdin", _fake_terminal(["What is 2+2?", "/reset", "What is 2+2?", "And 3+3?",
                                                      "/nonsense", "/exit"]))
    argv = ["--chat", "--tokenizer", VOCAB, "--temperature", "0", "--max-new-tokens", "6", "--system", "Be brief."]
    assert run_inference.main(argv) == 0
    err = capsys.readouterr().err
    assert len(calls) == 3 and len({generator for generator, _, _ in calls}) == 1  # one model, one Generator
    (_, first, r1), (_, again, r2), (_, third, r3) = calls
    assert again == first and r2.output_ids == r1.output_ids  # /reset: the same conversation from scratch
    assert r2.timings["compile_s"] == 0.0  # the compiled steps were kept
    final = tk.parse_reply(r2.output_ids, vocab=VOCAB).final  # earlier turns: their final answer only
    assert third == tk.render_chat([("user", "What is 2+2?"), ("assistant", final), ("user", "And 3+3?")],
                                   instructions="Be brief.", vocab=VOCAB)
    assert "unknown command /nonsense" in err and "(a new conversation)" in err


@pytest.mark.slow
@needs_vocab
def test_interactive_chat_on_a_real_terminal():
    import pty
    import select

    controller, terminal = pty.openpty()
    process = subprocess.Popen([sys.executable, "run_inference.py", "--chat", "--tokenizer", VOCAB, "--max-new-tokens",
                                "3000", "--temperature", "0"], cwd=ROOT, stdin=terminal,
                               stdout=terminal, stderr=terminal, close_fds=True)
    os.close(terminal)
    seen = b""

    def read_until(marker: bytes, timeout: float = 120):
        nonlocal seen
        deadline = time.monotonic() + timeout
        while marker not in seen:
            assert time.monotonic() < deadline, seen.decode(errors="replace")
            if select.select([controller], [], [], 0.5)[0]:
                seen += os.read(controller, 4096)
        found = seen
        seen = b""
        return found.decode(errors="replace")

    assert "/reset starts a new conversation" in read_until(b"\n> ")
    os.write(controller, b"Tell me a long story.\n")
    read_until(b"[the reply is not in the harmony chat format")  # the demo's random reply is streaming
    process.send_signal(signal.SIGINT)  # Ctrl-C stops this reply, not the program
    assert "(reply stopped; it is not kept in the conversation)" in read_until(b"\n> ")
    os.write(controller, b"/reset\n")
    assert "(a new conversation)" in read_until(b"\n> ")
    os.write(controller, b"/exit\n")
    assert process.wait(timeout=60) == 0
    os.close(controller)


@pytest.mark.slow
@needs_vocab
def test_interactive_chat_says_when_the_conversation_no_longer_fits(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", _fake_terminal(["Hi", "tell me " * 200, "/exit"]))
    argv = ["--chat", "--tokenizer", VOCAB, "--temperature", "0", "--max-new-tokens", "4", "--max-context", "256"]
    assert run_inference.main(argv) == 0
    err = capsys.readouterr().err
    assert "plus --max-new-tokens 4 exceeds the max context of 256 (--max-context): /reset to start a new " \
           "conversation" in err


def test_a_signal_reported_as_another_error_is_the_interruption(capsys):
    """A Ctrl-C whose KeyboardInterrupt lands inside code that re-raises it as another error (JAX,
    comparing pytree metadata while the default mesh is checked, raises a ValueError from it) ends
    the command as interrupted (130), not as that error; an error with no signal stays the error."""
    from gptoss_jax.cli.command import run_command

    def wrapped(args, signals):
        try:
            signals._handle(signal.SIGINT, None)  # what Ctrl-C calls
        except KeyboardInterrupt as e:
            raise ValueError("Exception raised while checking equality of metadata fields of pytree") from e

    def failing(args, signals):
        raise ValueError("a bad file")

    assert run_command(lambda: None, wrapped, raising=True) == 128 + signal.SIGINT
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: interrupted"
    assert run_command(lambda: None, failing, raising=True) == 1
    assert capsys.readouterr().err.strip() == "error: a bad file"


class _StderrInterruptedAfter(io.StringIO):
    """Standard error with Ctrl-C arriving just after the first write that starts with `prefix`."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix, self.fired = prefix, False

    def write(self, text):
        n = super().write(text)
        if not self.fired and text.startswith(self.prefix):
            self.fired = True
            raise KeyboardInterrupt
        return n


def test_a_signal_just_after_a_status_line_leaves_the_error_line_its_own(monkeypatch):
    """The command's lines on standard error are written whole: a Ctrl-C right after the model's line
    is written (before the devices are chosen) still leaves `error: interrupted` on a line of its own."""
    err = _StderrInterruptedAfter("model: ")
    monkeypatch.setattr(sys, "stderr", err)
    assert run_inference.main(["--max-new-tokens", "1"]) == 128 + signal.SIGINT
    lines = err.getvalue().splitlines()
    assert lines[0].startswith("model: ") and lines[-1] == "error: interrupted", lines
