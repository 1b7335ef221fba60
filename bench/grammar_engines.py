"""Grammar engines for structured outputs on the o200k_harmony vocabulary (201,088 tokens), on the CPU.

The server constrains a reply to a JSON schema by a token mask that the host CPU makes before each
pick (one bit a token). This benchmark compares three engines that make such masks, llguidance,
outlines-core and xgrammar, on three JSON schemas: a small object, a medium one (an enum, a nested
object, an array of strings, a boolean, a number) and any object (`{"type": "object"}`).

  import        time to import the engine's Python package (once per server start)
  vocab         time to build its tokenizer/vocabulary object (once per server start)
  compile       time from the schema to a matcher at its start (per request, or once per schema
                when the compiled grammar is cached); `new matcher` is the per-request part alone
  mask          time to fill one token mask (int32 words, one bit a token): the first one on a
                fresh matcher, then the mean, median and p99 over every token of an example document of
                the schema (the same tokens for every engine: tiktoken's tokens of the compact JSON,
                then the stop token), replayed `--repeats` times
  generations   `--generations` replies made by the engine's masks alone (a seeded random token
                among those allowed at each step, see Policy): how many parse as JSON, and how many
                validate against the schema (jsonschema)

The stop token is <|return|>, which ends a final answer; harmony's other special tokens must never be
allowed. JSON is compact (no free whitespace) in every engine. The engines differ in the
tokenizations they allow (llguidance only the canonical one within fixed text such as keys), so free
generations differ between engines; mask timings come from the shared example documents.

    python bench/grammar_engines.py                      # all engines, all schemas
    python bench/grammar_engines.py --engines llguidance --json /tmp/grammar_engines.json

An engine that is not installed (or fails) is reported with its error, and the others still run.
xgrammar needs torch, transformers and apache-tvm-ffi; llguidance and outlines-core need nothing else.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gptoss_jax import tokenizer as tk  # noqa: E402

ENGINES = ("llguidance", "outlines-core", "xgrammar")
STOP = tk.RETURN  # <|return|>

SCHEMAS = {
    "small": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "medium": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1},
            "title": {"type": "string", "maxLength": 40},
            "status": {"enum": ["draft", "review", "published", "archived"]},
            "author": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 30}, "email": {"type": "string"}},
                "required": ["name", "email"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 15}, "maxItems": 5},
            "public": {"type": "boolean"},
            "score": {"type": "number"},
            "summary": {"type": "string"},
        },
        "required": ["id", "title", "status", "author", "tags", "public", "score", "summary"],
        "additionalProperties": False,
    },
    "object": {"type": "object"},
}

# One valid document per schema; its tokens drive the mask timings of every engine.
EXAMPLES = {
    "small": {"name": "Ada Lovelace", "age": 36},
    "medium": {
        "id": 1042, "title": "Grammar engines on a 200k vocabulary", "status": "review",
        "author": {"name": "Ada Lovelace", "email": "ada@example.com"}, "tags": ["json", "llm", "cpu"],
        "public": True, "score": 0.875,
        "summary": "Token masks for structured outputs, measured on the host CPU for each step of decoding.",
    },
    "object": {
        "model": "gpt-oss-20b", "created": 1754006400,
        "choices": [{"index": 0, "text": "Hello, world! Ça va?", "logprobs": None}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 5}, "stream": False,
    },
}


def words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_ids(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids whose bit is set in an int32 mask (token t: bit t % 32 of word t // 32)."""
    bits = np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------- engines
# Each engine: `modules` to import (timed apart), __init__ builds the vocabulary object (timed), compile(schema) -> a compiled grammar,
# matcher(compiled) -> a matcher at the start, fill(matcher, out) writes a mask into out (int32,
# [words]), consume(matcher, token) -> False when the token is refused.


class LLGuidance:
    name, packages, modules = "llguidance", ("llguidance",), ("llguidance",)

    def __init__(self, enc):
        import llguidance
        import llguidance.numpy
        import llguidance.tiktoken

        self.ll, self.lnp = llguidance, llguidance.numpy
        self.tok = llguidance.tiktoken.lltokenizer_from_encoding(enc, eos_token=STOP)
        self.vocab_size = self.tok.vocab_size

    def compile(self, schema: dict):
        schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
        matcher = self.ll.LLMatcher(self.tok, self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matcher, out: np.ndarray) -> None:
        self.lnp.fill_next_token_bitmask(matcher, out.reshape(1, -1), 0)

    def consume(self, matcher, token: int) -> bool:
        return bool(matcher.consume_token(token)) and not matcher.is_error()


class OutlinesCore:
    name, packages, modules = "outlines-core", ("outlines_core",), ("outlines_core",)

    def __init__(self, enc):
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.oc, self.to_regex = outlines_core, build_regex_from_schema
        ids: dict[bytes, list[int]] = {}
        for piece, token in enc._mergeable_ranks.items():  # ordinary tokens only: no special token in text
            ids.setdefault(piece, []).append(token)
        self.vocab = outlines_core.Vocabulary(STOP, ids)
        self.vocab_size = enc.n_vocab

    def compile(self, schema: dict):
        return self.oc.Index(self.to_regex(json.dumps(schema), whitespace_pattern=""), self.vocab)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, matcher, out: np.ndarray) -> None:
        matcher.write_mask_into(out.ctypes.data, out.size, 4)

    def consume(self, matcher, token: int) -> bool:
        if token == STOP:  # the stop token ends the text; outlines-core has no state after it
            return matcher.is_finished()
        try:
            matcher.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True


class XGrammar:
    name, packages, modules = ("xgrammar", ("xgrammar", "apache-tvm-ffi", "torch", "transformers", "triton"),
                                ("xgrammar",))

    def __init__(self, enc):
        import xgrammar

        self.xgr = xgrammar
        # Special tokens as empty bytes: xgrammar then never allows them as text. (Given their names,
        # e.g. b"<|channel|>", it would allow them inside JSON strings.)
        vocab = [b""] * enc.n_vocab
        for piece, token in enc._mergeable_ranks.items():
            vocab[token] = piece
        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=enc.n_vocab, stop_token_ids=[STOP])
        self.compiler = xgrammar.GrammarCompiler(info)
        self.vocab_size = info.vocab_size

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, out: np.ndarray) -> None:
        matcher.fill_next_token_bitmask(out.reshape(1, -1))

    def consume(self, matcher, token: int) -> bool:
        return bool(matcher.accept_token(token))


ENGINE_CLASSES = {cls.name: cls for cls in (LLGuidance, OutlinesCore, XGrammar)}


# ---------------------------------------------------------------- driving a generation


class Policy:
    """Picks a reply's next token from the allowed ones, deterministic per seed: a random one, never
    the stop token while anything else is allowed. With probability `p_end` the pick prefers ending
    something: a token made only of the closing characters `"}]` with a quote in it (which ends a
    string), else another such token or one starting with `,`; otherwise it avoids empty containers
    (`{}`, `[]`). After `budget` tokens it steers to the end: the stop token if allowed, else a closing
    token (quoted ones first), else a `,` one, else any."""

    def __init__(self, enc, budget: int, p_end: float):
        self.budget, self.p_end = budget, p_end
        n = enc.n_vocab
        self.last_byte = np.zeros(n, np.uint8)
        self.quoted, self.closing, self.comma, self.pair, self.shut = (np.zeros(n, bool) for _ in range(5))
        for piece, token in enc._mergeable_ranks.items():
            self.last_byte[token] = piece[-1]
            self.closing[token] = not piece.strip(b'"}]')  # only closing characters
            self.quoted[token] = self.closing[token] and b'"' in piece
            self.comma[token] = piece.startswith(b",")
            self.pair[token] = b"{}" in piece or b"[]" in piece  # an empty container in itself
            self.shut[token] = piece[:1] in (b"}", b"]")  # empties the container just opened

    def start(self, seed: int) -> None:
        self.rng, self.after_opening = np.random.default_rng(seed), False

    def pick(self, step: int, allowed: np.ndarray) -> int:
        end, draw = self.rng.random(), int(self.rng.integers(1 << 62))  # the same draws every step
        others = allowed[allowed != STOP]
        if len(others) < len(allowed) and (step >= self.budget or len(others) == 0):
            return STOP
        if step >= self.budget:
            ok = others
            choices = [ok[self.quoted[ok]], ok[self.closing[ok]], ok[self.comma[ok]], ok]
        else:
            ok = others[~(self.pair[others] | (self.after_opening & self.shut[others]))]
            ends = [ok[self.quoted[ok]], ok[self.closing[ok] | self.comma[ok]]] if end < self.p_end else []
            choices = ends + [ok, others]
        choice = next(c for c in choices if len(c))
        token = int(choice[draw % len(choice)])
        self.after_opening = self.last_byte[token] in b"{["
        return token


def drive(engine, compiled, tokens: list[int] | None = None, policy: Policy | None = None, seed: int = 0,
          max_tokens: int = 300) -> dict:
    """One reply on a fresh matcher: a mask before each token (timed), then the next of `tokens` (a
    replay) or the policy's pick -> {"tokens", "mask_s", "stopped", "error"}."""
    matcher = engine.matcher(compiled)
    out = np.zeros(words(engine.vocab_size), np.int32)
    picked, mask_s, error, stopped = [], [], None, False
    if policy is not None:
        policy.start(seed)
    for step in range(max_tokens if tokens is None else len(tokens)):
        out[:] = 0
        t0 = time.perf_counter()
        engine.fill(matcher, out)
        mask_s.append(time.perf_counter() - t0)
        allowed = allowed_ids(out, engine.vocab_size)
        if tokens is None and len(allowed) == 0:
            error = f"no token allowed at step {step}"
            break
        token = tokens[step] if tokens is not None else policy.pick(step, allowed)
        if not np.any(allowed == token) or not engine.consume(matcher, token):
            error = f"token {token} refused at step {step}"
            break
        picked.append(token)
        if token == STOP:
            stopped = True
            break
    return {"tokens": picked, "mask_s": mask_s, "stopped": stopped, "error": error}


def check_text(enc, tokens: list[int], schema: dict) -> dict:
    """The reply's text, whether it parses as JSON, and whether it validates against the schema."""
    import jsonschema

    raw = b"".join(enc.decode_single_token_bytes(t) for t in tokens if t != STOP)
    result = {"text": raw.decode("utf-8", "replace"), "json": False, "valid": False, "problem": None}
    try:
        value = json.loads(raw.decode("utf-8"))
    except ValueError as e:
        result["problem"] = f"not JSON: {e}"
        return result
    result["json"] = True
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        result["problem"] = f"not valid: {e.message}"
        return result
    result["valid"] = True
    return result


def example_tokens(enc, name: str) -> list[int]:
    text = json.dumps(EXAMPLES[name], separators=(",", ":"), ensure_ascii=False)
    return enc.encode(text) + [STOP]


def bench_schema(engine, enc, name: str, policy: Policy, args) -> dict:
    schema = SCHEMAS[name]
    t0 = time.perf_counter()
    compiled = engine.compile(schema)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.matcher(compiled)
    new_matcher_s = time.perf_counter() - t0

    tokens = example_tokens(enc, name)
    replays = [drive(engine, compiled, tokens=tokens) for _ in range(args.repeats)]
    masks = [s for run in replays for s in run["mask_s"]]
    replies = [drive(engine, compiled, policy=policy, seed=args.seed + i, max_tokens=args.max_tokens)
               for i in range(args.generations)]
    checks = [{**check_text(enc, run["tokens"], schema), "n_tokens": len(run["tokens"]),
               "stopped": run["stopped"], "drive_error": run["error"]} for run in replies]
    return {
        "engine": engine.name, "schema": name,
        "compile_s": compile_s, "new_matcher_s": new_matcher_s,
        "example_tokens": len(tokens), "example_error": replays[0]["error"],
        "first_mask_s": replays[0]["mask_s"][0],
        "mask_mean_s": statistics.fmean(masks), "mask_median_s": statistics.median(masks), "mask_p99_s": float(np.percentile(masks, 99)),
        "masks": len(masks),
        "generation_mask_median_s": statistics.median(s for run in replies for s in run["mask_s"]),
        "generations": checks,
    }


def bench_engine(name: str, enc, policy: Policy, args) -> dict:
    cls = ENGINE_CLASSES[name]
    report = {"engine": name, "versions": {p: version(p) for p in cls.packages}, "error": None, "schemas": []}
    try:
        t0 = time.perf_counter()
        for module in cls.modules:
            importlib.import_module(module)
        report["import_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine = cls(enc)
        report["vocab_build_s"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 -- an engine that cannot start is reported, not fatal
        report["error"] = f"{type(e).__name__}: {e}"
        return report
    for schema_name in args.schemas:
        try:
            result = bench_schema(engine, enc, schema_name, policy, args)
        except Exception as e:  # noqa: BLE001
            result = {"engine": name, "schema": schema_name, "error": f"{type(e).__name__}: {e}"}
        report["schemas"].append(result)
        print(f"  {name} / {schema_name}: {result.get('error') or result.get('example_error') or 'done'}",
              file=sys.stderr, flush=True)
        for i, check in enumerate(result.get("generations", [])):
            if check["problem"] or check["drive_error"]:
                print(f"    reply {i}: {check['drive_error'] or check['problem']}  {check['text'][:120]!r}",
                      file=sys.stderr)
    return report


# ---------------------------------------------------------------- report


def table(reports: list[dict]) -> str:
    us, ms = (lambda s: f"{s * 1e6:.0f}"), (lambda s: f"{s * 1e3:.1f}")
    lines = ["| engine | schema | import (s) | vocab (s) | compile (ms) | new matcher (µs) | first mask (µs) "
             "| mask mean (µs) | mask p50 (µs) | mask p99 (µs) | example tokens | replies JSON | replies valid |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for report in reports:
        if report["error"]:
            lines.append(f"| {report['engine']} | – | failed: {report['error'][:100]} |" + " |" * 10)
            continue
        start = f"{report['import_s']:.2f} | {report['vocab_build_s']:.2f}"
        for r in report["schemas"]:
            if "error" in r:
                lines.append(f"| {r['engine']} | {r['schema']} | {start} | failed: {r['error'][:100]} |" + " |" * 8)
                continue
            n = len(r["generations"])
            example = f"{r['example_tokens']}" + (f" ({r['example_error']})" if r["example_error"] else "")
            lines.append(
                f"| {r['engine']} | {r['schema']} | {start} | {ms(r['compile_s'])} | {us(r['new_matcher_s'])} "
                f"| {us(r['first_mask_s'])} | {us(r['mask_mean_s'])} | {us(r['mask_median_s'])} | {us(r['mask_p99_s'])} | {example} "
                f"| {sum(c['json'] for c in r['generations'])}/{n} | {sum(c['valid'] for c in r['generations'])}/{n} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=None,
                        help="o200k_base.tiktoken (file or folder); default: the usual places (gptoss_jax.tokenizer)")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--schemas", nargs="+", choices=list(SCHEMAS), default=list(SCHEMAS))
    parser.add_argument("--repeats", type=int, default=5,
                        help="replays of each example document for the mask timings (default 5)")
    parser.add_argument("--generations", type=int, default=10,
                        help="replies generated by each engine per schema for the validity check (default 10)")
    parser.add_argument("--budget", type=int, default=60, help="reply tokens before steering to the end (default 60)")
    parser.add_argument("--p-end", type=float, default=0.3,
                        help="chance that a reply's step prefers a closing or comma token (default 0.3)")
    parser.add_argument("--max-tokens", type=int, default=300, help="longest reply (default 300)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first reply (then seed+1, ...)")
    parser.add_argument("--json", metavar="PATH", help="write all results (with the replies' texts) here")
    args = parser.parse_args(argv)

    try:
        enc = tk.load_tokenizer(args.tokenizer)
    except tk.TokenizerError as e:
        parser.error(str(e))
    print(f"tokenizer {enc.name}, {enc.n_vocab} tokens; stop token {STOP} <|return|>", file=sys.stderr)
    policy = Policy(enc, args.budget, args.p_end)
    reports = [bench_engine(name, enc, policy, args) for name in args.engines]
    if args.json:
        Path(args.json).write_text(json.dumps({"vocab_size": enc.n_vocab, "args": vars(args), "reports": reports},
                                              indent=2, ensure_ascii=False))
    versions = ", ".join(f"{p} {v}" for rep in reports for p, v in rep["versions"].items() if v)
    print(f"\nCPU, o200k_harmony ({enc.n_vocab} tokens); {versions}\n")
    print(table(reports))


if __name__ == "__main__":
    main()
