"""Seeded workloads: what to send (prompts, output lengths), grouped into sessions.

A workload is a list of sessions; a session is a list of requests sent one after another (a chat is one
session of 4 turns, every other workload has sessions of one request). Arrivals apply to sessions: with
`--request-rate` new sessions arrive at that rate, with `--concurrency C` C workers each run one session at
a time.

Prompts are seeded random English words (`repeat`: seeded picks of the hand-written texts of
`bench.repeat_texts`), so the same `--seed` gives the same requests byte for byte on every machine. Without
a tokenizer one word counts as one token (the words are common ones that Llama-family and GPT tokenizers
encode as one token with its leading space), so lengths are approximate; with `--tokenizer tokenizer.json`
prompts are cut to the exact token count.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.repeat_texts import CODE, PROSE

WORKLOADS = ("mixed", "long-prompts", "bursts", "shared-prefix", "chat", "random", "repeat")

WORKLOAD_HELP = {
    "mixed": "prompts 16-2048 tokens and outputs 16-512 tokens, log-uniform",
    "long-prompts": "one request in 8 has a 4,000-token prompt (32 output tokens) among short ones (64-256)",
    "bursts": "prompts 64-512, outputs 32-256, in bursts of --burst-size at --request-rate on average",
    "shared-prefix": "one ~600-token prefix for all, then a short distinct question (16-48); outputs 32-128",
    "chat": "4-turn chats, each turn's prompt holds the previous turns; user turns 32-128, outputs 32-160",
    "random": "unrelated random prompts 64-1024 (a 0%% prefix-hit workload), outputs 32-256",
    "repeat": "copy a Python function or two paragraphs with one rename (prompts 150-210 tokens as chat), "
    "up to 256 tokens; send it with --api chat",
}

LONG_PROMPT_TOKENS = 4000
SHARED_PREFIX_TOKENS = 600
CHAT_TURNS = 4
REPEAT_OUTPUT_TOKENS = 256  # more than the longest passage (about 190 tokens): a faithful copy ends by itself

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but "
    "have an they you were her she there one all we their has been if more when will would who so "
    "no time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book eye "
    "job word business issue side kind head house service friend father power hour game line end "
    "member law car city community name president team minute idea body back parent face level "
    "office door health person art war history party result change morning reason research girl "
    "moment air teacher force education river light small large long great little old new good high "
    "other early young important few public bad same able last late hard major better best free "
    "strong whole clear run make know take see come think look want give use find tell ask seem "
    "feel try leave call keep begin help show hear play move live believe bring happen write "
    "provide sit stand lose pay meet include continue set learn lead understand watch follow stop "
    "create speak read spend grow open walk win offer remember love consider appear buy wait serve "
    "die send expect build stay fall cut reach kill remain suggest raise pass sell require report "
    "decide pull color music food road paper market field table plan stone tree garden window "
    "summer winter autumn spring island mountain ocean forest valley bridge train letter voice song"
).split()


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: its prompt and how many tokens to ask for."""

    index: int
    """Position in the workload, 0-based; records keep it."""
    session: int
    """The session (chat) it belongs to."""
    turn: int
    """0-based turn inside its session."""
    prompt: str
    prompt_tokens: int
    """Planned prompt length in tokens (exact with a tokenizer, else approximate)."""
    max_tokens: int
    """Output tokens asked for (`max_tokens` / `max_new_tokens`)."""


Session = list[RequestSpec]


class TextSource:
    """Seeded text of a given length in tokens; exact when a `tokenizer.json` is given."""

    def __init__(self, tokenizer_path: Path | None = None) -> None:
        self.tokenizer = None
        if tokenizer_path is not None:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(tokenizer_path))

    def words(self, rng: random.Random, num_words: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(num_words))

    def text(self, rng: random.Random, num_tokens: int) -> str:
        """Random words that make about `num_tokens` tokens (exactly, up to re-encoding, with a tokenizer)."""
        if self.tokenizer is None:
            return self.words(rng, num_tokens)
        text = self.words(rng, num_tokens)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        while len(ids) < num_tokens:
            text += " " + self.words(rng, num_tokens - len(ids))
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return self.tokenizer.decode(ids[:num_tokens])

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return round(math.exp(rng.uniform(math.log(low), math.log(high))))


@dataclass(frozen=True)
class WorkloadConfig:
    """What `build_workload` needs; the CLI fills it from flags."""

    name: str
    num_requests: int
    seed: int = 0
    max_tokens: int | None = None
    """When set, every request asks for exactly this many output tokens instead of the workload's lengths."""
    tokenizer_path: Path | None = None
    max_prompt_tokens: int | None = None
    """When set, single-prompt workloads (mixed, long-prompts, bursts, random) draw no longer prompts: a way
    to scale a workload down to a slow machine while keeping its shape."""
    max_output_tokens: int | None = None
    """When set, drawn output lengths are capped at this (unlike `max_tokens`, they still vary)."""


class _Builder:
    """Makes the specs of one workload, numbering requests and sessions as it goes."""

    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.source = TextSource(config.tokenizer_path)
        self.sessions: list[Session] = []
        self.num_requests = 0

    def output_len(self, drawn: int) -> int:
        """`drawn` (capped by `--max-output-tokens`) unless `--max-tokens` overrides it (drawn anyway, so
        prompts stay the same)."""
        if self.config.max_tokens is not None:
            return self.config.max_tokens
        return min(drawn, self.config.max_output_tokens or drawn)

    def add(self, session: Session, prompt: str, max_tokens: int, prompt_tokens: int | None = None) -> None:
        if prompt_tokens is None:
            prompt_tokens = self.source.count(prompt)
        session.append(
            RequestSpec(
                self.num_requests, len(self.sessions), len(session), prompt, prompt_tokens, max_tokens
            )
        )
        self.num_requests += 1

    def single(self, prompt_tokens: int, max_tokens: int) -> None:
        prompt_tokens = min(prompt_tokens, self.config.max_prompt_tokens or prompt_tokens)
        session: Session = []
        self.add(session, self.source.text(self.rng, prompt_tokens), max_tokens, prompt_tokens)
        self.sessions.append(session)


def _mixed(b: _Builder) -> None:
    while b.num_requests < b.config.num_requests:
        b.single(_log_uniform(b.rng, 16, 2048), b.output_len(_log_uniform(b.rng, 16, 512)))


def _long_prompts(b: _Builder) -> None:
    while b.num_requests < b.config.num_requests:
        if b.num_requests % 8 == 3:
            b.single(LONG_PROMPT_TOKENS, b.output_len(32))
        else:
            b.single(b.rng.randint(64, 256), b.output_len(b.rng.randint(64, 256)))


def _bursts(b: _Builder) -> None:
    while b.num_requests < b.config.num_requests:
        b.single(b.rng.randint(64, 512), b.output_len(b.rng.randint(32, 256)))


def _random(b: _Builder) -> None:
    while b.num_requests < b.config.num_requests:
        b.single(b.rng.randint(64, 1024), b.output_len(b.rng.randint(32, 256)))


def _shared_prefix(b: _Builder) -> None:
    prefix = "You are a helpful assistant. Read the notes below, then answer the question.\n\n"
    prefix += b.source.text(b.rng, SHARED_PREFIX_TOKENS - b.source.count(prefix)) + "\n\n"
    prefix_tokens = b.source.count(prefix)
    while b.num_requests < b.config.num_requests:
        question_tokens = b.rng.randint(16, 48)
        question = f"Question {b.num_requests}: " + b.source.text(b.rng, question_tokens) + "?"
        session: Session = []
        max_tokens = b.output_len(b.rng.randint(32, 128))
        b.add(session, prefix + question, max_tokens, prefix_tokens + b.source.count(question))
        b.sessions.append(session)


def _chat(b: _Builder) -> None:
    """Each turn's prompt is the previous turn's prompt + a seeded assistant reply + the next user message.

    The replies are seeded text rather than what the server answered, so the prompts are the same on every
    server (what `compare` needs) and each turn's prompt starts with the whole previous prompt.
    """
    while b.num_requests < b.config.num_requests:
        session: Session = []
        history = ""
        for _ in range(min(CHAT_TURNS, b.config.num_requests - b.num_requests)):
            history += "User: " + b.source.text(b.rng, b.rng.randint(32, 128)) + "\nAssistant:"
            max_tokens = b.output_len(b.rng.randint(32, 160))
            b.add(session, history, max_tokens)
            history += " " + b.source.text(b.rng, max_tokens) + "\n"
        b.sessions.append(session)


def repeat_prompts() -> list[str]:
    """Every prompt of `repeat`: each code passage, and each prose passage followed by the next, with each of
    its changes asked for."""
    prompts = []
    for passage in CODE:
        for old, new in passage.changes:
            prompts.append(
                f"Copy this Python code line for line, changing only the name `{old}` to `{new}`:\n\n"
                f"```python\n{passage.text}```"
            )
    for index, passage in enumerate(PROSE):
        text = passage.text + "\n\n" + PROSE[(index + 1) % len(PROSE)].text
        for old, new in passage.changes:
            prompts.append(f'Copy this text word for word, changing only "{old}" to "{new}":\n\n{text}')
    return prompts


def _repeat(b: _Builder) -> None:
    """Answers that copy their prompt (what agents and coding assistants often ask for): the workload of
    prompt-lookup speculation. Requests draw from `repeat_prompts()` at random; greedy, a request that
    repeats an earlier prompt gets the same answer (and a prefix-cache hit), on every server alike."""
    prompts = repeat_prompts()
    while b.num_requests < b.config.num_requests:
        session: Session = []
        b.add(session, b.rng.choice(prompts), b.output_len(REPEAT_OUTPUT_TOKENS))
        b.sessions.append(session)


_BUILDERS: dict[str, Callable[[_Builder], None]] = {
    "mixed": _mixed,
    "long-prompts": _long_prompts,
    "bursts": _bursts,
    "shared-prefix": _shared_prefix,
    "chat": _chat,
    "random": _random,
    "repeat": _repeat,
}


def build_workload(config: WorkloadConfig) -> list[Session]:
    """The sessions of a workload, `config.num_requests` requests in all, the same for the same config."""
    if config.name not in _BUILDERS:
        raise ValueError(f"unknown workload {config.name!r}; choose one of {', '.join(WORKLOADS)}")
    if config.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {config.num_requests}")
    if config.max_tokens is not None and config.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {config.max_tokens}")
    builder = _Builder(config)
    _BUILDERS[config.name](builder)
    return builder.sessions
