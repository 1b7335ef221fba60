"""The tokenizer and the harmony chat format, with the genuine o200k_base vocabulary (../shared)."""

import hashlib
import os

import pytest
import tiktoken

from conftest import VOCAB, needs_vocab
from gptoss_jax import tokenizer as tk

pytestmark = needs_vocab

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnewlines", "def f(x):\n    return x ** 2  # code",
         "naïve café, Größe, 日本語のテキスト, русский, العربية", "emoji 🎉🚀👩‍💻 and math ∑∫√",
         "<|start|> as plain text", "1234567890 3.14159 1e-5", ""]


@pytest.fixture(scope="module")
def enc():
    return tk.load_tokenizer(VOCAB)


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


def test_render_chat_rejects_bad_input():
    with pytest.raises(ValueError, match="reasoning effort"):
        tk.render_chat([("user", "hi")], reasoning_effort="max", vocab=VOCAB)
    with pytest.raises(ValueError, match="'user' or 'assistant'"):
        tk.render_chat([("system", "hi")], vocab=VOCAB)


def test_parse_reply_splits_channels(enc):
    full = ("<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>4<|return|>")
    reply = tk.parse_reply(enc.encode(full, allowed_special="all"), vocab=VOCAB)
    assert (reply.analysis, reply.final) == ("User asks 2+2. Easy.", "4")
    cut = "<|channel|>analysis<|message|>Thinking<|end|><|start|>assistant<|channel|>final<|message|>The answ"
    reply = tk.parse_reply(enc.encode(cut, allowed_special="all"), vocab=VOCAB)
    assert (reply.analysis, reply.final) == ("Thinking", "The answ")


def test_stream_decoder_never_emits_broken_utf8(enc):
    text = "héllo 🎉👩‍💻 世界 — ok"
    ids = enc.encode(text)
    decoder = tk.StreamDecoder(enc)
    pieces = [decoder.add(t) for t in ids] + [decoder.flush()]
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)
    # At least one character really is split across tokens here, so holding bytes back was needed.
    assert any(len(enc.decode_single_token_bytes(t).decode("utf-8", errors="ignore").encode())
               != len(enc.decode_single_token_bytes(t)) for t in ids)


def test_bad_vocabulary_files(tmp_path, monkeypatch):
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
