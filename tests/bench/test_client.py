"""Both API flavours against the fake server: parsing, timing, errors."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from bench.client import Target
from bench.runner import Arrivals, RunResult, run_load
from bench.stats import summarize
from bench.workloads import RequestSpec, Session, WorkloadConfig, build_workload
from tests.bench.fake_server import FakeServer

StartFake = Callable[..., FakeServer]

TTFT_S, ITL_S = 0.08, 0.02
SLACK_S = 0.03  # scheduling noise allowed on a busy machine; delays never come early


def sessions(num_requests: int, max_tokens: int, name: str = "random") -> list[Session]:
    return build_workload(WorkloadConfig(name, num_requests, seed=1, max_tokens=max_tokens))


def run(
    server: FakeServer, api: str, work: list[Session], arrivals: Arrivals | None = None, **kwargs: object
) -> RunResult:
    target = Target(url=server.url, api=api)
    arrivals = arrivals or Arrivals(concurrency=4)
    return asyncio.run(run_load(target, work, arrivals, is_progress_shown=False, **kwargs))  # type: ignore[arg-type]


@pytest.mark.parametrize("api", ["openai", "chat", "native"])
def test_known_delays_give_known_ttft_itl_and_e2e(fake_server: StartFake, api: str) -> None:
    server = fake_server(ttft_s=TTFT_S, itl_s=ITL_S)
    result = run(server, api, sessions(8, max_tokens=6))
    assert all(record.is_ok for record in result.records), result.records
    for record in result.records:
        assert record.output_tokens == 6
        assert len(record.itl_s) == 5
        assert record.ttft_s is not None and record.e2e_s is not None
        assert TTFT_S - 0.002 <= record.ttft_s <= TTFT_S + SLACK_S
        # one late event shortens the next gap, so single gaps get slack both ways; their sum cannot
        assert all(abs(gap - ITL_S) <= SLACK_S for gap in record.itl_s)
        assert sum(record.itl_s) >= 5 * ITL_S - 0.002
        assert record.e2e_s >= record.ttft_s + sum(record.itl_s) - 1e-6
    prompts: list[str] = [
        body.get("prompt") or body.get("inputs") or body["messages"][0]["content"] for body in server.bodies
    ]
    reported = sorted(record.server_prompt_tokens or 0 for record in result.records)
    assert reported == sorted(len(prompt.split()) for prompt in prompts)  # the fake counts words
    summary = summarize(result.records, result.duration_s, result.num_planned)
    assert summary["ttft_ms"]["p50"] == pytest.approx(TTFT_S * 1000, abs=SLACK_S * 1000)
    assert summary["itl_ms"]["p50"] == pytest.approx(ITL_S * 1000, abs=SLACK_S * 1000)
    assert summary["e2e_ms"]["p50"] == pytest.approx((TTFT_S + 5 * ITL_S) * 1000, abs=2 * SLACK_S * 1000)
    assert summary["num_output_tokens"] == 48
    # 8 requests, 4 at a time, ~0.18 s each: two waves
    assert summary["output_tokens_per_s"] == pytest.approx(48 / result.duration_s)
    assert 0.3 <= result.duration_s <= 0.3 + 4 * SLACK_S


def test_openai_body_and_model_from_v1_models(fake_server: StartFake) -> None:
    server = fake_server(ttft_s=0.0, itl_s=0.0)
    run(server, "openai", sessions(2, max_tokens=3))
    assert set(server.paths) == {"/v1/completions"}
    body = server.bodies[0]
    assert body["model"] == "fake-model"
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 3
    assert "ignore_eos" not in body


def test_chat_body_sends_the_prompt_as_one_user_message(fake_server: StartFake) -> None:
    server = fake_server(ttft_s=0.0, itl_s=0.0)
    result = run(server, "chat", sessions(2, max_tokens=3))
    assert set(server.paths) == {"/v1/chat/completions"}
    specs = [spec for session in sessions(2, max_tokens=3) for spec in session]
    assert sorted(body["messages"][0]["content"] for body in server.bodies) == sorted(s.prompt for s in specs)
    body = server.bodies[0]
    assert len(body["messages"]) == 1 and body["messages"][0]["role"] == "user"
    assert "prompt" not in body
    assert body["model"] == "fake-model"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    # the role-only first chunk is no token event: 3 tokens, 2 gaps
    assert [(record.output_tokens, len(record.itl_s)) for record in result.records] == [(3, 2), (3, 2)]


def test_several_models_are_sent_in_turn(fake_server: StartFake) -> None:
    server = fake_server(ttft_s=0.0, itl_s=0.0)
    target = Target(url=server.url, api="openai", model="base,adapter-0,adapter-1")
    asyncio.run(run_load(target, sessions(7, max_tokens=2), Arrivals(concurrency=1), is_progress_shown=False))
    by_prompt = {body["prompt"]: body["model"] for body in server.bodies}
    specs = [spec for session in sessions(7, max_tokens=2) for spec in session]
    assert [by_prompt[spec.prompt] for spec in specs] == ["base", "adapter-0", "adapter-1"] * 2 + ["base"]


def test_native_body(fake_server: StartFake) -> None:
    server = fake_server(ttft_s=0.0, itl_s=0.0)
    run(server, "native", sessions(2, max_tokens=3))
    assert set(server.paths) == {"/generate_stream"}
    assert server.bodies[0]["parameters"] == {"max_new_tokens": 3}
    assert isinstance(server.bodies[0]["inputs"], str)


def test_native_ttft_waits_for_the_first_non_empty_token(fake_server: StartFake) -> None:
    server = fake_server(ttft_s=0.0, itl_s=0.05, num_empty_first_tokens=2)
    result = run(server, "native", sessions(1, max_tokens=5))
    record = result.records[0]
    assert record.is_ok and record.ttft_s is not None
    assert record.ttft_s >= 0.1 - 0.002  # the third token event is the first with text
    assert len(record.itl_s) == 2
    assert record.output_tokens == 5  # details.generated_tokens counts the held-back ones too


def test_429_and_other_statuses_are_counted_by_kind(fake_server: StartFake) -> None:
    statuses = {1: 429, 3: 429, 4: 503}
    server = fake_server(ttft_s=0.0, itl_s=0.0, status_for=lambda n: statuses.get(n, 200))
    result = run(server, "native", sessions(6, max_tokens=2), Arrivals(concurrency=1))
    summary = summarize(result.records, result.duration_s, result.num_planned)
    assert summary["num_completed"] == 3
    assert summary["num_rejected_429"] == 2
    assert summary["errors_by_kind"] == {"429": 2, "503": 1}
    rejected = [record for record in result.records if record.error_kind == "429"]
    assert [record.status for record in rejected] == [429, 429]
    assert "fake status 429" in (rejected[0].error or "")


@pytest.mark.parametrize("api", ["openai", "native"])
def test_error_event_and_cut_stream_are_stream_errors(fake_server: StartFake, api: str) -> None:
    server = fake_server(ttft_s=0.0, itl_s=0.0, stream_error_after=1)
    record = run(server, api, sessions(1, max_tokens=4)).records[0]
    assert (record.is_ok, record.error_kind, record.error) == (False, "stream", "fake failure")
    server.behaviour.stream_error_after = None
    server.behaviour.is_stream_cut = True
    record = run(server, api, sessions(1, max_tokens=4)).records[0]
    assert (record.is_ok, record.error_kind) == (False, "stream")


def test_refused_connection_is_a_connection_error() -> None:
    target = Target(url="http://127.0.0.1:9", api="native")
    result = asyncio.run(
        run_load(target, sessions(2, max_tokens=2), Arrivals(concurrency=2), is_progress_shown=False)
    )
    assert [record.error_kind for record in result.records] == ["connection", "connection"]


def test_timeout_is_counted(fake_server: StartFake) -> None:
    server = fake_server(ttft_s=1.0, itl_s=0.0)
    record = run(server, "openai", sessions(1, max_tokens=2), timeout_s=0.2).records[0]
    assert record.error_kind == "timeout"


def test_concurrency_bounds_requests_in_flight(fake_server: StartFake) -> None:
    server = fake_server(ttft_s=0.02, itl_s=0.005)
    result = run(server, "native", sessions(12, max_tokens=3), Arrivals(concurrency=3))
    assert server.max_in_flight == 3
    assert len(result.records) == 12


def test_chat_turns_go_in_order_within_a_session(fake_server: StartFake) -> None:
    server = fake_server(ttft_s=0.01, itl_s=0.0)
    work = sessions(8, max_tokens=2, name="chat")
    result = run(server, "native", work, Arrivals(request_rate=float("inf")))
    assert server.max_in_flight == 2  # two chats at once, one turn of each at a time
    by_session: dict[int, list[float]] = {}
    for record in result.records:
        by_session.setdefault(record.session, []).append(record.start_s)
    assert all(starts == sorted(starts) for starts in by_session.values())
    prompts = [body["inputs"] for body in server.bodies]
    assert {spec.prompt for session in work for spec in session} == set(prompts)


def test_duration_stops_new_requests(fake_server: StartFake) -> None:
    server = fake_server(ttft_s=0.05, itl_s=0.0)
    result = run(server, "native", sessions(100, max_tokens=1), Arrivals(concurrency=2), duration_s=0.2)
    assert 2 <= len(result.records) <= 12
    assert result.num_planned == 100


def test_warmup_requests_are_sent_but_not_recorded(fake_server: StartFake) -> None:
    server = fake_server(ttft_s=0.0, itl_s=0.0)
    warmup = [RequestSpec(-1, -1, 0, "warm up", 2, 1)]
    result = run(server, "native", sessions(3, max_tokens=1), warmup=warmup)
    assert len(server.bodies) == 4
    assert len(result.records) == 3
