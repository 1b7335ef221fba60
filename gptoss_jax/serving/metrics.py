"""What the serving engine counts: tokens, requests by how they ended, time to first token and the
time between tokens (the latest 10,000 of each), reported as percentiles by `snapshot`."""

from __future__ import annotations

import collections
import time

import numpy as np

WINDOW = 10_000


class Metrics:
    def __init__(self):
        self.started = time.perf_counter()
        self.prompt_tokens = 0
        self.cached_tokens = 0  # of the prompt tokens, those found in the KV cache
        self.preemptions = 0  # sequences sent back to waiting when the KV cache ran out of pages
        self.generated_tokens = 0
        self.draft_tokens = self.accepted_draft_tokens = self.speculative_steps = 0  # speculation.py
        self.drafting_steps = 0  # steps that drafted: on the host, reading the step before's tokens; on the
        # devices, every step of a call (checked or not)
        self.finished = collections.Counter()  # finish reason -> requests
        self.rejected = 0  # submissions refused because the queue was full
        self.time_to_first_token = collections.deque(maxlen=WINDOW)
        self.inter_token = collections.deque(maxlen=WINDOW)

    def prompt(self, tokens: int, cached: int) -> None:
        """Count an admitted prompt and how many of its tokens were found in the cache."""
        self.prompt_tokens += tokens
        self.cached_tokens += cached

    def token(self, request) -> None:
        """Count the token the request has just received (the last of its `token_times`)."""
        self.generated_tokens += 1
        times = request.token_times
        if len(times) == 1:
            self.time_to_first_token.append(times[0] - request.submitted_at)
        else:
            self.inter_token.append(times[-1] - times[-2])

    def finish(self, request) -> None:
        self.finished[request.finish_reason] += 1

    def snapshot(self, **state) -> dict:
        """The counts, rates and latency percentiles (seconds), with the engine's `state` (running,
        waiting, slots in use, ...)."""
        elapsed = time.perf_counter() - self.started

        def percentiles(values):
            if not values:
                return {"p50": None, "p90": None, "p99": None}
            p = np.percentile(np.fromiter(values, float), [50, 90, 99])
            return {"p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2])}

        return {**state, "prompt_tokens": self.prompt_tokens, "cached_prompt_tokens": self.cached_tokens,
                "prefix_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
                "preemptions": self.preemptions, "generated_tokens": self.generated_tokens,
                "draft_tokens": self.draft_tokens, "accepted_draft_tokens": self.accepted_draft_tokens,
                "speculative_steps": self.speculative_steps, "drafting_steps": self.drafting_steps,
                "generated_tokens_per_s": self.generated_tokens / elapsed if elapsed > 0 else 0.0,
                "finished": dict(self.finished), "rejected": self.rejected,
                "time_to_first_token_s": percentiles(self.time_to_first_token),
                "inter_token_latency_s": percentiles(self.inter_token), "uptime_s": elapsed}
