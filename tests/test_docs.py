"""The documentation's snippets run as written, and its figures are the table of record's.

Every fenced block of README.md and docs/*.md names its language: `python` and `bash` blocks are
run, `text` blocks are not code. A block that cannot run here by nature (it needs the published
weights, a GPU, several hosts) has the line `<!-- not run: REASON -->` right above its fence; its
command lines are still parsed by their commands' own flag parsers. Everything else runs on the
CPU against what the README's set-up commands give, each block in a folder of its own that holds
the checkout's files:

- `python` blocks run as a script; a block that talks to 127.0.0.1:8000 runs while the server
  that the documentation starts (`gptoss-serve`, the demo model) is up.
- `bash` blocks run line by line. The set-up commands (`pip install -e .`, `pip install -e
  ".[serve]"`, `bash tests/run.sh`) are checked rather than run: this test runs inside what they
  set up. A line that starts the server is the server the client blocks talk to.
"""

import dataclasses
import glob
import importlib.metadata
import importlib.util
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import tomllib
import urllib.error
import urllib.request

import pytest

from conftest import VOCAB, needs_vocab, until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
LANGUAGES = ("python", "bash", "text")
MARKER = re.compile(r"<!-- not run: (.*) -->")
MAX_NOT_RUN = 12  # blocks that need real weights or hardware; the demo model should show the rest
PORT = 8000  # the documentation's address, as written
# One pytest-xdist worker runs this whole file (--dist loadfile, pyproject.toml): the server its client
# snippets talk to listens on that one port.
SNIPPET_TIMEOUT_S = 300  # a block, or a line of a bash block (the demo compiles in under a minute)
SERVER_READY_S = 300
SETUP = re.compile(r'(pip install -e (?:\.|"\.\[([a-z,]+)\]")|bash tests/run\.sh)\s*(?:&&\s*|#.*)?')


@dataclasses.dataclass(frozen=True)
class Block:
    file: str
    line: int  # of the opening fence, from 1
    language: str
    code: str
    not_run: str | None  # the marker's reason

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def needs_server(self) -> bool:
        return self.not_run is None and self.language == "python" and f":{PORT}" in self.code


def read_blocks(file: str) -> list[Block]:
    with open(os.path.join(ROOT, file)) as f:
        lines = f.read().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, language = i, lines[i][3:].strip()
            i += 1
            while i < len(lines) and lines[i] != "```":
                i += 1
            assert i < len(lines), f"{file}:{start + 1}: the block never closes"
            marker = MARKER.fullmatch(lines[start - 1]) if start else None
            blocks.append(Block(file, start + 1, language, "\n".join(lines[start + 1:i]) + "\n",
                                marker.group(1).strip() if marker else None))
        i += 1
    return blocks


BLOCKS = [b for f in FILES for b in read_blocks(f)]
RUN = [b for b in BLOCKS if b.not_run is None and b.language in ("python", "bash")]
NOT_RUN = [b for b in BLOCKS if b.not_run is not None]


def command_lines(code: str) -> list[str]:
    """A bash block's commands: continued lines joined, blank and comment lines left out."""
    joined = code.replace("\\\n", " ")
    return [line.strip() for line in joined.split("\n") if line.strip() and not line.strip().startswith("#")]


def strip_setup(line: str) -> tuple[list[tuple[str, str | None]], str]:
    """The set-up commands a line starts with, as (command, extras), and the rest of the line."""
    setup = []
    while m := SETUP.match(line):
        setup.append((m.group(1), m.group(2)))
        line = line[m.end():]
    return setup, line


def words(line: str) -> list[list[str]]:
    """A shell line's simple commands (split at &&, ||, ;, |), each without its redirections."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current, skip = [], [], False
    for token in lexer:
        if token in ("&&", "||", ";", "|", "&"):
            commands.append(current)
            current, skip = [], False
        elif token in (">", ">>", "<", "2>"):
            skip = True  # the redirection's target follows
        elif skip:
            skip = False
        else:
            current.append(token)
    return [c for c in commands + [current] if c]


def program(argv: list[str]) -> tuple[str | None, list[str]]:
    """Which of the project's commands argv runs ("generate", "serve", "finetune", "convert"), and its
    arguments; (None, argv) for any other program."""
    for prefix, name in ((["gptoss-generate"], "generate"), (["python", "run_inference.py"], "generate"),
                         (["gptoss-serve"], "serve"), (["python", "-m", "gptoss_jax.server"], "serve"),
                         (["gptoss-finetune"], "finetune"), (["python", "finetune.py"], "finetune"),
                         (["gptoss-convert"], "convert"), (["python", "-m", "convert"], "convert"),
                         (["python", "-m", "gptoss_jax.convert"], "convert")):
        if argv[:len(prefix)] == prefix:
            return name, argv[len(prefix):]
    return None, argv


def starts_server(argv: list[str]) -> bool:
    name, args = program(argv)
    return name == "serve" and not {"-h", "--help", "--version"} & set(args)


def check_setup(command: str, extras: str | None) -> None:
    """What a set-up command gives is here: this checkout installed, with the extra's packages."""
    if command == "bash tests/run.sh":
        return  # the test suite, which is running this
    spec = importlib.util.find_spec("gptoss_jax")
    assert spec and os.path.dirname(os.path.dirname(spec.origin)) == ROOT, f"{command}: gptoss_jax is not this checkout"
    for script in ("gptoss-generate", "gptoss-serve", "gptoss-convert", "gptoss-finetune"):
        assert any(os.path.exists(os.path.join(d, script)) for d in os.environ["PATH"].split(os.pathsep)), (
            f"{command}: the {script} command is not installed")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        optional = tomllib.load(f)["project"]["optional-dependencies"]
    for extra in (extras or "").split(",") if extras else []:
        assert extra in optional, f"{command}: pyproject.toml has no extra {extra!r}"
        for requirement in optional[extra]:
            name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)
            if name != "gptoss-jax":
                importlib.metadata.version(name)  # raises where the extra's package is missing


def env() -> dict:
    values = dict(os.environ, TIKTOKEN_ENCODINGS_BASE=os.path.dirname(os.path.abspath(VOCAB)), JAX_PLATFORMS="cpu",
                  PYTHONUNBUFFERED="1")
    values.pop("GPTOSS_API_KEY", None)  # the snippets talk to a server without a key
    return values


def workdir(tmp_path) -> str:
    """A folder holding the checkout's files (links), where a snippet may write what it likes."""
    for name in os.listdir(ROOT):
        if not name.startswith("."):
            os.symlink(os.path.join(ROOT, name), tmp_path / name)
    return str(tmp_path)


def run(argv: list[str], cwd: str, what: str, timeout: float = SNIPPET_TIMEOUT_S) -> str:
    """Run to the end within `timeout` (the whole process group is stopped past it); -> its output."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{what}: still running after {timeout} s\n{out[-3000:]}")
    assert proc.returncode == 0, f"{what}: exit code {proc.returncode}\n{out[-3000:]}"
    return out


# The server the documentation starts -----------------------------------------------------------

def server_argv() -> list[str]:
    """The command line that starts the server, the same in every block that starts one."""
    lines = {strip_setup(line)[1].split("#")[0].strip() for b in RUN if b.language == "bash"
             for line in command_lines(b.code) if any(starts_server(w) for w in words(strip_setup(line)[1]))}
    assert len(lines) == 1, f"the documentation should start the server one way, not {sorted(lines)}"
    return shlex.split(lines.pop())


def port_taken() -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: a closed port is free
        try:
            s.bind(("127.0.0.1", PORT))
        except OSError:
            return True
    return False


class Server:
    def __init__(self, tmp_path):
        self.argv, self.log_path, self.proc, self.skip, self.ready = server_argv(), tmp_path / "server.log", None, None, False
        if port_taken():
            self.skip = (f"port {PORT} is taken: the documentation's client snippets talk to a server on "
                         f"127.0.0.1:{PORT}, as written")
            return
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.argv, cwd=workdir(tmp_path), env=env(), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-3000:]

    def wait_ready(self) -> None:
        if self.skip:
            pytest.skip(self.skip)
        def answers() -> bool:
            if self.proc.poll() is not None:
                pytest.fail(f"{shlex.join(self.argv)} exited ({self.proc.returncode}) before it was ready\n{self.log()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=5) as r:
                    return r.status == 200
            except (urllib.error.URLError, OSError):
                return False

        try:
            self.ready = until(answers, f"{shlex.join(self.argv)} answered /health", SERVER_READY_S, every=0.5)
        except AssertionError as e:
            pytest.fail(f"{e}\n{self.log()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def server_started(request, tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("server"))
    yield server
    server.stop()


@pytest.fixture(scope="module", autouse=True)
def start_server_early(request):
    """The server compiles while the other blocks run, where any selected test needs it."""
    mine = [item for item in request.session.items if item.module is request.module]
    if os.path.isfile(VOCAB) and any("server" in item.fixturenames for item in mine):
        try:
            request.getfixturevalue("server_started")
        except AssertionError:
            pass  # reported by the tests that need the server, not by every test


@pytest.fixture
def server(server_started):
    server_started.wait_ready()
    return server_started


# The blocks ------------------------------------------------------------------------------------

def test_blocks_name_their_language_and_why_they_are_not_run():
    assert len(RUN) >= 10 and {b.file for b in RUN} >= {"README.md", "docs/serving.md"}
    for b in BLOCKS:
        assert b.language in LANGUAGES, (
            f"{b.id}: a block names its language, one of {', '.join(LANGUAGES)} (got {b.language!r})")
        assert b.not_run != "", f"{b.id}: say why the block is not run: <!-- not run: REASON -->"
        assert not (b.not_run and b.language == "text"), f"{b.id}: a text block is never run; drop its marker"
    for file in FILES:
        with open(os.path.join(ROOT, file)) as f:
            lines = f.read().split("\n")
        for i, line in enumerate(lines):
            if "not run" in line and line.startswith("<!--"):
                assert MARKER.fullmatch(line) and i + 1 < len(lines) and lines[i + 1].startswith("```"), (
                    f"{file}:{i + 1}: write the marker as <!-- not run: REASON --> right above a block's fence")
    for b in RUN:
        if re.search(r"\.(completions|responses)\.create\(", b.code):
            assert re.search(r"max_(tokens|completion_tokens|output_tokens)=", b.code), (
                f"{b.id}: set max_tokens: without it the demo model writes its whole context (minutes on a CPU)")
    assert len(NOT_RUN) <= MAX_NOT_RUN, (
        f"{len(NOT_RUN)} blocks are not run ({', '.join(b.id for b in NOT_RUN)}): show the demo model where "
        f"a real model is not needed")


def test_readme_snippets_are_the_ones_run():
    readme = [b for b in RUN if b.file == "README.md"]
    assert [b.language for b in readme] == ["bash", "python", "bash", "python"]
    assert "python run_inference.py" in readme[0].code and "ModelConfig.demo()" in readme[1].code
    assert server_argv() == ["gptoss-serve"] and readme[3].needs_server
    assert 'model="gpt-oss-demo"' in readme[3].code and "max_tokens=" in readme[3].code


@pytest.mark.slow
@needs_vocab
@pytest.mark.parametrize("block", [b for b in RUN if b.language == "python" and not b.needs_server], ids=lambda b: b.id)
def test_python_block_runs(block, tmp_path):
    (tmp_path / "snippet.py").write_text(block.code)
    run([sys.executable, "snippet.py"], workdir(tmp_path), block.id)


@pytest.mark.slow
@needs_vocab
@pytest.mark.parametrize("block", [b for b in RUN if b.needs_server], ids=lambda b: b.id)
def test_client_block_runs_against_the_server(block, tmp_path, server):
    (tmp_path / "snippet.py").write_text(block.code)
    run([sys.executable, "snippet.py"], workdir(tmp_path), f"{block.id} (against {shlex.join(server.argv)})")


@pytest.mark.slow
@needs_vocab
@pytest.mark.parametrize("block", [b for b in RUN if b.language == "bash" and not any(
    starts_server(w) for line in command_lines(b.code) for w in words(strip_setup(line)[1]))], ids=lambda b: b.id)
def test_bash_block_runs(block, tmp_path):
    cwd = workdir(tmp_path)
    for line in command_lines(block.code):
        setup, rest = strip_setup(line)
        for command, extras in setup:
            check_setup(command, extras)
        if rest.strip() and not rest.strip().startswith("#"):
            run(["bash", "-o", "pipefail", "-c", rest], cwd, f"{block.id}: {rest}")


@pytest.mark.slow
@needs_vocab
@pytest.mark.parametrize("block", [b for b in RUN if b.language == "bash" and any(
    starts_server(w) for line in command_lines(b.code) for w in words(strip_setup(line)[1]))], ids=lambda b: b.id)
def test_bash_block_starting_the_server_runs(block, tmp_path, server):
    # The server its line starts is up (the fixture started that line); its other lines run.
    cwd = workdir(tmp_path)
    for line in command_lines(block.code):
        setup, rest = strip_setup(line)
        for command, extras in setup:
            check_setup(command, extras)
        if any(starts_server(w) for w in words(rest)):
            assert shlex.split(rest.split("#")[0]) == server.argv
        elif rest.strip() and not rest.strip().startswith("#"):
            run(["bash", "-o", "pipefail", "-c", rest], cwd, f"{block.id}: {rest}")


@pytest.mark.slow
@needs_vocab
def test_servers_own_help_example_runs(tmp_path, server):
    # `gptoss-serve --help` ends with a client example: it works against the server as started.
    help_text = run(["gptoss-serve", "--help"], workdir(tmp_path), "gptoss-serve --help", timeout=60)
    lines = help_text.split("\n")
    start = next((i + 1 for i, line in enumerate(lines) if line.startswith("then, with the openai client")), None)
    assert start, f"gptoss-serve --help shows no client example:\n{help_text}"
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("  ")), len(lines))
    example = textwrap.dedent("\n".join(lines[start:end]))
    (tmp_path / "snippet.py").write_text("import openai\n" + example)
    run([sys.executable, "snippet.py"], str(tmp_path), "gptoss-serve --help's client example")


def _parsers():
    from gptoss_jax.cli import finetune, generate
    from gptoss_jax.server import cli as serve

    return {"generate": generate.build_parser, "serve": serve.build_parser, "finetune": finetune.build_parser}


@pytest.mark.parametrize("block", [b for b in NOT_RUN if b.language == "bash"], ids=lambda b: b.id)
def test_commands_not_run_take_their_flags(block, capsys):
    parsers, checked = _parsers(), 0
    for line in command_lines(block.code):
        pending = [strip_setup(line)[1]]
        while pending:
            for argv in words(pending.pop()):
                if argv[0] == "gcloud" and "--command" in argv:  # a command run on other machines
                    pending.append(argv[argv.index("--command") + 1])
                name, args = program(argv)
                if name in parsers:
                    try:
                        parsers[name]().parse_args(args)
                    except SystemExit as e:  # 0 for --help
                        if e.code:
                                pytest.fail(f"{block.id}: {shlex.join(argv)}: {capsys.readouterr().err.strip()}")
                    checked += 1
    if "gptoss-" in block.code or ".py" in block.code:
        assert checked, f"{block.id}: no command of the project's found to check"


# The figures -----------------------------------------------------------------------------------

NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def section(file: str, heading: str) -> str:
    with open(os.path.join(ROOT, file)) as f:
        text = f.read()
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end >= 0 else None]


def test_readme_figures_are_copied_from_the_table_of_record():
    record = section("docs/benchmarks.md", "## Figures of record")
    readme = section("README.md", "## How fast")
    table = [line for line in readme.split("\n") if line.startswith("|")]
    assert len(table) >= 5, "the README's table of figures is gone"
    for line in table:
        assert line in record.split("\n"), f"README.md's row is not the record's: {line}"
    for number in NUMBER.findall(readme):
        assert number in record, f"README.md, 'How fast', quotes {number}, which the table of record lacks"


def test_speeds_quoted_in_the_docs_are_measured_ones():
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        measured = f.read()
    quoted = re.compile(r"(\d[\d,]*(?:\.\d+)?)\s+(?:to\s+(\d[\d,]*(?:\.\d+)?)\s+)?(?:tokens/s|GiB\s+(?:per\s+GPU\s+)?at\s+peak)"
                        r"|peak(?:ed\s+at)?\s+(\d[\d,]*(?:\.\d+)?)\s+GiB")
    for file in FILES:
        if file == "docs/benchmarks.md":
            continue
        with open(os.path.join(ROOT, file)) as f:
            text = re.sub(r"^```.*?^```$", "", f.read(), flags=re.M | re.S)
        text = re.sub(r"`[^`]*`", "", text)  # code, or a command's own output quoted as an example
        for m in quoted.finditer(text):
            for number in filter(None, m.groups()):
                assert number in measured, f"{file}: {m.group(0)!r} is not a figure of docs/benchmarks.md"
