"""The o200k_harmony tokenizer, loaded from a hash-checked vocabulary file, and the harmony chat
format (rendering and parsing through OpenAI's `openai-harmony` package, the reference).

Where the vocabulary comes from, in order: an explicit path (`--tokenizer PATH`);
`$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken` (what openai-harmony reads); tiktoken's own cache,
`<cache folder>/<sha1 of the download URL>`, the folder chosen by tiktoken's rules
($TIKTOKEN_CACHE_DIR, else $DATA_GYM_CACHE_DIR, else <temporary folder>/data-gym-cache); and last,
tiktoken's own download into that cache, as tiktoken itself does it, when the machine is online.
Its sha256 must be o200k_base's.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import functools
import hashlib
import os
import re
import secrets
import tempfile

import tiktoken

O200K_BASE_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
VOCAB_FILE = "o200k_base.tiktoken"
VOCAB_SIZE = 201088

# Special tokens of o200k_harmony that generation needs by id.
END_OF_TEXT, RETURN, CHANNEL, START, END, MESSAGE, CALL = 199999, 200002, 200005, 200006, 200007, 200008, 200012
STOP_TOKENS = (RETURN, CALL, END_OF_TEXT)  # end of a final answer, a tool call, end of text
REASONING_EFFORTS = ("low", "medium", "high")
# Characters from which a text that harmony writes verbatim (a message's text, the instructions) is
# tokenized by tiktoken in place, not by openai-harmony (`_Verbatim`).
VERBATIM_LEAST = 256
DOWNLOAD_HINT = (f"Download {VOCAB_FILE} once (3.6 MB) from {O200K_BASE_URL}, then pass --tokenizer PATH "
                 f"(the file or its folder) or set TIKTOKEN_ENCODINGS_BASE to its folder")


class TokenizerError(ValueError):
    """The vocabulary file is missing or is not o200k_base; the message names the file."""


def _cache_name() -> str:
    return hashlib.sha1(O200K_BASE_URL.encode()).hexdigest()


def cache_folder() -> str | None:
    """tiktoken's cache folder, by tiktoken's own rules (`tiktoken.load.read_file_cached`):
    $TIKTOKEN_CACHE_DIR if set, else $DATA_GYM_CACHE_DIR if set, else <temporary folder>/data-gym-cache;
    None where the chosen variable is set empty (tiktoken then caches nothing)."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        folder = os.environ["TIKTOKEN_CACHE_DIR"]
    elif "DATA_GYM_CACHE_DIR" in os.environ:
        folder = os.environ["DATA_GYM_CACHE_DIR"]
    else:
        folder = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return folder or None


def find_vocab(path: str | os.PathLike | None = None) -> str:
    """The vocabulary file to use (see the module docstring), checked to exist; downloaded into
    tiktoken's cache when no file is found and the machine is online."""
    if path is not None:
        path = os.path.expanduser(os.fspath(path))
        if os.path.isdir(path):
            path = os.path.join(path, VOCAB_FILE)
        if not os.path.isfile(path):
            raise TokenizerError(f"{path}: tokenizer vocabulary file not found. {DOWNLOAD_HINT}")
        return path
    if os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        candidate = os.path.join(os.environ["TIKTOKEN_ENCODINGS_BASE"], VOCAB_FILE)
        if os.path.isfile(candidate):
            return candidate
    folder = cache_folder()
    cached = os.path.join(folder, _cache_name()) if folder else None
    if cached and os.path.isfile(cached) and _sha256(cached) == O200K_BASE_SHA256:
        return cached
    return _download(cached)


def _download(cached: str | None) -> str:
    """tiktoken's own download of o200k_base into its cache (a corrupt cached copy is fetched again,
    and the download is hash-checked), as `tiktoken.get_encoding` does it -> the cached file."""
    import tiktoken.load

    looked = [os.path.join(os.environ["TIKTOKEN_ENCODINGS_BASE"], VOCAB_FILE)] if os.environ.get(
        "TIKTOKEN_ENCODINGS_BASE") else []
    looked += [cached] if cached else ["no cache (TIKTOKEN_CACHE_DIR or DATA_GYM_CACHE_DIR is set empty)"]
    try:
        data = tiktoken.load.read_file_cached(O200K_BASE_URL, O200K_BASE_SHA256)
    except (OSError, ValueError) as e:  # requests' errors are OSErrors; a hash mismatch is a ValueError
        raise TokenizerError(f"no o200k_base vocabulary found (looked in {', '.join(looked)}), and downloading it "
                             f"from {O200K_BASE_URL} failed ({_one_line(e)}). {DOWNLOAD_HINT}") from None
    if cached and os.path.isfile(cached):
        return cached
    return _private_copy(data)  # tiktoken caches nothing here (turned off, or its default folder is read-only)


def _one_line(error: Exception) -> str:
    # requests wraps urllib3's error, whose reason is what a reader needs ("Failed to resolve ...").
    reason = getattr(error.args[0], "reason", None) if error.args else None
    text = re.sub(r"^\w+\(.*?\): ", "", " ".join(str(reason or error).split())) or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


@functools.lru_cache(maxsize=1)
def _private_copy(data: bytes) -> str:
    """The downloaded vocabulary in a file of this process's own, removed when it exits."""
    import atexit

    fd, path = tempfile.mkstemp(prefix="gptoss-", suffix="-" + VOCAB_FILE)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    atexit.register(_remove, path)
    return path


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def _sha256(path: str) -> str:
    stat = os.stat(path)
    return _sha256_of(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    """Hashed once per version of the file: every request the server renders looks the vocabulary up."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _check_hash(path: str) -> None:
    digest = _sha256(path)
    if digest != O200K_BASE_SHA256:
        raise TokenizerError(f"{path}: sha256 {digest[:12]}... is not o200k_base's ({O200K_BASE_SHA256[:12]}...); "
                             f"the file is corrupt or a different vocabulary")


@contextlib.contextmanager
def _vocab_dir(path: str, name: str):
    """A temporary folder holding `path` under `name` (a symlink), for libraries that look files up by name."""
    with tempfile.TemporaryDirectory() as d:
        os.symlink(os.path.abspath(path), os.path.join(d, name))
        yield d


@contextlib.contextmanager
def _env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@functools.lru_cache(maxsize=None)
def _load(path: str) -> tiktoken.Encoding:
    _check_hash(path)
    # tiktoken's own o200k_harmony definition, fed from its cache layout, so nothing is hand-copied.
    with _vocab_dir(path, _cache_name()) as d, _env(TIKTOKEN_CACHE_DIR=d):
        return tiktoken.get_encoding("o200k_harmony")


def load_tokenizer(path: str | os.PathLike | None = None) -> tiktoken.Encoding:
    """tiktoken's `o200k_harmony` encoding (vocab 201088), from a hash-checked vocabulary (`find_vocab`)."""
    return _load(os.path.abspath(find_vocab(path)))


@functools.lru_cache(maxsize=None)
def _harmony(path: str):
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    _check_hash(path)
    with _vocab_dir(path, VOCAB_FILE) as d, _env(TIKTOKEN_ENCODINGS_BASE=d):
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def harmony_encoding(path: str | os.PathLike | None = None):
    """openai-harmony's GPT-OSS encoding, loaded from the same hash-checked vocabulary."""
    return _harmony(os.path.abspath(find_vocab(path)))


def render_prompt(messages: list, *, reasoning_effort: str = "medium", instructions: str | None = None,
                  tools: list | None = None, vocab: str | os.PathLike | None = None) -> list[int]:
    """Prompt tokens for the assistant's next reply, in the harmony format: the system message (with
    the reasoning effort), a developer message with `instructions` (what other chat APIs call the
    system prompt) and function `tools` (openai_harmony ToolDescriptions) when there are any, then
    `messages` (openai_harmony Messages), oldest first."""
    from openai_harmony import Conversation, DeveloperContent, Message, ReasoningEffort, Role, SystemContent

    verbatim = _Verbatim()
    messages = [verbatim.message(m) for m in messages]
    instructions = verbatim(instructions) if instructions else instructions
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning effort must be one of {', '.join(REASONING_EFFORTS)}, got {reasoning_effort!r}")
    effort = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}
    head = [Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_reasoning_effort(effort[reasoning_effort]))]
    if instructions or tools:
        developer = DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if tools:
            developer = developer.with_function_tools(tools)
        head.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    conversation = Conversation.from_messages(head + list(messages))
    tokens = list(harmony_encoding(vocab).render_conversation_for_completion(conversation, Role.ASSISTANT))
    return verbatim.restore(tokens, load_tokenizer(vocab))


@functools.lru_cache(maxsize=None)
def _first_special(encoding: tiktoken.Encoding) -> int:
    """The least id of the encoding's special tokens (every id from it on is one)."""
    return min(map(encoding.encode_single_token, encoding.special_tokens_set))


class _Verbatim:
    """Long texts that harmony writes verbatim, each swapped for a short placeholder while
    openai-harmony renders, then tokenized by tiktoken in its place: openai-harmony's tokenizer takes
    time quadratic in a word's length holding Python's lock (a 50 kB word: about a second on a CPU
    here, every other thread waiting), tiktoken's grows about linearly and lets other threads run.
    The tokens are the same: each stretch of ordinary tokens between two special ones that held a
    placeholder is encoded again whole, as harmony encodes it (tests/test_tokenizer.py checks the
    two renderings agree)."""

    def __init__(self):
        self._mark = "\ue000" + secrets.token_hex(8)  # a private-use character and a nonce: no client's text holds it
        self._pattern = re.compile(re.escape(self._mark) + r"(\d+)\ue001")
        self.texts: list[str] = []

    def __call__(self, text: str) -> str:
        if len(text) < VERBATIM_LEAST:
            return text
        self.texts.append(text)
        return f"{self._mark}{len(self.texts) - 1}\ue001"

    def message(self, message):
        from openai_harmony import TextContent

        if not any(isinstance(c, TextContent) and len(c.text) >= VERBATIM_LEAST for c in message.content):
            return message
        return message.model_copy(update={"content": [TextContent(text=self(c.text)) if isinstance(c, TextContent)
                                                       else c for c in message.content]})

    def restore(self, tokens: list[int], encoding: tiktoken.Encoding) -> list[int]:
        if not self.texts:
            return tokens
        first_special = _first_special(encoding)
        out, run = [], []

        def flush():
            text = encoding.decode(run)
            if self._mark in text:
                out.extend(encoding.encode_ordinary(self._pattern.sub(lambda m: self.texts[int(m[1])], text)))
            else:
                out.extend(run)
            run.clear()

        for t in tokens:
            if t >= first_special:
                flush()
                out.append(t)
            else:
                run.append(t)
        flush()
        return out


def render_chat(turns: list[tuple[str, str]], *, reasoning_effort: str = "medium", instructions: str | None = None,
                vocab: str | os.PathLike | None = None) -> list[int]:
    """Prompt tokens for the assistant's next reply, in the harmony format (`render_prompt`).

    turns: ("user" | "assistant", text) pairs, oldest first; earlier assistant turns are rendered as
    final answers.
    """
    from openai_harmony import Message, Role

    messages = []
    for role, text in turns:
        if role == "user":
            messages.append(Message.from_role_and_content(Role.USER, text))
        elif role == "assistant":
            messages.append(Message.from_role_and_content(Role.ASSISTANT, text).with_channel("final"))
        else:
            raise ValueError(f"chat turns are 'user' or 'assistant', got {role!r}")
    return render_prompt(messages, reasoning_effort=reasoning_effort, instructions=instructions, vocab=vocab)


@dataclasses.dataclass
class Reply:
    analysis: str  # the reasoning channel, joined
    final: str  # the answer shown to a user
    messages: list  # openai_harmony Messages, for tool calls and other channels


def parse_reply(tokens: list[int], *, vocab: str | os.PathLike | None = None) -> Reply:
    """Split generated tokens (after the prompt's `<|start|>assistant`) into analysis and final channels.

    A reply cut short (no closing token) is parsed as far as it goes.
    """
    from openai_harmony import Role, StreamableParser

    parser = StreamableParser(harmony_encoding(vocab), role=Role.ASSISTANT)
    for token in tokens:
        parser.process(token)
    messages = list(parser.messages)
    channels: dict[str, list[str]] = {"analysis": [], "final": []}
    for message in messages:
        if message.channel in channels:
            channels[message.channel].append("".join(c.text for c in message.content))
    if parser.current_channel in channels and parser.current_content:  # unfinished last message
        channels[parser.current_channel].append(parser.current_content)
    return Reply("\n".join(channels["analysis"]), "\n".join(channels["final"]), messages)


MAX_HEADER_TOKENS = 32  # a message header longer than this is not harmony: the reply is raw text


class ReplyReader:
    """A reply read token by token as harmony (openai-harmony's StreamableParser), deciding as it goes
    whether it is harmony at all: a token the parser refuses, or a message header longer than
    MAX_HEADER_TOKENS, makes it raw text from then on (a model with random weights, say).

    `feed` -> "to_raw" (it just turned out not to be harmony), "raw" (it was not already), "header",
    "content" (then `channel`, `recipient` and `delta` say what the token added) or "end" (a message
    ended). `raw_text` holds every token's text, for the raw reply."""

    def __init__(self, tokenizer: tiktoken.Encoding, vocab: str | os.PathLike | None = None):
        from openai_harmony import Role, StreamableParser

        self._parser = StreamableParser(harmony_encoding(vocab), role=Role.ASSISTANT)
        self._decoder = StreamDecoder(tokenizer)
        self.raw_text: list[str] = []
        self.raw = False
        self.header_tokens = 0  # tokens of the message header being read

    def feed(self, token: int) -> str:
        self.raw_text.append(self._decoder.add(token))
        if self.raw:
            return "raw"
        try:
            self._parser.process(token)
        except Exception:  # openai_harmony's HarmonyError: not a harmony reply
            return self.give_up()
        state = self._parser.state.name
        if state == "HEADER":
            self.header_tokens += 1
            return self.give_up() if self.header_tokens > MAX_HEADER_TOKENS else "header"
        self.header_tokens = 0
        return "content" if state == "CONTENT" else "end"

    def give_up(self) -> str:
        """Read the reply as raw text from now on -> "to_raw"."""
        self.raw = True
        return "to_raw"

    def flush(self) -> str:
        """The raw text held back at the end (a character's bytes cut short)."""
        return self._decoder.flush()

    @property
    def channel(self) -> str | None:
        return self._parser.current_channel

    @property
    def recipient(self) -> str | None:
        """The message's recipient (None: none; openai-harmony reads a content type written after the
        channel, as in `<|channel|>final <|constrain|>json`, as a recipient: it is none)."""
        recipient = self._parser.current_recipient
        return None if recipient is not None and recipient.startswith("<|constrain|>") else recipient

    @property
    def delta(self) -> str:
        return self._parser.last_content_delta or ""


class StreamDecoder:
    """Token ids in, text out, never emitting a broken UTF-8 sequence: bytes of a character split
    across tokens are held back until the character is complete."""

    def __init__(self, tokenizer: tiktoken.Encoding):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token: int) -> str:
        return self._utf8.decode(self._tokenizer.decode_single_token_bytes(token))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
