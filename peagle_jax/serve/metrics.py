"""Prometheus metrics (one registry per app, so several servers can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
                    3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                 0.3, 0.5, 0.75, 1.0, 2.5)


class Metrics:
    def __init__(self, num_draft_tokens: int, max_batch_size: int):
        self.registry = r = CollectorRegistry()
        self.http_requests = Counter(
            "peagle_http_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r)
        self.requests = Counter(
            "peagle_requests", "Finished generation requests (one per choice) by finish reason",
            ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("peagle_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("peagle_generation_tokens", "Generated tokens", registry=r)
        self.rounds = Counter(
            "peagle_spec_rounds", "Speculative rounds summed over active sequences (target forwards)", registry=r)
        self.engine_steps = Counter("peagle_engine_steps", "Batched rounds run by the engine", registry=r)
        self.accepted = Counter(
            "peagle_draft_accepted", "Rounds in which draft position i (1-based) was accepted; "
            "divide by peagle_spec_rounds_total for the per-position acceptance rate", ["position"], registry=r)
        for i in range(num_draft_tokens):
            self.accepted.labels(position=str(i + 1))
        k = max(num_draft_tokens, 1)
        self.acceptance_length = Histogram(
            "peagle_acceptance_length", "Tokens committed per sequence per round (accepted drafts + 1)",
            buckets=tuple(float(i) for i in range(1, k + 2)), registry=r)
        self.queue_depth = Gauge("peagle_queue_depth", "Requests waiting for a batch slot", registry=r)
        self.batch_occupancy = Gauge("peagle_batch_occupancy", "Batch slots in use", registry=r)
        self.batch_slots = Gauge("peagle_batch_slots", "Batch slots (max batch size)", registry=r)
        self.batch_slots.set(max_batch_size)
        self.batch_rows = Gauge("peagle_batch_rows", "Rows each round computes (the batch bucket that holds the "
                                "live sequences)", registry=r)
        self.batch_rows.set(1)
        self.batch_resizes = Counter("peagle_batch_resizes", "Moves of the live sequences to another batch bucket",
                                     registry=r)
        self.adaptive_rounds = Counter(
            "peagle_adaptive_rounds", "Rounds of an adaptive (--method auto) engine by its choice: speculate or a "
            "plain decode step", ["choice"], registry=r)
        self.round_seconds = Gauge(
            "peagle_round_seconds", "An adaptive engine's running mean of its round time, by batch rows and kind of "
            "round (what its choices compare)", ["rows", "round"], registry=r)
        self.ttft = Histogram(
            "peagle_time_to_first_token_seconds", "Arrival to first generated token", buckets=_LATENCY_BUCKETS,
            registry=r)
        self.tpot = Histogram(
            "peagle_time_per_output_token_seconds", "Mean time per generated token after the first, per request",
            buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(
            "peagle_request_latency_seconds", "Arrival to last token", buckets=_LATENCY_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
