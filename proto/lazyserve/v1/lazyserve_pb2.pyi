from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Stage(_message.Message):
    __slots__ = ("layer", "keep_fraction")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KEEP_FRACTION_FIELD_NUMBER: _ClassVar[int]
    layer: int
    keep_fraction: float
    def __init__(self, layer: _Optional[int] = ..., keep_fraction: _Optional[float] = ...) -> None: ...

class PruneConfig(_message.Message):
    __slots__ = ("mode", "stages", "sink_tokens", "granularity", "block_size", "seed", "window", "pool_kernel", "pool", "recent_tokens", "keep_mass", "min_keep", "min_prompt_tokens", "revive_budget", "reselect_every")
    MODE_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRANULARITY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    POOL_KERNEL_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    RECENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEEP_MASS_FIELD_NUMBER: _ClassVar[int]
    MIN_KEEP_FIELD_NUMBER: _ClassVar[int]
    MIN_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REVIVE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    RESELECT_EVERY_FIELD_NUMBER: _ClassVar[int]
    mode: str
    stages: _containers.RepeatedCompositeFieldContainer[Stage]
    sink_tokens: int
    granularity: str
    block_size: int
    seed: int
    window: int
    pool_kernel: int
    pool: str
    recent_tokens: int
    keep_mass: float
    min_keep: float
    min_prompt_tokens: int
    revive_budget: int
    reselect_every: int
    def __init__(self, mode: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[Stage, _Mapping]]] = ..., sink_tokens: _Optional[int] = ..., granularity: _Optional[str] = ..., block_size: _Optional[int] = ..., seed: _Optional[int] = ..., window: _Optional[int] = ..., pool_kernel: _Optional[int] = ..., pool: _Optional[str] = ..., recent_tokens: _Optional[int] = ..., keep_mass: _Optional[float] = ..., min_keep: _Optional[float] = ..., min_prompt_tokens: _Optional[int] = ..., revive_budget: _Optional[int] = ..., reselect_every: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "seed", "stop_token_ids", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "logprobs", "n", "grammar")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.RepeatedCompositeFieldContainer[TokenBias]
    min_tokens: int
    logprobs: int
    n: int
    grammar: str
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Iterable[_Union[TokenBias, _Mapping]]] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., n: _Optional[int] = ..., grammar: _Optional[str] = ...) -> None: ...

class TokenBias(_message.Message):
    __slots__ = ("token_id", "bias")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    bias: float
    def __init__(self, token_id: _Optional[int] = ..., bias: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("chosen", "top")
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    chosen: TokenLogprob
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, chosen: _Optional[_Union[TokenLogprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "ttft_s", "decode_s", "prefill_token_layers", "token_layers_computed", "token_layers_full", "revived_token_layers", "kept_per_layer", "kv_cache_bytes", "aux_cache_bytes", "cached_tokens", "token_depths", "revived_positions")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LAYERS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LAYERS_FULL_FIELD_NUMBER: _ClassVar[int]
    REVIVED_TOKEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KEPT_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    AUX_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_DEPTHS_FIELD_NUMBER: _ClassVar[int]
    REVIVED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    decode_s: float
    prefill_token_layers: int
    token_layers_computed: int
    token_layers_full: int
    revived_token_layers: int
    kept_per_layer: _containers.RepeatedScalarFieldContainer[int]
    kv_cache_bytes: int
    aux_cache_bytes: int
    cached_tokens: int
    token_depths: _containers.RepeatedScalarFieldContainer[int]
    revived_positions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., ttft_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., prefill_token_layers: _Optional[int] = ..., token_layers_computed: _Optional[int] = ..., token_layers_full: _Optional[int] = ..., revived_token_layers: _Optional[int] = ..., kept_per_layer: _Optional[_Iterable[int]] = ..., kv_cache_bytes: _Optional[int] = ..., aux_cache_bytes: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., token_depths: _Optional[_Iterable[int]] = ..., revived_positions: _Optional[_Iterable[int]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TransferHeader(_message.Message):
    __slots__ = ("transfer_id", "model", "num_layers", "num_kv_heads", "head_dim", "hidden_size", "dtype", "num_prompt_tokens")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    dtype: str
    num_prompt_tokens: int
    def __init__(self, transfer_id: _Optional[str] = ..., model: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...

class KVFrame(_message.Message):
    __slots__ = ("transfer_id", "layer", "positions", "k", "v", "aux_positions", "aux_hidden", "crc32c", "query_positions", "queries", "boundary_positions", "boundary_hidden")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    AUX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    AUX_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    QUERY_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    layer: int
    positions: _containers.RepeatedScalarFieldContainer[int]
    k: Tensor
    v: Tensor
    aux_positions: _containers.RepeatedScalarFieldContainer[int]
    aux_hidden: Tensor
    crc32c: int
    query_positions: _containers.RepeatedScalarFieldContainer[int]
    queries: Tensor
    boundary_positions: _containers.RepeatedScalarFieldContainer[int]
    boundary_hidden: Tensor
    def __init__(self, transfer_id: _Optional[str] = ..., layer: _Optional[int] = ..., positions: _Optional[_Iterable[int]] = ..., k: _Optional[_Union[Tensor, _Mapping]] = ..., v: _Optional[_Union[Tensor, _Mapping]] = ..., aux_positions: _Optional[_Iterable[int]] = ..., aux_hidden: _Optional[_Union[Tensor, _Mapping]] = ..., crc32c: _Optional[int] = ..., query_positions: _Optional[_Iterable[int]] = ..., queries: _Optional[_Union[Tensor, _Mapping]] = ..., boundary_positions: _Optional[_Iterable[int]] = ..., boundary_hidden: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class TransferEnd(_message.Message):
    __slots__ = ("transfer_id", "prompt_ids", "pruning", "sampling", "num_frames", "prefill_stats", "first_tokens")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PRUNING_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_STATS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    pruning: PruneConfig
    sampling: SamplingParams
    num_frames: int
    prefill_stats: GenerationStats
    first_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, transfer_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., pruning: _Optional[_Union[PruneConfig, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., num_frames: _Optional[int] = ..., prefill_stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., first_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class TransferMessage(_message.Message):
    __slots__ = ("header", "frame", "end")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    header: TransferHeader
    frame: KVFrame
    end: TransferEnd
    def __init__(self, header: _Optional[_Union[TransferHeader, _Mapping]] = ..., frame: _Optional[_Union[KVFrame, _Mapping]] = ..., end: _Optional[_Union[TransferEnd, _Mapping]] = ...) -> None: ...

class PushKVReply(_message.Message):
    __slots__ = ("transfer_id", "num_frames", "bytes_received")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    num_frames: int
    bytes_received: int
    def __init__(self, transfer_id: _Optional[str] = ..., num_frames: _Optional[int] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("transfer_id", "decode_address", "prompt_ids", "pruning", "sampling", "cache_salt")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PRUNING_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    decode_address: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    pruning: PruneConfig
    sampling: SamplingParams
    cache_salt: str
    def __init__(self, transfer_id: _Optional[str] = ..., decode_address: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., pruning: _Optional[_Union[PruneConfig, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("transfer_id", "first_tokens", "stats", "num_frames", "kv_bytes_sent", "aux_bytes_sent", "bytes_sent", "transfer_wait_s", "first_logprobs", "prefix_bytes_held", "prefix_evictions", "prefill_rate")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    AUX_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BYTES_HELD_FIELD_NUMBER: _ClassVar[int]
    PREFIX_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_RATE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    first_tokens: _containers.RepeatedScalarFieldContainer[int]
    stats: GenerationStats
    num_frames: int
    kv_bytes_sent: int
    aux_bytes_sent: int
    bytes_sent: int
    transfer_wait_s: float
    first_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prefix_bytes_held: int
    prefix_evictions: int
    prefill_rate: float
    def __init__(self, transfer_id: _Optional[str] = ..., first_tokens: _Optional[_Iterable[int]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., num_frames: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., aux_bytes_sent: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., transfer_wait_s: _Optional[float] = ..., first_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prefix_bytes_held: _Optional[int] = ..., prefix_evictions: _Optional[int] = ..., prefill_rate: _Optional[float] = ...) -> None: ...

class LocalPrompt(_message.Message):
    __slots__ = ("prompt_ids", "pruning", "sampling")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PRUNING_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    pruning: PruneConfig
    sampling: SamplingParams
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., pruning: _Optional[_Union[PruneConfig, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "transfer_id", "prompt", "cache_salt", "return_token_depths", "generated_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_DEPTHS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    prompt: LocalPrompt
    cache_salt: str
    return_token_depths: bool
    generated_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., prompt: _Optional[_Union[LocalPrompt, _Mapping]] = ..., cache_salt: _Optional[str] = ..., return_token_depths: _Optional[bool] = ..., generated_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "stats", "logprobs", "index", "prefill_rate")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PREFILL_RATE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: GenerationStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    index: int
    prefill_rate: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., index: _Optional[int] = ..., prefill_rate: _Optional[float] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("model", "transfers_receiving", "transfers_ready", "sequences_active", "bytes_held", "transfers_completed", "transfers_rejected", "transfers_expired", "revived_token_layers", "dtype", "device", "torch_threads", "prefix_queried_tokens", "prefix_hit_tokens", "prefix_bytes_held", "prefix_evictions", "prefix_budget_bytes", "batch_invariant", "max_sequences", "kernels", "prefills_waiting", "prefill_rows_per_round", "prefill_rate")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_RECEIVING_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_READY_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    BYTES_HELD_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    REVIVED_TOKEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TORCH_THREADS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BYTES_HELD_FIELD_NUMBER: _ClassVar[int]
    PREFIX_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    PREFILLS_WAITING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ROWS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    PREFILL_RATE_FIELD_NUMBER: _ClassVar[int]
    model: str
    transfers_receiving: int
    transfers_ready: int
    sequences_active: int
    bytes_held: int
    transfers_completed: int
    transfers_rejected: int
    transfers_expired: int
    revived_token_layers: int
    dtype: str
    device: str
    torch_threads: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    prefix_bytes_held: int
    prefix_evictions: int
    prefix_budget_bytes: int
    batch_invariant: bool
    max_sequences: int
    kernels: str
    prefills_waiting: int
    prefill_rows_per_round: float
    prefill_rate: float
    def __init__(self, model: _Optional[str] = ..., transfers_receiving: _Optional[int] = ..., transfers_ready: _Optional[int] = ..., sequences_active: _Optional[int] = ..., bytes_held: _Optional[int] = ..., transfers_completed: _Optional[int] = ..., transfers_rejected: _Optional[int] = ..., transfers_expired: _Optional[int] = ..., revived_token_layers: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., torch_threads: _Optional[int] = ..., prefix_queried_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., prefix_bytes_held: _Optional[int] = ..., prefix_evictions: _Optional[int] = ..., prefix_budget_bytes: _Optional[int] = ..., batch_invariant: _Optional[bool] = ..., max_sequences: _Optional[int] = ..., kernels: _Optional[str] = ..., prefills_waiting: _Optional[int] = ..., prefill_rows_per_round: _Optional[float] = ..., prefill_rate: _Optional[float] = ...) -> None: ...
