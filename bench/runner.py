"""Send a workload to one target: arrivals, the duration bound, the progress bar.

Arrivals apply to sessions (see `workloads`): with a request rate, session i starts at a seeded offset
(Poisson: exponential gaps; bursts: `burst_size` sessions at once, bursts spaced so the mean rate holds;
`inf`: all at once); with a concurrency C, C workers each run one session at a time, back to back.
The turns of a session go one after another, each sent when the previous answer has ended. With a
duration, no request starts after it has passed; requests already sent run to their end.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

from bench.client import RequestRecord, Target, make_api, resolve_model, send_request
from bench.workloads import RequestSpec, Session


@dataclass(frozen=True)
class Arrivals:
    """How sessions arrive: exactly one of `request_rate` (open loop) and `concurrency` (closed loop)."""

    request_rate: float | None = None
    """Sessions per second; `math.inf` sends them all at once."""
    concurrency: int | None = None
    burst_size: int | None = None
    """With `request_rate`: sessions arrive in groups of this size instead of one by one."""

    def __post_init__(self) -> None:
        if (self.request_rate is None) == (self.concurrency is None):
            raise ValueError("give exactly one of --request-rate and --concurrency")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError(f"--request-rate must be > 0, got {self.request_rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.burst_size is not None and self.request_rate is None:
            raise ValueError("bursts need --request-rate (their mean rate), not --concurrency")

    def describe(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        rate = "all at once" if math.isinf(self.request_rate or 0) else f"{self.request_rate:g}/s"
        if self.burst_size is not None:
            return f"bursts of {self.burst_size}, {rate} on average"
        return f"Poisson {rate}"


def arrival_offsets(num_sessions: int, arrivals: Arrivals, seed: int) -> list[float]:
    """Seconds from the start at which each session starts (open loop only)."""
    rate = arrivals.request_rate
    assert rate is not None, "closed-loop runs have no arrival offsets"
    if math.isinf(rate):
        return [0.0] * num_sessions
    if arrivals.burst_size is not None:
        return [(i // arrivals.burst_size) * arrivals.burst_size / rate for i in range(num_sessions)]
    rng = random.Random(seed ^ 0x5EED)
    offsets, now = [], 0.0
    for _ in range(num_sessions):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


@dataclass
class RunResult:
    """The records of one run against one target."""

    target: Target
    records: list[RequestRecord]
    duration_s: float
    """From the first request sent to the last answer ended."""
    num_planned: int
    """Requests in the workload; fewer are sent when --duration ends the run first."""


class _Run:
    def __init__(self, http: aiohttp.ClientSession, target: Target, deadline: float, bar: tqdm) -> None:
        self.http = http
        self.api = make_api(target)
        self.deadline = deadline
        self.bar = bar
        self.records: list[RequestRecord] = []
        self.start = time.perf_counter()

    async def session(self, session: Session) -> None:
        for spec in session:
            if time.perf_counter() >= self.deadline:
                return
            record = await send_request(self.http, self.api, spec, self.start)
            self.records.append(record)
            self.bar.update(1)
            if not record.is_ok:
                self.bar.set_postfix(errors=sum(not r.is_ok for r in self.records))

    async def open_loop(self, sessions: list[Session], offsets: list[float]) -> None:
        tasks = []
        for session, offset in zip(sessions, offsets, strict=True):
            delay = self.start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if time.perf_counter() >= self.deadline:
                break
            tasks.append(asyncio.create_task(self.session(session)))
        await asyncio.gather(*tasks)

    async def closed_loop(self, sessions: list[Session], concurrency: int) -> None:
        queue = iter(sessions)

        async def worker() -> None:
            for session in queue:
                await self.session(session)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def run_load(
    target: Target,
    sessions: list[Session],
    arrivals: Arrivals,
    *,
    seed: int = 0,
    duration_s: float | None = None,
    timeout_s: float = 600.0,
    is_progress_shown: bool = True,
    warmup: list[RequestSpec] | None = None,
) -> RunResult:
    """Run `sessions` against `target`; `warmup` requests go first, one at a time, and are not recorded."""
    num_planned = sum(len(session) for session in sessions)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    # A connection per request: servers that close kept-alive connections after a few requests (llama.cpp's
    # llama-server does) would otherwise fail requests sent on a connection they just closed.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        target = await resolve_model(http, target)
        api = make_api(target)
        for spec in warmup or []:
            await send_request(http, api, spec, time.perf_counter())
        deadline = math.inf if duration_s is None else time.perf_counter() + duration_s
        with tqdm(total=num_planned, desc=target.name, unit="req", disable=not is_progress_shown) as bar:
            run = _Run(http, target, deadline, bar)
            if arrivals.concurrency is not None:
                await run.closed_loop(sessions, arrivals.concurrency)
            else:
                await run.open_loop(sessions, arrival_offsets(len(sessions), arrivals, seed))
            duration = time.perf_counter() - run.start
    records = sorted(run.records, key=lambda record: record.index)
    return RunResult(target, records, duration, num_planned)
