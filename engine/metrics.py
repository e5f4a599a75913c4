"""Prometheus metrics of one engine, in a registry of its own (several engines may share a process
in tests, and the default registry would mix them)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
        self.waiting = Gauge("engine_requests_waiting", "Sequences waiting for a KV slot", labels, registry=r)
        self.weights_seconds = Gauge("engine_weights_load_seconds", "Time to map or load the weights",
                                     ("model", "source"), registry=r)
        self.ready = Gauge("engine_ready", "1 while the engine admits requests", labels, registry=r)
        self.model = model
        for family in (self.prompt_tokens, self.generation_tokens, self.running, self.waiting, self.ready):
            family.labels(model)  # export every series from the start, at zero

    def outcome(self, outcome: str) -> None:
        self.requests.labels(self.model, outcome).inc()

    def set_queue(self, running: int, waiting: int) -> None:
        """Called from the engine thread after each step (prometheus_client is thread-safe)."""
        self.running.labels(self.model).set(running)
        self.waiting.labels(self.model).set(waiting)

    def render(self) -> bytes:
        return generate_latest(self.registry)
