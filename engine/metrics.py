"""Prometheus metrics of one engine, in a registry of its own (several engines may share a process
in tests, and the default registry would mix them).

Names follow docs/metrics.md: the prefix ``failover_engine_``, counters end in ``_total``, base
units; the queue and KV gauges take the stems of vLLM's (``vllm:num_requests_running`` ->
``failover_engine_num_requests_running``, ``vllm:kv_cache_usage_perc`` -> ``..._kv_cache_usage_perc``,
a 0-1 fraction as there) and its ``model_name`` label, so a vLLM dashboard's queries carry over by
swapping the prefix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from engine.llm_engine import KVUsage

PREFIX = "failover_engine_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class EngineMetrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        r, labels, p = self.registry, ("model_name",), PREFIX
        # prometheus_client appends _total to a Counter's name itself
        self.requests = Counter(p + "requests", "Requests finished, by outcome (stop, length, disconnect, "
                                "error)", ("model_name", "outcome"), registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", labels, registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first generated token",
                              labels, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between generated tokens",
                             labels, buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge(p + "num_requests_running", "Sequences in the running batch", labels, registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Sequences waiting for KV blocks", labels, registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_perc", "Fraction of the KV pool's blocks in use (0-1)",
                              labels, registry=r)
        self.kv_bytes = Gauge(p + "kv_cache_bytes", "Bytes of the KV pool (per rank)", labels, registry=r)
        self.kv_blocks_total = Gauge(p + "kv_cache_blocks", "Blocks in the KV pool", labels, registry=r)
        self.kv_blocks_used = Gauge(p + "kv_cache_blocks_used", "KV blocks held by running sequences", labels,
                                    registry=r)
        self.preemptions = Counter(p + "num_preemptions", "Sequences preempted for KV blocks (recomputed later)",
                                   labels, registry=r)
        self._preemptions_seen = 0
        self.weights_seconds = Gauge(p + "weights_load_seconds", "Time to map or load the weights",
                                     ("model_name", "source"), registry=r)
        self.ready = Gauge(p + "ready", "1 while the engine admits requests", labels, registry=r)
        self.graphs = Gauge(p + "cuda_graph_buckets", "Step buckets (decode batches, then prefill rows) replayed from a CUDA graph "
                            "(captured after ready; 0 = eager)", labels, registry=r)
        self.model = model
        for family in (self.prompt_tokens, self.generation_tokens, self.running, self.waiting, self.ready,
                       self.kv_usage, self.kv_bytes, self.kv_blocks_total, self.kv_blocks_used, self.preemptions,
                       self.graphs):
            family.labels(model)  # export every series from the start, at zero

    def outcome(self, outcome: str) -> None:
        self.requests.labels(self.model, outcome).inc()

    def set_queue(self, running: int, waiting: int, kv: KVUsage) -> None:
        """Called from the engine thread after each step (prometheus_client is thread-safe)."""
        m = self.model
        self.running.labels(m).set(running)
        self.waiting.labels(m).set(waiting)
        self.kv_bytes.labels(m).set(kv.bytes)
        self.kv_blocks_total.labels(m).set(kv.blocks_total)
        self.kv_blocks_used.labels(m).set(kv.blocks_used)
        self.kv_usage.labels(m).set(kv.blocks_used / kv.blocks_total if kv.blocks_total else 0.0)
        self.preemptions.labels(m).inc(kv.preemptions - self._preemptions_seen)
        self._preemptions_seen = kv.preemptions

    def set_graphs(self, captured: int) -> None:
        self.graphs.labels(self.model).set(captured)

    def render(self) -> bytes:
        return generate_latest(self.registry)
