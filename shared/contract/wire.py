"""The contract's value types <-> protobuf messages, at the edge: protobuf never enters the engine.

Received parameters are validated here with the same rules as a REST request, and a violation
is a FrameError whose message says which field was wrong.
"""

from __future__ import annotations

import dataclasses

from pydantic import ValidationError

from proto.lazyserve.v1 import lazyserve_pb2 as pb
from shared.contract.pruning import PruneConfig
from shared.contract.sampling import Sampled, SamplingParams
from shared.contract.stats import Stats


class FrameError(ValueError):
    """A transfer message that is malformed or inconsistent with the receiver's model."""


def pruning_to_pb(config: PruneConfig) -> pb.PruneConfig:
    return pb.PruneConfig(
        mode=config.mode,
        stages=[pb.Stage(layer=layer, keep_fraction=keep) for layer, keep in config.stages],
        sink_tokens=config.sink_tokens,
        granularity=config.granularity,
        block_size=config.block_size,
        seed=config.seed,
        window=config.window,
        pool_kernel=config.pool_kernel,
        pool=config.pool,
        recent_tokens=config.recent_tokens,
        keep_mass=config.keep_mass,
        min_keep=config.min_keep,
        min_prompt_tokens=config.min_prompt_tokens,
        revive_budget=config.revive_budget,
        reselect_every=config.reselect_every,
    )


def pruning_from_pb(message: pb.PruneConfig, spec) -> PruneConfig:
    """The schedule a message states, checked against the model (spec: ModelSpec)."""
    # proto3 cannot tell unset from empty: an empty mode means "off", and an empty granularity or
    # pool, or a zero block size, window, pool kernel or reselect_every, means PruneConfig's default.
    fields = {
        "mode": message.mode or "off",
        "stages": tuple((stage.layer, stage.keep_fraction) for stage in message.stages),
        "sink_tokens": message.sink_tokens,
        "granularity": message.granularity or None,
        "block_size": message.block_size or None,
        "seed": message.seed,
        "window": message.window or None,
        "pool_kernel": message.pool_kernel or None,
        "pool": message.pool or None,
        "recent_tokens": message.recent_tokens,
        "keep_mass": message.keep_mass if message.HasField("keep_mass") else None,
        "min_keep": message.min_keep,
        "min_prompt_tokens": message.min_prompt_tokens,
        "revive_budget": message.revive_budget if message.HasField("revive_budget") else None,
        "reselect_every": message.reselect_every or None,
    }
    try:
        config = PruneConfig(**{name: value for name, value in fields.items() if value is not None})
        return spec.check(config)
    except (ValidationError, ValueError) as error:
        raise FrameError(f"pruning: {_first_line(error)}") from None


def sampling_to_pb(params: SamplingParams) -> pb.SamplingParams:
    message = pb.SamplingParams(
        max_new_tokens=params.max_new_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        stop_token_ids=list(params.stop_token_ids),
        top_k=params.top_k,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=[pb.TokenBias(token_id=token, bias=bias) for token, bias in params.logit_bias],
        min_tokens=params.min_tokens,
    )
    if params.repetition_penalty != 1.0:
        message.repetition_penalty = params.repetition_penalty
    if params.logprobs is not None:
        message.logprobs = params.logprobs
    if params.n != 1:
        message.n = params.n
    if params.grammar is not None:
        message.grammar = params.grammar
    if params.seed is not None:
        # uint64 on the wire; torch.Generator.manual_seed maps a negative seed the same way.
        message.seed = params.seed % 2**64
    return message


def sampling_from_pb(message: pb.SamplingParams, vocab_size: int) -> SamplingParams:
    if message.max_new_tokens < 1:
        raise FrameError(f"sampling.max_new_tokens must be >= 1, got {message.max_new_tokens}")
    if not message.temperature >= 0.0:  # also refuses NaN
        raise FrameError(f"sampling.temperature must be >= 0, got {message.temperature}")
    top_p = message.top_p or 1.0  # unset (0) means no nucleus cut
    if not 0.0 < top_p <= 1.0:
        raise FrameError(f"sampling.top_p must be in (0, 1], got {message.top_p}")
    check_token_ids(message.stop_token_ids, vocab_size, "sampling.stop_token_ids")
    check_token_ids([item.token_id for item in message.logit_bias], vocab_size, "sampling.logit_bias")
    try:
        return SamplingParams(
            max_new_tokens=message.max_new_tokens,
            temperature=message.temperature,
            top_p=top_p,
            seed=message.seed if message.HasField("seed") else None,
            stop_token_ids=tuple(message.stop_token_ids),
            top_k=message.top_k,
            min_p=message.min_p,
            presence_penalty=message.presence_penalty,
            frequency_penalty=message.frequency_penalty,
            repetition_penalty=message.repetition_penalty if message.HasField("repetition_penalty") else 1.0,
            logit_bias=tuple((item.token_id, item.bias) for item in message.logit_bias),
            min_tokens=message.min_tokens,
            logprobs=message.logprobs if message.HasField("logprobs") else None,
            n=message.n or 1,
            grammar=message.grammar if message.HasField("grammar") else None,
        )
    except ValueError as error:  # the contract's own range checks (NaN included)
        raise FrameError(f"sampling: {error}") from None


def logprobs_to_pb(sampled: Sampled) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(
        chosen=pb.TokenLogprob(token_id=sampled.token, logprob=sampled.logprob),
        top=[pb.TokenLogprob(token_id=token, logprob=logprob) for token, logprob in sampled.top],
    )


def logprobs_from_pb(message: pb.TokenLogprobs) -> Sampled:
    return Sampled(
        message.chosen.token_id,
        message.chosen.logprob,
        tuple((item.token_id, item.logprob) for item in message.top),
    )


def prompt_from_pb(
    prompt_ids, pruning: pb.PruneConfig | PruneConfig, sampling: pb.SamplingParams, spec
) -> tuple[list[int], PruneConfig, SamplingParams]:
    """A prompt and its parameters as received, checked against the model (spec: ModelSpec).
    pruning: the received message, or the receiver's default preset where the request had none."""
    if len(prompt_ids) == 0:
        raise FrameError("prompt_ids is empty")
    check_token_ids(prompt_ids, spec.vocab_size, "prompt_ids")
    if isinstance(pruning, PruneConfig):
        config = spec.check(pruning)
    else:
        config = pruning_from_pb(pruning, spec)
    params = sampling_from_pb(sampling, spec.vocab_size)
    if len(prompt_ids) + params.max_new_tokens > spec.max_positions:
        raise FrameError(
            f"{len(prompt_ids)} prompt tokens + max_new_tokens {params.max_new_tokens} exceed the context of "
            f"{spec.max_positions}"
        )
    return list(prompt_ids), config, params


def check_token_ids(ids, vocab_size: int, name: str) -> None:
    bad = [token for token in ids if token >= vocab_size]
    if bad:
        raise FrameError(f"{name}: token id {bad[0]} is outside the vocabulary of {vocab_size}")


# Stats is the one definition of a generation's figures: the proto message carries each field
# under the same name (tests/unit/transfer/test_stats_fields.py fails when one side lacks one).
STAT_FIELDS = tuple(field.name for field in dataclasses.fields(Stats))


def stats_to_pb(stats: Stats) -> pb.GenerationStats:
    message = pb.GenerationStats()
    for name in STAT_FIELDS:
        value = getattr(stats, name)
        if isinstance(value, list):
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)
    return message


def stats_from_pb(message: pb.GenerationStats) -> Stats:
    values = {name: getattr(message, name) for name in STAT_FIELDS}
    return Stats(**{name: value if isinstance(value, int | float) else list(value) for name, value in values.items()})


def _first_line(error: Exception) -> str:
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return f"{where}: {first['msg']}" if where else first["msg"]
    return str(error).splitlines()[0]
