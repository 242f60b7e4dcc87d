"""``/metrics``: the gateway's own histograms and counters, plus the workers' exported
metrics labelled by replica, as one valid Prometheus page."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.conftest import Gateway
from tests.polling import eventually

MODEL = "smollm2-135m-instruct"


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_metrics_cover_gateway_and_workers(gateway: Gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as http:
        before = _samples((await http.get("/metrics")).text)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        for stream in (True, False):
            resp = await http.post("/v1/chat/completions", json={**body, "stream": stream})
            assert resp.status_code == 200
        refused = await http.post(
            "/v1/chat/completions", json=body, headers={"X-Latency-Budget-Ms": "0"}
        )

        async def exported() -> bool:
            # Workers export every few seconds: wait for one that counts these claims.
            text = (await http.get("/metrics")).text
            return _claims(_samples(text)) >= 2

        await eventually(exported, timeout_s=15, every_s=0.5)
        page = await http.get("/metrics")
    assert page.headers["content-type"].startswith("text/plain")
    after = _samples(page.text)  # parses: the page is valid exposition

    def delta(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("charserve_ttft_seconds_count", priority="interactive") == 2
    assert delta("charserve_e2e_seconds_count", priority="interactive") == 2
    assert delta("charserve_itl_seconds_count", priority="interactive") >= 4
    assert delta("charserve_requests_total", priority="interactive", outcome="completed") == 2
    admitted = [
        v - before.get(k, 0.0)
        for k, v in after.items()
        if k[0] == "charserve_admission_total" and ("decision", "admitted") in k[1]
    ]
    assert sum(admitted) == 2
    if refused.status_code == 429:
        assert (
            delta(
                "charserve_admission_total",
                priority="interactive",
                decision="rejected",
                reason=refused.headers["x-charserve-drop-reason"],
            )
            == 1
        )
    claims = [dict(k[1]) for k in after if k[0] == "charserve_worker_claims_total"]
    assert claims and all("replica" in labels for labels in claims)


def _claims(samples: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> float:
    return sum(v for k, v in samples.items() if k[0] == "charserve_worker_claims_total")
