"""Internal request types and `BatchState`: one forward call's flattened, validated inputs.

`BatchState.prepare` checks a `ForwardRequest` against the model and the KV pool and builds the tensors the
forward pass needs. It raises ValueError, naming the sequence and field, for anything a caller can get wrong;
nothing is mutated before validation passes. `TokenHistory` is the per-sequence token record penalties read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rill.shard.sampling import SamplingParams


@dataclass(frozen=True)
class SequenceChunk:
    """One sequence's part of a forward call (see `SequenceChunk` in the proto)."""

    id: int
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    sample: bool
    params: SamplingParams | None = None
    # Sent with params only: the token ids at positions [0, num_computed_tokens), for penalties.
    cached_token_ids: list[int] = field(default_factory=list)
    # With sample, under a grammar: the tokens allowed next, as 32-bit words (empty: all allowed).
    allowed_token_bitmask: list[int] = field(default_factory=list)
    # Sent with params only: the LoRA adapter the sequence runs with (an id LoadAdapter loaded; 0 = none).
    adapter_id: int = 0
    # With sample: the last k token_ids are proposals (speculative decoding); the chunk's last k + 1 positions
    # are each sampled as if the tokens before them had been generated, one Generation each.
    num_speculative_tokens: int = 0


@dataclass(frozen=True)
class BlockCopy:
    """One KV block copied between the device pool and the host swap pool (see `BlockCopy` in the proto)."""

    device_block: int
    host_block: int


@dataclass(frozen=True)
class ForwardRequest:
    sequences: list[SequenceChunk]
    released_ids: list[int] = field(default_factory=list)
    # Executed before the forward: swap_out first (device -> host), then swap_in (host -> device).
    swap_out: list[BlockCopy] = field(default_factory=list)
    swap_in: list[BlockCopy] = field(default_factory=list)
    # LoRA adapters the router unloaded: freed before the call runs.
    unloaded_adapter_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class Generation:
    id: int
    token_id: int
    logprob: float  # under the raw distribution
    top_logprobs: list[TopLogprob] = field(default_factory=list)  # most likely first


@dataclass(frozen=True)
class BatchLimits:
    """What the loaded model and the KV pool accept."""

    vocab_size: int
    max_position_embeddings: int
    block_size: int
    num_blocks: int
    # The sliding window of every layer when all have one (the smallest), else 0: block-table entries
    # wholly out of each chunk's first query's window may then be the null block 0 (the router released them).
    kv_window: int = 0


@dataclass(frozen=True)
class BatchState:
    """A call's flattened tokens; sequence i owns rows [cu_seqlens_q[i], cu_seqlens_q[i+1])."""

    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int64 [num_seqs, max_blocks], padded with block 0
    cu_seqlens_q: list[int]
    context_lens: list[int]  # num_computed_tokens + chunk length, per sequence
    # Sampled rows: a sampled chunk's last num_speculative_tokens + 1 rows, in position order.
    sample_rows: torch.Tensor  # int64 [num_sampled]
    sample_ids: list[int]  # sequence id per sampled row (repeated for a speculating chunk)
    sample_positions: list[int]  # position of the token being generated, per sampled row

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens_q[-1]

    @classmethod
    def prepare(
        cls,
        sequences: list[SequenceChunk],
        known_ids: set[int] | dict[int, object],
        limits: BatchLimits,
        device: torch.device,
    ) -> BatchState:
        """Validates `sequences` (ids in `known_ids` may omit params) and flattens them."""
        if not sequences:
            raise ValueError("sequences: a forward call needs at least one sequence")
        seen: set[int] = set()
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens_q = [0]
        context_lens: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[int] = []
        sample_positions: list[int] = []
        for seq in sequences:
            _validate(seq, seen, known_ids, limits)
            seen.add(seq.id)
            context_len = seq.num_computed_tokens + len(seq.token_ids)
            seq_positions = range(seq.num_computed_tokens, context_len)
            input_ids.extend(seq.token_ids)
            positions.extend(seq_positions)
            slots.extend(
                seq.block_table[p // limits.block_size] * limits.block_size + p % limits.block_size
                for p in seq_positions
            )
            cu_seqlens_q.append(len(input_ids))
            context_lens.append(context_len)
            if seq.sample:
                num_sampled = seq.num_speculative_tokens + 1
                sample_rows.extend(range(len(input_ids) - num_sampled, len(input_ids)))
                sample_ids.extend([seq.id] * num_sampled)
                sample_positions.extend(range(context_len - num_sampled + 1, context_len + 1))
        max_blocks = max(len(seq.block_table) for seq in sequences)
        block_tables = [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in sequences]

        def tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(
            input_ids=tensor(input_ids),
            positions=tensor(positions),
            slot_mapping=tensor(slots),
            block_tables=tensor(block_tables),
            cu_seqlens_q=cu_seqlens_q,
            context_lens=context_lens,
            sample_rows=tensor(sample_rows),
            sample_ids=sample_ids,
            sample_positions=sample_positions,
        )


def _validate(
    seq: SequenceChunk, seen: set[int], known_ids: set[int] | dict[int, object], limits: BatchLimits
) -> None:
    where = f"sequence {seq.id}"
    if seq.id in seen:
        raise ValueError(f"{where}: id appears more than once in the call")
    if seq.params is None and seq.id not in known_ids:
        raise ValueError(f"{where}: params missing, and the shard has none stored for this id")
    if seq.adapter_id and seq.params is None:
        raise ValueError(f"{where}: adapter_id sent without params (it comes with them, once)")
    if seq.params is not None:
        try:
            seq.params.validate(limits.vocab_size)
        except ValueError as error:
            raise ValueError(f"{where}: params: {error}") from None
    if not seq.token_ids:
        raise ValueError(f"{where}: token_ids is empty")
    k = seq.num_speculative_tokens
    if not 0 <= k < len(seq.token_ids):
        raise ValueError(
            f"{where}: num_speculative_tokens {k} out of range [0, len(token_ids) = {len(seq.token_ids)}) "
            "(the chunk holds the proposals and the token before them)"
        )
    if k and not seq.sample:
        raise ValueError(f"{where}: num_speculative_tokens {k} sent without sample (proposals are sampled)")
    if k and seq.allowed_token_bitmask:
        raise ValueError(
            f"{where}: num_speculative_tokens {k} sent with allowed_token_bitmask "
            "(a grammar mask holds for one position only)"
        )
    bad_tokens = [t for t in seq.token_ids if not 0 <= t < limits.vocab_size]
    if bad_tokens:
        raise ValueError(f"{where}: token_ids {bad_tokens[:5]} out of range [0, {limits.vocab_size})")
    if seq.cached_token_ids:
        if seq.params is None:
            raise ValueError(f"{where}: cached_token_ids sent without params")
        if len(seq.cached_token_ids) != seq.num_computed_tokens:
            raise ValueError(
                f"{where}: cached_token_ids has {len(seq.cached_token_ids)} tokens, "
                f"num_computed_tokens is {seq.num_computed_tokens}"
            )
        bad_tokens = [t for t in seq.cached_token_ids if not 0 <= t < limits.vocab_size]
        if bad_tokens:
            raise ValueError(
                f"{where}: cached_token_ids {bad_tokens[:5]} out of range [0, {limits.vocab_size})"
            )
    context_len = seq.num_computed_tokens + len(seq.token_ids)
    if context_len > limits.max_position_embeddings:
        raise ValueError(
            f"{where}: num_computed_tokens + len(token_ids) = {context_len} exceeds "
            f"max_position_embeddings {limits.max_position_embeddings}"
        )
    num_blocks_needed = -(-context_len // limits.block_size)
    if len(seq.block_table) < num_blocks_needed:
        raise ValueError(
            f"{where}: block_table has {len(seq.block_table)} blocks but positions [0, {context_len}) need "
            f"{num_blocks_needed} of {limits.block_size} tokens"
        )
    # Entries before the first query's window (every position < num_computed_tokens - (window - 1)) are
    # never read, and may be the null block 0.
    num_unread = (
        max(0, seq.num_computed_tokens + 1 - limits.kv_window) // limits.block_size if limits.kv_window else 0
    )
    bad_blocks = [b for b in seq.block_table[num_unread:] if not 0 < b < limits.num_blocks]
    bad_blocks += [b for b in seq.block_table[:num_unread] if not 0 <= b < limits.num_blocks]
    if bad_blocks:
        raise ValueError(
            f"{where}: block_table ids {bad_blocks[:5]} out of range [1, {limits.num_blocks}) "
            "(block 0 is the null block, allowed only for blocks out of every layer's sliding window)"
        )


class TokenHistory:
    """The token ids of each sequence whose params have a penalty, at positions 0, 1, ...: `cached_token_ids`
    (sent with params) followed by the `token_ids` of every chunk. Kept by id like the params; the runner
    drops an id when it is released and everything on ClearCache. Sequences without a penalty keep none."""

    def __init__(self) -> None:
        self.token_ids_by_id: dict[int, list[int]] = {}

    def get(self, seq_id: int) -> list[int]:
        return self.token_ids_by_id.get(seq_id, [])

    def before(self, seq_id: int, position: int) -> list[int]:
        """The sequence's tokens at positions [0, position): the history a token generated at `position` sees
        (shorter than the whole history only at a speculating chunk's proposals)."""
        history = self.get(seq_id)
        return history[:position] if len(history) > position else history

    def record(self, sequences: list[SequenceChunk], params_by_id: dict[int, SamplingParams]) -> None:
        """Appends each chunk's tokens, at its positions. Checks every chunk before changing anything, and
        raises ValueError when a penalized sequence's earlier tokens are missing. A chunk with params
        (re)starts the sequence's history; `params_by_id` gives the params of the others."""
        for seq in sequences:
            params = seq.params or params_by_id[seq.id]
            if not params.needs_history or seq.num_computed_tokens == 0:
                continue
            if seq.params is not None:
                num_known = len(seq.cached_token_ids)
                missing = "cached_token_ids must carry them when a penalty is on"
            else:
                num_known = len(self.get(seq.id))
                missing = "the shard has seen fewer"
            if num_known < seq.num_computed_tokens:
                raise ValueError(
                    f"sequence {seq.id}: penalties need the tokens at positions "
                    f"[0, {seq.num_computed_tokens}), but only {num_known} are known ({missing})"
                )
        for seq in sequences:
            params = seq.params or params_by_id[seq.id]
            if not params.needs_history:
                self.token_ids_by_id.pop(seq.id, None)
            elif seq.params is not None:
                self.token_ids_by_id[seq.id] = [*seq.cached_token_ids, *seq.token_ids]
            else:
                history = self.token_ids_by_id.setdefault(seq.id, [])
                del history[seq.num_computed_tokens :]  # a chunk at earlier positions replaces what was there
                history.extend(seq.token_ids)

    def release(self, seq_id: int) -> None:
        self.token_ids_by_id.pop(seq_id, None)

    def clear(self) -> None:
        self.token_ids_by_id.clear()
