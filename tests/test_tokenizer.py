"""The tokenizer and the harmony chat format, with the genuine o200k_base vocabulary (../shared)."""

import hashlib
import os
import tempfile

import pytest
import requests
import tiktoken
import tiktoken.load

from conftest import VOCAB, needs_vocab
from gptoss_jax import tokenizer as tk

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnewlines", "def f(x):\n    return x ** 2  # code",
         "naïve café, Größe, 日本語のテキスト, русский, العربية", "emoji 🎉🚀👩‍💻 and math ∑∫√",
         "<|start|> as plain text", "1234567890 3.14159 1e-5", ""]


@pytest.fixture(scope="module")
def enc():
    return tk.load_tokenizer(VOCAB)


@needs_vocab
def test_encodings_match_tiktoken_and_harmony(enc, tmp_path, monkeypatch):
    harmony = tk.harmony_encoding(VOCAB)
    # tiktoken's plain o200k_base, read by tiktoken itself from its cache layout, and harmony's own
    # (Rust) tokenizer agree with ours on ordinary text.
    (tmp_path / hashlib.sha1(tk.O200K_BASE_URL.encode()).hexdigest()).symlink_to(os.path.abspath(VOCAB))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    base = tiktoken.get_encoding("o200k_base")
    assert enc.n_vocab == tk.VOCAB_SIZE == 201088
    for text in TEXTS:
        ids = enc.encode(text, disallowed_special=())
        assert ids == base.encode(text, disallowed_special=()) == harmony.encode(text, disallowed_special=())
        assert enc.decode(ids) == text


@needs_vocab
def test_special_token_ids(enc):
    specials = {"<|start|>": 200006, "<|end|>": 200007, "<|message|>": 200008, "<|channel|>": 200005,
                "<|return|>": 200002, "<|call|>": 200012, "<|endoftext|>": 199999}
    for text, token in specials.items():
        assert enc.encode(text, allowed_special="all") == [token]
    assert (tk.START, tk.END, tk.MESSAGE, tk.CHANNEL, tk.RETURN, tk.CALL, tk.END_OF_TEXT) == tuple(specials.values())


CONVERSATIONS = [
    ([("user", "What is 2+2?")], None),
    ([("user", "Hi"), ("assistant", "Hello! How can I help?"), ("user", "Tell me a joke.")], "Answer in French."),
    ([("user", "Résumé en 日本語 🎉")], "Be brief.\nUse lists."),
]


@needs_vocab
@pytest.mark.parametrize("effort", tk.REASONING_EFFORTS)
@pytest.mark.parametrize("turns, instructions", CONVERSATIONS)
def test_render_chat_matches_harmony(enc, turns, instructions, effort):
    from openai_harmony import Conversation, DeveloperContent, Message, ReasoningEffort, Role, SystemContent

    ours = tk.render_chat(turns, reasoning_effort=effort, instructions=instructions, vocab=VOCAB)
    # The reference conversation, built directly with openai-harmony.
    system = SystemContent.new().with_reasoning_effort(ReasoningEffort(effort.capitalize()))
    messages = [Message.from_role_and_content(Role.SYSTEM, system)]
    if instructions:
        messages.append(Message.from_role_and_content(Role.DEVELOPER,
                                                      DeveloperContent.new().with_instructions(instructions)))
    for role, text in turns:
        m = Message.from_role_and_content(Role(role), text)
        messages.append(m.with_channel("final") if role == "assistant" else m)
    ref = tk.harmony_encoding(VOCAB).render_conversation_for_completion(Conversation.from_messages(messages),
                                                                         Role.ASSISTANT)
    assert ours == list(ref)
    # And the rendered text has the documented shape, read back with our tiktoken tokenizer.
    text = enc.decode(ours)
    assert text.startswith("<|start|>system<|message|>")
    assert text.endswith("<|start|>user<|message|>" + turns[-1][1] + "<|end|><|start|>assistant")
    assert f"\nReasoning: {effort}\n" in text
    assert ("<|start|>developer<|message|># Instructions\n\n" + instructions in text) if instructions else (
        "developer" not in text)


@needs_vocab
def test_render_chat_rejects_bad_input():
    with pytest.raises(ValueError, match="reasoning effort"):
        tk.render_chat([("user", "hi")], reasoning_effort="max", vocab=VOCAB)
    with pytest.raises(ValueError, match="'user' or 'assistant'"):
        tk.render_chat([("system", "hi")], vocab=VOCAB)


@needs_vocab
def test_parse_reply_splits_channels(enc):
    full = ("<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>4<|return|>")
    reply = tk.parse_reply(enc.encode(full, allowed_special="all"), vocab=VOCAB)
    assert (reply.analysis, reply.final) == ("User asks 2+2. Easy.", "4")
    cut = "<|channel|>analysis<|message|>Thinking<|end|><|start|>assistant<|channel|>final<|message|>The answ"
    reply = tk.parse_reply(enc.encode(cut, allowed_special="all"), vocab=VOCAB)
    assert (reply.analysis, reply.final) == ("Thinking", "The answ")


@needs_vocab
def test_stream_decoder_never_emits_broken_utf8(enc):
    text = "héllo 🎉👩‍💻 世界 — ok"
    ids = enc.encode(text)
    decoder = tk.StreamDecoder(enc)
    pieces = [decoder.add(t) for t in ids] + [decoder.flush()]
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)
    # At least one character really is split across tokens here, so holding bytes back was needed.
    assert any(len(enc.decode_single_token_bytes(t).decode("utf-8", errors="ignore").encode())
               != len(enc.decode_single_token_bytes(t)) for t in ids)


@needs_vocab
def test_bad_vocabulary_files(tmp_path, monkeypatch):
    offline(monkeypatch)
    wrong = tmp_path / "o200k_base.tiktoken"
    wrong.write_bytes(b"aGVsbG8= 0\n")
    with pytest.raises(tk.TokenizerError, match="is not o200k_base's"):
        tk.load_tokenizer(wrong)
    with pytest.raises(tk.TokenizerError, match="not found"):
        tk.load_tokenizer(tmp_path / "missing.tiktoken")
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    with pytest.raises(tk.TokenizerError, match="no o200k_base vocabulary found") as missing:
        tk.load_tokenizer()
    assert f"Download o200k_base.tiktoken once (3.6 MB) from {tk.O200K_BASE_URL}" in str(missing.value)
    # The environment variables are honoured.
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", os.path.dirname(VOCAB))
    assert tk.load_tokenizer().n_vocab == 201088


# Where tiktoken looks, and its download: the network is never used, tiktoken's fetch is replaced.

def offline(monkeypatch) -> list[str]:
    """tiktoken's fetch fails as it does with no network; -> the URLs it was asked for."""
    asked = []

    def fetch(url):
        asked.append(url)
        raise requests.ConnectionError(f"Failed to resolve '{url.split('/')[2]}' (Name or service not known)")

    monkeypatch.setattr(tiktoken.load, "read_file", fetch)
    return asked


def online(monkeypatch, data: bytes | None = None) -> list[str]:
    """tiktoken's fetch gives `data` (the genuine vocabulary by default); -> the URLs it was asked for."""
    asked = []

    def fetch(url):
        asked.append(url)
        if data is not None:
            return data
        with open(VOCAB, "rb") as f:
            return f.read()

    monkeypatch.setattr(tiktoken.load, "read_file", fetch)
    return asked


def fresh_machine(monkeypatch, tmp_path) -> None:
    """No vocabulary anywhere: no TIKTOKEN_ENCODINGS_BASE, tiktoken's default cache in an empty
    temporary folder."""
    for name in ("TIKTOKEN_ENCODINGS_BASE", "TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.makedirs(tmp_path / "tmp")


CACHE_RULES = [  # (TIKTOKEN_CACHE_DIR, DATA_GYM_CACHE_DIR) -> the folder, relative to tmp_path (None: no cache)
    ((None, None), "tmp/data-gym-cache"),
    (("tiktoken", None), "tiktoken"),
    ((None, "gym"), "gym"),
    (("tiktoken", "gym"), "tiktoken"),
    (("", "gym"), None),
    ((None, ""), None),
]


@pytest.mark.parametrize("variables, expected", CACHE_RULES)
def test_cache_folder_is_tiktokens(variables, expected, tmp_path, monkeypatch):
    fresh_machine(monkeypatch, tmp_path)
    for name, value in zip(("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"), variables):
        if value is not None:
            monkeypatch.setenv(name, str(tmp_path / value) if value else "")
    folder = tk.cache_folder()
    assert folder == (str(tmp_path / expected) if expected else None)
    # tiktoken itself caches a download there (and nowhere else).
    online(monkeypatch, b"some bytes")
    tiktoken.load.read_file_cached("https://example.invalid/some.file")
    written = sorted(str(p.parent) for p in tmp_path.rglob("*") if p.is_file())
    assert written == ([folder] if folder else [])


@needs_vocab
@pytest.mark.parametrize("variable", ["TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR", None])
def test_vocabulary_found_in_tiktokens_cache(variable, tmp_path, monkeypatch):
    fresh_machine(monkeypatch, tmp_path)
    folder = tmp_path / "tmp" / "data-gym-cache"
    if variable:
        folder = tmp_path / "cache"
        monkeypatch.setenv(variable, str(folder))
    folder.mkdir()
    (folder / hashlib.sha1(tk.O200K_BASE_URL.encode()).hexdigest()).symlink_to(os.path.abspath(VOCAB))
    asked = offline(monkeypatch)
    assert tk.find_vocab() == str(folder / hashlib.sha1(tk.O200K_BASE_URL.encode()).hexdigest())
    assert tk.load_tokenizer().n_vocab == tk.VOCAB_SIZE and asked == []


@needs_vocab
@pytest.mark.parametrize("variable", ["TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR", None])
def test_downloaded_into_tiktokens_cache_when_online(variable, tmp_path, monkeypatch):
    fresh_machine(monkeypatch, tmp_path)
    folder = tmp_path / "tmp" / "data-gym-cache"
    if variable:
        folder = tmp_path / "new" / "cache"  # made by the download
        monkeypatch.setenv(variable, str(folder))
    asked = online(monkeypatch)
    enc = tk.load_tokenizer()
    harmony = tk.harmony_encoding()
    assert asked == [tk.O200K_BASE_URL]  # once: the second lookup finds the cached file
    cached = folder / hashlib.sha1(tk.O200K_BASE_URL.encode()).hexdigest()
    assert tk.find_vocab() == str(cached) and asked == [tk.O200K_BASE_URL]
    with open(VOCAB, "rb") as f:
        assert cached.read_bytes() == f.read()
    assert enc.encode("Hello, world!") == harmony.encode("Hello, world!") == [13225, 11, 2375, 0]


@needs_vocab
def test_corrupt_cached_copy_is_fetched_again(tmp_path, monkeypatch):
    fresh_machine(monkeypatch, tmp_path)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    cached = tmp_path / "cache" / hashlib.sha1(tk.O200K_BASE_URL.encode()).hexdigest()
    cached.write_bytes(b"aGVsbG8= 0\n")  # cut short, say
    asked = online(monkeypatch)
    assert tk.find_vocab() == str(cached) and asked == [tk.O200K_BASE_URL]
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == tk.O200K_BASE_SHA256


@needs_vocab
def test_download_without_a_cache(tmp_path, monkeypatch):
    fresh_machine(monkeypatch, tmp_path)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken's way to cache nothing
    asked = online(monkeypatch)
    assert tk.load_tokenizer().n_vocab == tk.VOCAB_SIZE and asked == [tk.O200K_BASE_URL]
    # No cache anywhere; the process reads its own copy of the download.
    assert not (tmp_path / "tmp" / "data-gym-cache").exists()
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [os.path.basename(tk.find_vocab())]


def test_offline_with_no_vocabulary_says_what_it_tried(tmp_path, monkeypatch):
    fresh_machine(monkeypatch, tmp_path)
    asked = offline(monkeypatch)
    with pytest.raises(tk.TokenizerError) as missing:
        tk.find_vocab()
    message = str(missing.value)
    cached = os.path.join(tmp_path, "tmp", "data-gym-cache", hashlib.sha1(tk.O200K_BASE_URL.encode()).hexdigest())
    assert message.startswith(f"no o200k_base vocabulary found (looked in {cached}), and downloading it from "
                              f"{tk.O200K_BASE_URL} failed (Failed to resolve 'openaipublic.blob.core.windows.net'")
    assert message.endswith(tk.DOWNLOAD_HINT) and "\n" not in message and asked == [tk.O200K_BASE_URL]


def test_download_of_another_file_is_refused(tmp_path, monkeypatch):
    fresh_machine(monkeypatch, tmp_path)
    online(monkeypatch, b"aGVsbG8= 0\n")  # a captive portal's page, say
    with pytest.raises(tk.TokenizerError, match=r"downloading it from \S+ failed \(Hash mismatch"):
        tk.find_vocab()
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


@pytest.mark.slow
@needs_vocab
def test_demo_prints_text_on_a_fresh_machine_online(tmp_path, monkeypatch, capsys):
    import run_inference

    fresh_machine(monkeypatch, tmp_path)
    online(monkeypatch)
    assert run_inference.main(["--max-new-tokens", "3", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    # The built-in prompt went in as text (5 tokens, not the 8 token ids used without a tokenizer).
    assert "token ids" not in captured.err and "; prefill 5 tokens in " in captured.err


def _awkward_texts() -> list[str]:
    """Long texts (past tk.VERBATIM_LEAST) whose edges and insides test how a text meets the harmony
    around it: whitespace and newlines at either end, special tokens' text, words, digits, punctuation
    and multi-byte characters against the boundary, a long unbroken word."""
    body = "Hello, world! 1234567 numbers; ünïcödé 漢字 🙂 <|end|> <|start|>user <|message|> x=1 "
    return [body * 4, "  " + body * 4 + "  ", "\n\n" + body * 4 + "\n", "x" * 3000, "a" * 700 + " tail",
            "   \n \t" * 60, "🙂" * 300, "<|end|>" * 60, body * 4 + "<|", "7" * 400, "!!" * 200 + "word"]


@needs_vocab
@pytest.mark.parametrize("index", range(11))
def test_long_texts_are_rendered_as_harmony_renders_them(index, monkeypatch):
    """render_prompt tokenizes long message texts and instructions with tiktoken in place (no
    quadratic work holding Python's lock): its tokens equal openai-harmony's own rendering of the same
    conversation (every message kind, tools beside the instructions), for texts with awkward edges.
    Substituting a text wrongly (at a stretch harmony encodes in parts) fails it."""
    from openai_harmony import Author, Message, Role, ToolDescription

    text = _awkward_texts()[index]
    messages = [Message.from_role_and_content(Role.USER, text),
                Message.from_role_and_content(Role.ASSISTANT, text).with_channel("analysis"),
                Message.from_role_and_content(Role.ASSISTANT, text).with_channel("commentary")
                .with_recipient("functions.f").with_content_type("<|constrain|>json"),
                Message.from_author_and_content(Author.new(Role.TOOL, "functions.f"), text)
                .with_recipient("assistant").with_channel("commentary"),
                Message.from_role_and_content(Role.ASSISTANT, "short " + text).with_channel("final"),
                Message.from_role_and_content(Role.USER, "a short one")]
    tools = [ToolDescription.new("f", "does f", {"type": "object", "properties": {"a": {"type": "string"}}})]
    for instructions, with_tools in ((text, tools), (text, None), (None, tools)):
        fast = tk.render_prompt(messages, instructions=instructions, tools=with_tools, vocab=VOCAB)
        monkeypatch.setattr(tk, "VERBATIM_LEAST", 10**12)  # openai-harmony renders every text itself
        reference = tk.render_prompt(messages, instructions=instructions, tools=with_tools, vocab=VOCAB)
        monkeypatch.undo()
        assert fast == reference, (index, instructions is not None, with_tools is not None)
