"""Prometheus metrics of one engine, in a registry of its own (several engines may share a process
in tests, and the default registry would mix them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from engine.llm_engine import KVUsage

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class EngineMetrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ("model",)
        self.requests = Counter("engine_requests", "Requests finished, by outcome", ("model", "outcome"), registry=r)
        self.prompt_tokens = Counter("engine_prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter("engine_generation_tokens", "Tokens generated", labels, registry=r)
        self.ttft = Histogram("engine_time_to_first_token_seconds", "Arrival to first generated token",
                              labels, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("engine_inter_token_latency_seconds", "Time between generated tokens",
                             labels, buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("engine_requests_running", "Sequences in the running batch", labels, registry=r)
        self.waiting = Gauge("engine_requests_waiting", "Sequences waiting for KV blocks", labels, registry=r)
        self.kv_bytes = Gauge("engine_kv_pool_bytes", "Bytes of the KV pool (per rank)", labels, registry=r)
        self.kv_blocks_total = Gauge("engine_kv_pool_blocks", "Blocks in the KV pool", labels, registry=r)
        self.kv_blocks_used = Gauge("engine_kv_blocks_used", "KV blocks held by running sequences", labels,
                                    registry=r)
        self.kv_blocks_free = Gauge("engine_kv_blocks_free", "KV blocks free", labels, registry=r)
        self.preemptions = Counter("engine_preemptions", "Sequences preempted for KV blocks (recomputed later)",
                                   labels, registry=r)
        self._preemptions_seen = 0
        self.weights_seconds = Gauge("engine_weights_load_seconds", "Time to map or load the weights",
                                     ("model", "source"), registry=r)
        self.ready = Gauge("engine_ready", "1 while the engine admits requests", labels, registry=r)
        self.graphs = Gauge("engine_cuda_graph_buckets", "Decode batch buckets replayed from a CUDA graph "
                            "(captured after ready; 0 = eager)", labels, registry=r)
        self.model = model
        for family in (self.prompt_tokens, self.generation_tokens, self.running, self.waiting, self.ready,
                       self.kv_bytes, self.kv_blocks_total, self.kv_blocks_used, self.kv_blocks_free,
                       self.preemptions, self.graphs):
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
        self.kv_blocks_free.labels(m).set(kv.blocks_total - kv.blocks_used)
        self.preemptions.labels(m).inc(kv.preemptions - self._preemptions_seen)
        self._preemptions_seen = kv.preemptions

    def set_graphs(self, captured: int) -> None:
        self.graphs.labels(self.model).set(captured)

    def render(self) -> bytes:
        return generate_latest(self.registry)
