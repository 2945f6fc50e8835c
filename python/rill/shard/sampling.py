"""Batched token choice: logit processing, greedy argmax or a seeded Gumbel-max draw, and logprobs.

Every step is a tensor op over all sampled rows at once; a row whose parameter is off gets the identity (bias
0, penalty 1, min_p 0, ...), so a row's result never depends on the other rows of the batch.

Processing order (`sample`), each step on the output of the one before:
  0. grammar (constrained decoding): tokens outside the row's allowed-token bitmask get -inf;
  1. logit_bias added;
  2. repetition_penalty (HF) over every earlier token of the sequence, prompt and generated: a seen token's
     positive logit is divided by it, a negative one multiplied;
  3. frequency_penalty and presence_penalty (OpenAI) over generated tokens only (history positions
     >= num_prompt_tokens): logit -= frequency * count + presence * (count > 0);
  4. min_new_tokens: stop_token_ids get -inf while fewer than min_new_tokens tokens have been generated;
  -> greedy rows take the argmax here;
  5. sampled rows only (HF warper order): temperature, top_k, top_p, min_p, typical_p;
  6. Gumbel-max draw with seeded noise.
`Generation.logprob` and top logprobs are always of the raw logits (log_softmax before any processing).

Reproducibility: the uniform noise for vocab entry j of the token at position p of a sequence with seed s is
u = hash(s, p, j), computed with integer tensor ops. It depends on nothing else in the batch, so a seed gives
the same output alone or batched, and the router can re-derive it after preempting and recomputing a sequence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rill.kernels.ops import KernelOps

_MASK32 = 0xFFFFFFFF
MAX_TOP_N_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How a sequence's next token is chosen (see `SamplingParams` in the proto). The "off" value of each
    processor is its default; repetition_penalty and typical_p also read 0 (proto unset) as off."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict, hash=False)
    min_p: float = 0.0
    typical_p: float = 1.0
    top_n_logprobs: int = 0
    num_prompt_tokens: int = 0
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()

    @property
    def has_repetition_penalty(self) -> bool:
        return self.repetition_penalty not in (0.0, 1.0)

    @property
    def needs_history(self) -> bool:
        """Whether choosing a token reads the sequence's earlier tokens (a penalty is on)."""
        return self.has_repetition_penalty or self.frequency_penalty != 0 or self.presence_penalty != 0

    def validate(self, vocab_size: int) -> None:
        """Raises ValueError naming the field for a value the shard cannot use."""
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty >= 0):
            raise ValueError(f"repetition_penalty must be > 0 (0 = off), got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.typical_p <= 1:
            raise ValueError(f"typical_p must be in (0, 1] (0 = off), got {self.typical_p}")
        if not 0 <= self.top_n_logprobs <= MAX_TOP_N_LOGPROBS:
            raise ValueError(
                f"top_n_logprobs must be in [0, {MAX_TOP_N_LOGPROBS}], got {self.top_n_logprobs}"
            )
        if self.num_prompt_tokens < 0 or self.min_new_tokens < 0:
            raise ValueError("num_prompt_tokens and min_new_tokens must be >= 0")
        bad_keys = sorted(t for t in self.logit_bias if not 0 <= t < vocab_size)
        if bad_keys:
            raise ValueError(f"logit_bias token ids {bad_keys[:5]} out of range [0, {vocab_size})")
        bad_values = [t for t, v in self.logit_bias.items() if not math.isfinite(v)]
        if bad_values:
            raise ValueError(f"logit_bias values must be finite, not for token ids {bad_values[:5]}")
        bad_stops = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad_stops:
            raise ValueError(f"stop_token_ids {bad_stops[:5]} out of range [0, {vocab_size})")
        if not self.do_sample:
            return
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] when sampling, got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2^64), got {self.seed}")


@dataclass(frozen=True)
class TokenCounts:
    """Per-row token counts over each row's history, for the penalties."""

    is_seen: torch.Tensor  # bool [rows, vocab]: the token is at any earlier position (prompt or generated)
    num_generated: torch.Tensor  # float32 [rows, vocab]: times the token was generated

    @classmethod
    def build(
        cls, histories: Sequence[Sequence[int]], num_prompt_tokens: torch.Tensor, vocab_size: int
    ) -> TokenCounts:
        """histories[i]: row i's token ids at positions 0, 1, ...; counted with one scatter_add per kind."""
        device = num_prompt_tokens.device
        max_len = max(1, max(len(h) for h in histories))
        padded = torch.tensor(
            [list(h) + [0] * (max_len - len(h)) for h in histories], dtype=torch.int64, device=device
        )
        lengths = torch.tensor([len(h) for h in histories], dtype=torch.int64, device=device)
        position = torch.arange(max_len, device=device)[None, :]
        is_valid = position < lengths[:, None]
        is_generated = is_valid & (position >= num_prompt_tokens[:, None])
        zeros = torch.zeros(len(histories), vocab_size, dtype=torch.float32, device=device)
        num_any = zeros.scatter_add(1, padded, is_valid.float())
        num_generated = zeros.scatter_add(1, padded, is_generated.float())
        return cls(is_seen=num_any > 0, num_generated=num_generated)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters as tensors, one row per sampled position. Each optional processor is
    skipped (a plain Python bool, no device sync) when no row of the batch uses it."""

    do_sample: torch.Tensor  # bool [rows]
    temperature: torch.Tensor  # float32 [rows]; 1.0 on greedy rows
    top_k: torch.Tensor  # int64 [rows]; 0 = no limit
    top_p: torch.Tensor  # float32 [rows]
    seed_lo: torch.Tensor  # int64 [rows]: low 32 bits of the seed
    seed_hi: torch.Tensor  # int64 [rows]: high 32 bits of the seed
    positions: torch.Tensor  # int64 [rows]: position of the token being generated
    repetition_penalty: torch.Tensor  # float32 [rows]; 1.0 = off
    frequency_penalty: torch.Tensor  # float32 [rows]
    presence_penalty: torch.Tensor  # float32 [rows]
    min_p: torch.Tensor  # float32 [rows]; 0 on greedy rows
    typical_p: torch.Tensor  # float32 [rows]; 1.0 = off, and on greedy rows
    bias_rows: torch.Tensor  # int64 [num_biases]: logit_bias entries of all rows, flattened
    bias_token_ids: torch.Tensor  # int64 [num_biases]
    bias_values: torch.Tensor  # float32 [num_biases]
    stop_rows: torch.Tensor  # int64 [num_stops]: stop_token_ids of rows that still need min_new_tokens
    stop_token_ids: torch.Tensor  # int64 [num_stops]
    counts: TokenCounts | None  # None when no row has a penalty
    grammar_rows: torch.Tensor  # int64 [num_constrained]: rows under a grammar
    grammar_words: torch.Tensor  # int64 [num_constrained, num_words]: their allowed-token bitmasks
    top_n_logprobs: list[int]  # per row
    has_min_p: bool
    has_typical_p: bool

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        positions: Sequence[int],
        device: torch.device,
        histories: Sequence[Sequence[int]] | None = None,
        vocab_size: int | None = None,
        allowed_token_bitmasks: Sequence[Sequence[int]] | None = None,
    ) -> SamplingBatch:
        """positions[i]: position of the token row i generates. histories[i]: row i's tokens at positions
        [0, positions[i]); needed (with vocab_size) only when a row has a penalty, read only for such rows.
        allowed_token_bitmasks[i]: row i's grammar mask as 32-bit words (empty: no grammar)."""

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        def when_sampling(p: SamplingParams, value: float, off: float) -> float:
            return value if p.do_sample else off

        bias = [(row, t, v) for row, p in enumerate(params) for t, v in p.logit_bias.items()]
        stops = [
            (row, t)
            for row, (p, position) in enumerate(zip(params, positions, strict=True))
            if position - p.num_prompt_tokens < p.min_new_tokens
            for t in p.stop_token_ids
        ]
        num_prompt_tokens = tensor([p.num_prompt_tokens for p in params], torch.int64)
        counts = None
        if any(p.needs_history for p in params):
            assert histories is not None and vocab_size is not None, "penalties need histories and vocab_size"
            rows_history = [h if p.needs_history else () for p, h in zip(params, histories, strict=True)]
            counts = TokenCounts.build(rows_history, num_prompt_tokens, vocab_size)
        masks = [(row, list(m)) for row, m in enumerate(allowed_token_bitmasks or ()) if len(m)]
        num_words = max((len(m) for _, m in masks), default=0)
        return cls(
            do_sample=tensor([p.do_sample for p in params], torch.bool),
            temperature=tensor([when_sampling(p, p.temperature, 1.0) for p in params], torch.float32),
            top_k=tensor([when_sampling(p, p.top_k, 0) for p in params], torch.int64),
            top_p=tensor([when_sampling(p, p.top_p, 1.0) for p in params], torch.float32),
            seed_lo=tensor([p.seed & _MASK32 for p in params], torch.int64),
            seed_hi=tensor([p.seed >> 32 for p in params], torch.int64),
            positions=tensor(list(positions), torch.int64),
            repetition_penalty=tensor(
                [p.repetition_penalty if p.has_repetition_penalty else 1.0 for p in params], torch.float32
            ),
            frequency_penalty=tensor([p.frequency_penalty for p in params], torch.float32),
            presence_penalty=tensor([p.presence_penalty for p in params], torch.float32),
            min_p=tensor([when_sampling(p, p.min_p, 0.0) for p in params], torch.float32),
            typical_p=tensor([when_sampling(p, p.typical_p or 1.0, 1.0) for p in params], torch.float32),
            bias_rows=tensor([row for row, _, _ in bias], torch.int64),
            bias_token_ids=tensor([t for _, t, _ in bias], torch.int64),
            bias_values=tensor([v for _, _, v in bias], torch.float32),
            stop_rows=tensor([row for row, _ in stops], torch.int64),
            stop_token_ids=tensor([t for _, t in stops], torch.int64),
            counts=counts,
            grammar_rows=tensor([row for row, _ in masks], torch.int64),
            grammar_words=tensor([m + [0] * (num_words - len(m)) for _, m in masks], torch.int64).reshape(
                len(masks), num_words
            ),
            top_n_logprobs=[p.top_n_logprobs for p in params],
            has_min_p=any(p.do_sample and p.min_p > 0 for p in params),
            has_typical_p=any(p.do_sample and 0 < p.typical_p < 1 for p in params),
        )


@dataclass(frozen=True)
class SampleOutput:
    token_ids: torch.Tensor  # int64 [rows]
    logprobs: torch.Tensor  # float32 [rows]: raw log_softmax at the chosen token
    top_token_ids: torch.Tensor  # int64 [rows, max top_n_logprobs], most likely first
    top_logprobs: torch.Tensor  # float32 [rows, max top_n_logprobs]; row i's first top_n_logprobs[i] count


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer on int64 tensors holding values in [0, 2^32). Multipliers are below 2^31, so
    products stay below 2^63 and nothing overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x1B873593) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(
    seed_lo: torch.Tensor, seed_hi: torch.Tensor, positions: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """u in (0, 1) of shape [rows, vocab], a pure function of (seed, position, vocab index)."""
    h = _mix32(_mix32(seed_lo ^ 0x2545F491) ^ seed_hi)
    h = _mix32(h ^ (positions & _MASK32))[:, None]
    vocab_index = torch.arange(vocab_size, dtype=torch.int64, device=positions.device)[None, :]
    h = _mix32(_mix32(h ^ vocab_index) ^ 0x5BD1E995)
    # (h >> 8) + 0.5 rounds up to 2^24 in float32 for the top value: clamp so u < 1, or the Gumbel noise
    # -log(-log(u)) is +inf and a token that processing set to -inf (a grammar mask, top-k) wins as NaN.
    return (((h >> 8).to(torch.float32) + 0.5) / float(1 << 24)).clamp(max=1.0 - 2.0**-24)


def allowed_tokens(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpacks bitmasks of 32-bit words [rows, num_words] into bool [rows, vocab_size]: token t is allowed
    when bit t % 32 of word t // 32 is set; tokens past the last word are not allowed."""
    shifts = torch.arange(32, dtype=torch.int64, device=words.device)
    bits = ((words[:, :, None] >> shifts) & 1).bool().reshape(words.shape[0], -1)
    if bits.shape[1] < vocab_size:
        bits = torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]), value=False)
    return bits[:, :vocab_size]


def apply_grammar(logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """Step 0: -inf on every token a constrained row's grammar does not allow; other rows unchanged."""
    is_allowed = torch.ones_like(logits, dtype=torch.bool)
    is_allowed[rows] = allowed_tokens(words, logits.shape[-1])
    return logits.masked_fill(~is_allowed, float("-inf"))


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Steps 0-4 of the module docstring (grammar, bias, repetition, frequency/presence, min_new_tokens),
    every row."""
    if batch.grammar_rows.numel():
        logits = apply_grammar(logits, batch.grammar_rows, batch.grammar_words)
    # Each step below copies [rows, vocab]: skipped when it would change nothing (the common greedy batch).
    if batch.bias_rows.numel():
        bias_values = batch.bias_values.to(logits.dtype)
        logits = logits.index_put((batch.bias_rows, batch.bias_token_ids), bias_values, accumulate=True)
    if batch.counts is not None:
        logits = apply_repetition_penalty(logits, batch.counts.is_seen, batch.repetition_penalty)
        logits = apply_frequency_presence_penalties(
            logits, batch.counts.num_generated, batch.frequency_penalty, batch.presence_penalty
        )
    if batch.stop_rows.numel():
        logits = logits.index_put((batch.stop_rows, batch.stop_token_ids), logits.new_tensor(float("-inf")))
    return logits


def warp_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Step 5 (temperature, top_k, top_p, min_p, typical_p); meaningful on sampled rows only."""
    logits = logits / batch.temperature[:, None]
    logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    if batch.has_min_p:
        logits = apply_min_p(logits, batch.min_p)
    if batch.has_typical_p:
        logits = apply_typical_p(logits, batch.typical_p)
    return logits


def apply_repetition_penalty(
    logits: torch.Tensor, is_seen: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """HF `RepetitionPenaltyLogitsProcessor`, batched: seen tokens' logits < 0 are multiplied by the row's
    penalty, the others divided; penalty 1.0 leaves a row as it is."""
    penalty = penalty[:, None]
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(is_seen, penalized, logits)


def apply_frequency_presence_penalties(
    logits: torch.Tensor, num_generated: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor
) -> torch.Tensor:
    """OpenAI: logit -= frequency * count + presence * (count > 0), count over generated tokens."""
    return logits - frequency[:, None] * num_generated - presence[:, None] * (num_generated > 0).float()


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Sets to -inf every logit outside its row's top-k and its row's top-p nucleus (ties broken by index)."""
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab_size, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)[:, None]
    is_removed = rank >= k
    sorted_logits = sorted_logits.masked_fill(is_removed, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep a token if the probability mass strictly before it is below top_p; the first token always stays.
    # top_p 1.0 keeps all: a float32 cumsum can reach 1.0 before the last token.
    mass_before = probs.cumsum(dim=-1) - probs
    is_removed = is_removed | ((mass_before >= top_p[:, None]) & (rank > 0) & (top_p < 1)[:, None])
    removed = torch.zeros_like(is_removed).scatter(-1, order, is_removed)
    return logits.masked_fill(removed, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose probability is below min_p times the row's top probability (the top token stays)."""
    probs = logits.softmax(dim=-1)
    is_removed = probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(is_removed, float("-inf"))


def apply_typical_p(logits: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    """HF `TypicalLogitsWarper` (min_tokens_to_keep=1), batched: keep the tokens whose surprisal is closest to
    the entropy until their mass reaches typical_p. Rows with typical_p 1.0 are returned unchanged."""
    log_probs = logits.log_softmax(dim=-1)
    entropy = -(log_probs * log_probs.exp()).nansum(dim=-1, keepdim=True)
    distance = (-log_probs - entropy).abs()
    sorted_distance, order = distance.sort(dim=-1, stable=True)
    cumulative = logits.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < typical_p[:, None]).sum(dim=-1, keepdim=True).clamp(max=logits.shape[-1] - 1)
    sorted_is_removed = sorted_distance > sorted_distance.gather(-1, last)
    sorted_is_removed[:, 0] = False
    is_removed = torch.zeros_like(sorted_is_removed).scatter(-1, order, sorted_is_removed)
    is_removed &= (typical_p < 1)[:, None]
    return logits.masked_fill(is_removed, float("-inf"))


def first_argmax(x: torch.Tensor, ops: KernelOps | None) -> torch.Tensor:
    """The index of each row's first maximum (int64 [rows]) of float32 x [rows, n]: with ops that provide it,
    their `argmax_rows` (the CPU's: a vectorised pass), else torch's max(dim=-1)."""
    if ops is not None and ops.provides("argmax_rows"):
        return ops.argmax_rows(x)
    return x.max(dim=-1).indices


def softmax_stats(x: torch.Tensor, ops: KernelOps | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's max and log(sum(exp(x - max))), float32 [rows] each: log_softmax(x)[:, j] =
    (x[:, j] - max) - log_sum, without the [rows, n] log-probabilities (with ops that provide it, their
    `softmax_stats`: on the CPU one vectorised pass per row)."""
    if ops is not None and ops.provides("softmax_stats"):
        return ops.softmax_stats(x)
    row_max = x.amax(dim=-1)
    return row_max, (x - row_max[:, None]).exp().sum(dim=-1).log()


def sample(logits: torch.Tensor, batch: SamplingBatch, ops: KernelOps | None = None) -> SampleOutput:
    """logits: raw float32 [rows, vocab]. Processes them (module docstring order), then greedy rows take the
    argmax and sampled rows a seeded Gumbel-max draw. Logprobs are of the raw distribution. `ops`: the model's
    kernels, whose row reductions (argmax, softmax statistics) run where they provide them."""
    processed = process_logits(logits, batch)
    tokens = first_argmax(processed, ops)
    if bool(batch.do_sample.any()):
        filtered = warp_logits(processed, batch)
        noise = uniform_noise(batch.seed_lo, batch.seed_hi, batch.positions, logits.shape[-1])
        gumbel = -torch.log(-torch.log(noise))
        sampled = first_argmax(filtered + gumbel, ops)
        tokens = torch.where(batch.do_sample, sampled, tokens)
    row_max, log_sum = softmax_stats(logits, ops)
    top_logits, top_token_ids = logits.topk(max(batch.top_n_logprobs, default=0), dim=-1)
    return SampleOutput(
        token_ids=tokens,
        logprobs=(logits.gather(-1, tokens[:, None]).squeeze(-1) - row_max) - log_sum,
        top_token_ids=top_token_ids,
        top_logprobs=(top_logits - row_max[:, None]) - log_sum[:, None],
    )
