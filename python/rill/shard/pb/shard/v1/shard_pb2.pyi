from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_type", "dtype", "device", "block_size", "vocab_size", "eos_token_ids", "max_position_embeddings", "world_size", "architecture", "sliding_windows", "max_loras", "max_lora_rank")
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    model_type: str
    dtype: str
    device: str
    block_size: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_position_embeddings: int
    world_size: int
    architecture: str
    sliding_windows: _containers.RepeatedScalarFieldContainer[int]
    max_loras: int
    max_lora_rank: int
    def __init__(self, model_type: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., block_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_position_embeddings: _Optional[int] = ..., world_size: _Optional[int] = ..., architecture: _Optional[str] = ..., sliding_windows: _Optional[_Iterable[int]] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("warmed_up",)
    WARMED_UP_FIELD_NUMBER: _ClassVar[int]
    warmed_up: bool
    def __init__(self, warmed_up: _Optional[bool] = ...) -> None: ...

class WarmupRequest(_message.Message):
    __slots__ = ("max_batch_tokens", "max_batch_size", "max_total_kv_tokens", "swap_space_bytes", "max_speculative_tokens")
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SWAP_SPACE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_batch_tokens: int
    max_batch_size: int
    max_total_kv_tokens: int
    swap_space_bytes: int
    max_speculative_tokens: int
    def __init__(self, max_batch_tokens: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_total_kv_tokens: _Optional[int] = ..., swap_space_bytes: _Optional[int] = ..., max_speculative_tokens: _Optional[int] = ...) -> None: ...

class WarmupResponse(_message.Message):
    __slots__ = ("num_blocks", "num_host_blocks", "swap_seconds_per_block", "prefill_seconds_per_token", "bytes_per_block", "kv_pool_reason", "swap_pool_reason")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAP_SECONDS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_REASON_FIELD_NUMBER: _ClassVar[int]
    SWAP_POOL_REASON_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_host_blocks: int
    swap_seconds_per_block: float
    prefill_seconds_per_token: float
    bytes_per_block: int
    kv_pool_reason: str
    swap_pool_reason: str
    def __init__(self, num_blocks: _Optional[int] = ..., num_host_blocks: _Optional[int] = ..., swap_seconds_per_block: _Optional[float] = ..., prefill_seconds_per_token: _Optional[float] = ..., bytes_per_block: _Optional[int] = ..., kv_pool_reason: _Optional[str] = ..., swap_pool_reason: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("do_sample", "temperature", "top_k", "top_p", "seed", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "min_p", "typical_p", "top_n_logprobs", "num_prompt_tokens", "min_new_tokens", "stop_token_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    TOP_N_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    seed: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    typical_p: float
    top_n_logprobs: int
    num_prompt_tokens: int
    min_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, do_sample: _Optional[bool] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., typical_p: _Optional[float] = ..., top_n_logprobs: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SequenceChunk(_message.Message):
    __slots__ = ("id", "token_ids", "num_computed_tokens", "block_table", "sample", "params", "cached_token_ids", "allowed_token_bitmask", "adapter_id", "num_speculative_tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_BITMASK_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    block_table: _containers.RepeatedScalarFieldContainer[int]
    sample: bool
    params: SamplingParams
    cached_token_ids: _containers.RepeatedScalarFieldContainer[int]
    allowed_token_bitmask: _containers.RepeatedScalarFieldContainer[int]
    adapter_id: int
    num_speculative_tokens: int
    def __init__(self, id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., block_table: _Optional[_Iterable[int]] = ..., sample: _Optional[bool] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., cached_token_ids: _Optional[_Iterable[int]] = ..., allowed_token_bitmask: _Optional[_Iterable[int]] = ..., adapter_id: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("device_block", "host_block")
    DEVICE_BLOCK_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    device_block: int
    host_block: int
    def __init__(self, device_block: _Optional[int] = ..., host_block: _Optional[int] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("released_ids", "sequences", "swap_out", "swap_in", "unloaded_adapter_ids")
    RELEASED_IDS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    UNLOADED_ADAPTER_IDS_FIELD_NUMBER: _ClassVar[int]
    released_ids: _containers.RepeatedScalarFieldContainer[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceChunk]
    swap_out: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    swap_in: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    unloaded_adapter_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, released_ids: _Optional[_Iterable[int]] = ..., sequences: _Optional[_Iterable[_Union[SequenceChunk, _Mapping]]] = ..., swap_out: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., swap_in: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., unloaded_adapter_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Generation(_message.Message):
    __slots__ = ("id", "token_id", "logprob", "top_logprobs")
    ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    id: int
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, id: _Optional[int] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("generations", "forward_time_us")
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_TIME_US_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    forward_time_us: int
    def __init__(self, generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ..., forward_time_us: _Optional[int] = ...) -> None: ...

class ClearCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClearCacheResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("adapter_id", "path")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    adapter_id: int
    path: str
    def __init__(self, adapter_id: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("rank", "target_modules")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...
