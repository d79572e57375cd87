"""Writes the provisioned Grafana dashboards from the panel lists below.

    python3 deploy/grafana/build_dashboards.py     # rewrites dashboards/*.json

The JSON files are committed (Grafana reads them); a test checks they match this file,
and another runs every panel's query against a real Prometheus scraping a real proxy.
"""

from __future__ import annotations

import json
import pathlib

HERE = pathlib.Path(__file__).parent
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}


def q(expr: str, legend: str = "") -> dict:
    return {"expr": expr, "legendFormat": legend}


def p99(metric: str, by: str = "", window: str = "5m", quantile: float = 0.99) -> str:
    labels = f"le, {by}" if by else "le"
    return f"histogram_quantile({quantile}, sum by ({labels}) (rate({metric}_bucket[{window}])))"


def p50_p99(metric: str, by: str) -> list[dict]:
    """The median and p99 of a histogram, one series each per value of label `by`."""
    return [q(p99(metric, by, quantile=0.5), f"p50 {{{{{by}}}}}"), q(p99(metric, by), f"p99 {{{{{by}}}}}")]


# (title, unit, [queries]) per panel, two per row.
PREFILL_GATE = [
    ("What the gate does with a large prefill next to live streams, per upstream", "short",
     [q("prefill_gate_upstream_mode == 1", "{{upstream}}: {{mode}}")]),
    ("Slicing: slices per second, each slice's largest protected gap (p95), the size ceiling", "short",
     [q("sum by (upstream) (rate(prefill_gate_slices_total[1m]))", "slices/s {{upstream}}"),
      q(p99("prefill_gate_slice_gap_seconds", quantile=0.95) + " * 1000", "gap p95 ms"),
      q("prefill_gate_slice_ceiling_tokens", "slice ceiling tokens (0: none) {{upstream}}")]),
    ("Live protected decodes per upstream", "short",
     [q("prefill_gate_live_decodes", "{{upstream}}")]),
    ("Large prefills queued / in flight", "short",
     [q("prefill_gate_queue_depth", "queued"),
      q("sum by (upstream) (prefill_gate_large_prefills_in_flight)", "in flight {{upstream}}")]),
    ("Large prefills: admitted at once vs held", "reqps",
     [q('sum by (decision) (rate(prefill_gate_admissions_total{class="large"}[1m]))', "{{decision}}")]),
    ("Queue wait (p50 / p95)", "s",
     [q(p99("prefill_gate_queue_wait_seconds", quantile=0.5), "p50"),
      q(p99("prefill_gate_queue_wait_seconds", quantile=0.95), "p95")]),
    ("TTFT by class (p50 / p99, measured by the proxy)", "s",
     p50_p99("prefill_gate_ttft_seconds", "class")),
    ("ITL by class (p50 / p99)", "s",
     p50_p99("prefill_gate_itl_seconds", "class")),
    ("Interactive ITL p99: with vs without a large prefill in flight", "s",
     [q('histogram_quantile(0.99, sum by (le, large_prefill_in_flight) '
        '(rate(prefill_gate_itl_seconds_bucket{class="interactive"}[5m])))',
        "large prefill in flight: {{large_prefill_in_flight}}")]),
    ("Estimated prompt tokens (p50 / p99) and in-flight prefill tokens", "short",
     [*p50_p99("prefill_gate_estimated_prompt_tokens", "class"),
      q("sum(prefill_gate_inflight_prefill_tokens)", "in flight")]),
    ("Token estimate error vs reported usage (median)", "percentunit",
     [q(p99("prefill_gate_estimate_relative_error", window="15m", quantile=0.5), "median")]),
    ("Requests by outcome", "reqps",
     [q("sum by (outcome) (rate(prefill_gate_requests_total[1m]))", "{{outcome}}")]),
    ("Upstream health (1 = passing)", "short",
     [q("prefill_gate_upstream_up", "{{upstream}}")]),
    ("Upstream errors by kind", "reqps",
     [q("sum by (kind) (rate(prefill_gate_upstream_errors_total[5m]))", "{{kind}}")]),
]

VLLM_ENGINE = [
    ("Requests running / waiting", "short",
     [q("sum by (instance) (vllm:num_requests_running)", "running {{instance}}"),
      q("sum by (instance) (vllm:num_requests_waiting)", "waiting {{instance}}")]),
    ("Token throughput", "short",
     [q("sum by (instance) (rate(vllm:prompt_tokens_total[1m]))", "prompt {{instance}}"),
      q("sum by (instance) (rate(vllm:generation_tokens_total[1m]))", "generated {{instance}}")]),
    ("Time to first token (p50 / p99)", "s",
     p50_p99("vllm:time_to_first_token_seconds", "instance")),
    ("Inter-token latency (p50 / p99)", "s",
     p50_p99("vllm:inter_token_latency_seconds", "instance")),
    ("KV cache usage", "percentunit",
     [q("max by (instance) (vllm:kv_cache_usage_perc)", "{{instance}}")]),
    ("Step pacing: steps by kind (engine_patches)", "short",
     [q("sum by (kind) (rate(prefill_gate_pacing_steps_total[1m]))", "{{kind}}"),
      q("sum(rate(prefill_gate_pacing_target_unreachable_steps_total[1m]))",
        "adaptive: target out of reach (CAP_TOKENS used)")]),
    ("Step pacing: prefill cap and prefill tokens per mixed step", "short",
     [q("max by (instance) (prefill_gate_pacing_cap_tokens)", "cap {{instance}}"),
      q(p99("prefill_gate_pacing_step_prefill_tokens", quantile=0.5, window="1m"), "p50 tokens")]),
    ("Step pacing: measured step time (p50 / p99)", "s",
     [q(p99("prefill_gate_pacing_step_seconds", quantile=0.5, window="1m"), "p50"),
      q(p99("prefill_gate_pacing_step_seconds", window="1m"), "p99")]),
]


def dashboard(uid: str, title: str, panels: list, description: str) -> dict:
    out = []
    for i, (ptitle, unit, queries) in enumerate(panels):
        out.append({
            "id": i + 1,
            "type": "timeseries",
            "title": ptitle,
            "datasource": DATASOURCE,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                        "tooltip": {"mode": "multi"}},
            "targets": [{**t, "refId": chr(ord("A") + j), "datasource": DATASOURCE}
                        for j, t in enumerate(queries)],
        })
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["prefill-gate"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": False,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "panels": out,
    }


DASHBOARDS = {
    "prefill-gate.json": dashboard(
        "prefill-gate", "prefill-gate", PREFILL_GATE,
        "The admission proxy: what it does per upstream (paced, sliced, held), slices, live "
        "decodes, held and admitted large prefills, queue wait, TTFT and ITL as the proxy "
        "measured them, estimate error."),
    "vllm-engine.json": dashboard(
        "prefill-gate-vllm", "vLLM engine", VLLM_ENGINE,
        "vLLM's own metrics, and step pacing's decisions from engine_patches."),
}


def render(name: str) -> str:
    return json.dumps(DASHBOARDS[name], indent=2) + "\n"


def main() -> None:
    for name in DASHBOARDS:
        (HERE / "dashboards" / name).write_text(render(name))


if __name__ == "__main__":
    main()
