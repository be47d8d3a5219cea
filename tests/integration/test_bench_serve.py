"""`lazyserve bench serve`'s client against a real gateway: closed-loop streams serve every prompt
once, `ignore_eos` makes every answer as long as asked, and the inter-token gaps it pools are the
gaps of each stream; the ratios against `pruning=off` pair runs with the same threads."""

from __future__ import annotations

import asyncio

from bench.serve import against_off, replay, summarize


def test_closed_loop_streams_serve_every_prompt_at_full_length(tiny_llama, decode_worker, gateway):
    decode, _ = decode_worker(tiny_llama)
    running = gateway(decode_workers=[decode.address])
    prompts = [[(7 * i + j) % 200 + 10 for j in range(30 + 5 * i)] for i in range(5)]
    items = [(0.0, len(prompt)) for prompt in prompts]

    outcomes = asyncio.run(replay(running.url, items, prompts, 6, 60.0, concurrency=2, ignore_eos=True))

    assert [o.prompt_tokens for o in outcomes] == [len(p) for p in prompts]  # each prompt once, in its slot
    assert all(o.ok and not o.error for o in outcomes), [o.error for o in outcomes]
    assert [o.tokens for o in outcomes] == [6] * 5
    for o in outcomes:  # one gap per streamed token after the first; they add up to the stream's span
        assert 1 <= len(o.itl_s) <= 5 and all(gap >= 0 for gap in o.itl_s)
        assert abs(sum(o.itl_s) - o.tpot_s * len(o.itl_s)) < 1e-9
    summary = summarize(outcomes, 2.0, slo_ttft=10.0, slo_itl=1.0)
    assert summary["ok"] == 5 and summary["output_tokens_per_s"] == 15.0
    gaps = sorted(gap for o in outcomes for gap in o.itl_s)
    assert summary["itl_s"]["p50"] == gaps[(len(gaps) + 1) // 2 - 1]


def _entry(tokens_per_s: float, itl_p50: float, ttft_p50: float) -> dict:
    return {
        "summary": {
            "output_tokens_per_s": tokens_per_s,
            "itl_s": {"p50": itl_p50},
            "ttft_s": {"p50": ttft_p50},
        }
    }


def test_ratios_pair_each_preset_with_off_at_the_same_threads():
    policies = {
        "up threads=auto pruning=off": _entry(40.0, 0.2, 2.0),
        "up threads=auto pruning=default": _entry(50.0, 0.1, 1.0),
        "up threads=1 pruning=default": _entry(10.0, 0.5, 4.0),  # no off run at 1 thread: no ratio
        "up threads=1": _entry(1.0, 1.0, 1.0),
    }
    ratios = against_off(policies)
    assert ratios == {
        "up threads=auto pruning=default": {"output_tokens_per_s": 1.25, "itl_p50": 0.5, "ttft_p50_speedup": 2.0}
    }
