"""``/metrics`` in Prometheus' text format with vLLM's metric names, so existing vLLM dashboards work.

Exported (each with ``model_name``): gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (0..1 of KV blocks in use); counters ``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, ``vllm:request_success_total{finished_reason}``,
``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (prompt tokens looked up / found in
the prefix cache: hit rate = hits / queries); histograms ``vllm:time_to_first_token_seconds``,
``vllm:inter_token_latency_seconds`` and ``vllm:e2e_request_latency_seconds``. zerospeed's own counters
follow as ``zerospeed_*``. Times are taken on the event loop when a token reaches the server (a few
microseconds per token; no extra work in the engine).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["Histogram", "ServerMetrics"]

_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
        0.75, 1.0, 2.5)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


@dataclass
class Histogram:
    """A cumulative Prometheus histogram over fixed upper bounds."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str, labels: str) -> Iterable[str]:
        run = 0
        for bound, c in zip(self.bounds, self.counts):
            run += c
            yield f'{name}_bucket{{{labels},le="{bound}"}} {run}'
        yield f'{name}_bucket{{{labels},le="+Inf"}} {self.n}'
        yield f"{name}_sum{{{labels}}} {self.total}"
        yield f"{name}_count{{{labels}}} {self.n}"


class ServerMetrics:
    """Per-request timing (submit, first token, each next token, end) and the counters vLLM exports."""

    def __init__(self) -> None:
        self.ttft, self.itl, self.e2e = Histogram(_TTFT), Histogram(_ITL), Histogram(_E2E)
        self.prompt_tokens = self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self._open: dict[int, list[float]] = {}  # uid -> [submitted, last token]

    def submitted(self, uid: int, prompt_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self._open[uid] = [time.perf_counter(), 0.0]

    def token(self, uid: int, finish_reason: str | None) -> None:
        t = self._open.get(uid)
        if t is None:
            return
        now = time.perf_counter()
        (self.itl if t[1] else self.ttft).observe(now - (t[1] or t[0]))
        t[1] = now
        self.generation_tokens += 1
        if finish_reason is not None:
            self.ended(uid, finish_reason)

    def ended(self, uid: int, reason: str) -> None:
        t = self._open.pop(uid, None)
        if t is not None:
            self.e2e.observe(time.perf_counter() - t[0])
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def render(self, model: str, gauges: dict[str, float], prefix_queries: int, prefix_hits: int) -> str:
        """The exposition text (vLLM's names); ``gauges``: running, waiting, kv usage."""
        lab = f'model_name="{model}"'
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, lines: Iterable[str]) -> None:
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *lines])

        metric("vllm:num_requests_running", "gauge", "Requests in the running batch.",
               [f"vllm:num_requests_running{{{lab}}} {gauges['running']}"])
        metric("vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
               [f"vllm:num_requests_waiting{{{lab}}} {gauges['waiting']}"])
        metric("vllm:kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (1 = full).",
               [f"vllm:kv_cache_usage_perc{{{lab}}} {gauges['kv_usage']}"])
        metric("vllm:prompt_tokens_total", "counter", "Prompt tokens processed.",
               [f"vllm:prompt_tokens_total{{{lab}}} {self.prompt_tokens}"])
        metric("vllm:generation_tokens_total", "counter", "Tokens generated.",
               [f"vllm:generation_tokens_total{{{lab}}} {self.generation_tokens}"])
        metric("vllm:request_success_total", "counter", "Finished requests by finish reason.",
               [f'vllm:request_success_total{{{lab},finished_reason="{r}"}} {c}' for r, c in
                sorted(self.finished.items())])
        metric("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
               [f"vllm:prefix_cache_queries_total{{{lab}}} {prefix_queries}"])
        metric("vllm:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
               [f"vllm:prefix_cache_hits_total{{{lab}}} {prefix_hits}"])
        for name, h, help_ in (("vllm:time_to_first_token_seconds", self.ttft, "Time to first token."),
                               ("vllm:inter_token_latency_seconds", self.itl, "Time between output tokens."),
                               ("vllm:e2e_request_latency_seconds", self.e2e, "Request latency.")):
            metric(name, "histogram", help_, h.lines(name, lab))
        return "\n".join(out) + "\n"
