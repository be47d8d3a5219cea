"""Stats is defined once: the proto message and the response's `metrics` follow it field by field."""

import dataclasses

from proto.lazyserve.v1 import lazyserve_pb2 as pb
from shared.api.schemas import Metrics
from shared.api.serving import USAGE_FIELDS, metrics_of, usage_of
from shared.contract import Stats
from shared.contract.wire import STAT_FIELDS, stats_from_pb, stats_to_pb


def _distinct_stats() -> Stats:
    """Every field set to a different non-default value, so a field dropped anywhere shows."""
    values = {}
    for i, field in enumerate(dataclasses.fields(Stats), start=1):
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        values[field.name] = (
            [i, i + 1] if isinstance(default, list) else type(default)(i) + (0.5 if isinstance(default, float) else 0)
        )
    return Stats(**values)


def test_the_proto_message_has_exactly_the_stats_fields():
    assert set(pb.GenerationStats.DESCRIPTOR.fields_by_name) == set(STAT_FIELDS)
    stats = _distinct_stats()
    assert stats_from_pb(stats_to_pb(stats)) == stats


def test_the_response_metrics_have_exactly_the_stats_fields_less_usage():
    assert set(Metrics.model_fields) == (set(STAT_FIELDS) - set(USAGE_FIELDS)) | {"computed_fraction", "pruning"}
    stats = _distinct_stats()
    metrics = metrics_of(stats, "default").model_dump()
    for name in set(STAT_FIELDS) - set(USAGE_FIELDS):
        assert metrics[name] == getattr(stats, name)
    assert metrics["computed_fraction"] == stats.computed_fraction
    assert usage_of(stats).total_tokens == stats.prompt_tokens + stats.completion_tokens
