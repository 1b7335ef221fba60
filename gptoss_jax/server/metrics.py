"""The engine's metrics (Engine.stats) as Prometheus text, with prometheus-client."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _EngineCollector:
    def __init__(self, stats: dict):
        self.stats = stats

    def collect(self):
        s = self.stats
        for name, key, doc in (("running_requests", "running", "requests running (each holding a slot)"),
                               ("waiting_requests", "waiting", "requests waiting for a slot or for KV pages, "
                                                               "preempted ones included"),
                               ("kv_slots_in_use", "slots_in_use", "slots in use: sequences running"),
                               ("kv_slots", "slots", "slots: the most sequences running at once"),
                               ("kv_pages", "pages", "pages in the KV cache's pool"),
                               ("kv_pages_in_use", "pages_in_use", "KV pages held by running sequences"),
                               ("kv_pages_cached", "pages_cached", "KV pages held by none, kept for prefix reuse"),
                               ("kv_page_size", "page_size", "positions a KV page holds"),
                               ("prefix_hit_rate", "prefix_hit_rate", "of the prompt tokens admitted since start, "
                                                                      "the share found in the KV cache"),
                               ("generated_tokens_per_second", "generated_tokens_per_s",
                                "generated tokens per second since start")):
            yield GaugeMetricFamily(f"gptoss_{name}", doc, value=s[key])
        for name, key, doc in (("scoring_passes", "scoring_passes", "echoed prompts' scoring passes asked for "
                                                                     "and not answered yet (one runs at a time)"),
                               ("stored_responses", "stored_responses", "Responses API objects stored"),
                               ("stored_response_bytes", "stored_response_bytes",
                                "bytes of the stored responses' JSON (gptoss-serve --store-mb caps it)")):
            if key in s:
                yield GaugeMetricFamily(f"gptoss_{name}", doc, value=s[key])
        yield CounterMetricFamily("gptoss_prompt_tokens", "prompt tokens admitted", value=s["prompt_tokens"])
        yield CounterMetricFamily("gptoss_cached_prompt_tokens", "prompt tokens found in the KV cache (not computed)",
                                  value=s["cached_prompt_tokens"])
        yield CounterMetricFamily("gptoss_preemptions", "sequences sent back to waiting when the KV cache ran out "
                                                        "of pages", value=s["preemptions"])
        yield CounterMetricFamily("gptoss_kv_pages_evicted", "cached KV pages reused for other sequences",
                                  value=s["pages_evicted"])
        yield CounterMetricFamily("gptoss_generated_tokens", "tokens generated", value=s["generated_tokens"])
        for key, doc in (("draft_tokens", "drafted tokens checked by speculative steps"),
                         ("accepted_draft_tokens", "drafted tokens the model agreed with"),
                         ("speculative_steps", "steps that checked drafts"),
                         ("drafting_steps", "steps that drafted (on the host: that waited for the step "
                                            "before's tokens; on the device: every step of a call)")):
            yield CounterMetricFamily(f"gptoss_{key}", doc, value=s[key])
        yield CounterMetricFamily("gptoss_rejected_requests", "requests refused with a full queue",
                                  value=s["rejected"])
        finished = CounterMetricFamily("gptoss_finished_requests", "finished requests by how they ended",
                                       labels=["reason"])
        for reason, n in sorted(s["finished"].items()):
            finished.add_metric([reason], n)
        yield finished
        if "model_requests" in s:
            by_model = CounterMetricFamily("gptoss_model_requests", "requests taken, by the model they asked for "
                                                                    "(the base model's name, or a LoRA adapter's)",
                                           labels=["model"])
            for model, n in sorted(s["model_requests"].items()):
                by_model.add_metric([model], n)
            yield by_model
        for name, key in (("time_to_first_token_seconds", "time_to_first_token_s"),
                          ("inter_token_latency_seconds", "inter_token_latency_s")):
            g = GaugeMetricFamily(f"gptoss_{name}", f"{name.replace('_', ' ')}, percentiles over the latest 10,000",
                                  labels=["quantile"])
            for q, v in s[key].items():
                if v is not None:
                    g.add_metric([str(int(q[1:]) / 100)], v)
            yield g


def prometheus_text(stats: dict) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(stats))
    return generate_latest(registry)
