"""`lazyserve bench migration`: what a migrated stream's continuation costs and whether it is the
uninterrupted answer, with --batch-invariant off and on, side by side in one run.

As a decode worker runs them (its Scheduler, one ComputeThread that loaded the model): N greedy
prompts decoded together, T tokens each (the uninterrupted answers); then each is cut at a random
k in [1, T) and continued the two ways a worker can (services/decode/server.py): `replay` feeds the
k tokens through decode steps (exact where steps are batch-invariant: the worker's choice under
--batch-invariant), `prefill` prefills them with the prompt (one pruned prefill: its choice
otherwise). All N continuations of one way run together, as a failed worker's streams would.
Reported per way: how many continuations equal the uninterrupted answer's rest, where the others
first differ, and the gap (submit to first new token), median of the N.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from bench.common import markdown_table, pruning_configs, write_report
from bench.decode import _prompts


def _run(scheduler, sequences) -> list[tuple[list[int], float]]:
    """Submit `sequences` together; each one's tokens and its submit-to-first-token time."""
    from services.decode.scheduler import ChoiceToken

    start = time.perf_counter()
    for sequence in sequences:
        scheduler.submit(sequence)
    results = []
    for sequence in sequences:
        tokens, first = [], None
        while True:
            item = sequence.outbox.get(timeout=600)
            if not isinstance(item, ChoiceToken):
                break
            first = first or time.perf_counter() - start
            tokens.append(item.sampled.token)
        results.append((tokens, first or 0.0))
    return results


def _sequence(model, prompt, config, params, cut: list[int] | None, way: str):
    from services.decode.scheduler import Sequence
    from shared.engine import PrefillRun

    ids = prompt if cut is None or way == "replay" else torch.cat([prompt, torch.tensor(cut)])
    sequence = Sequence.local("m", PrefillRun(model, ids, config, reserve=params.max_new_tokens), params)
    if cut is not None:
        if way == "replay":
            sequence.replayed = list(cut)
        else:
            sequence.answered = list(cut)
    return sequence


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def bench(args) -> dict:
    from services.decode.scheduler import Scheduler
    from shared.compute import ComputeThread
    from shared.engine import SamplingParams
    from shared.models.weights import load_model

    compute = ComputeThread("bench-migration")
    loaded = compute.call(load_model, args.model, dtype=args.dtype)
    model = loaded.engine
    [config] = pruning_configs([args.preset], [], model.spec).values()
    params = SamplingParams(max_new_tokens=args.tokens)  # greedy, no stop token: every answer is T long
    prompts = _prompts(loaded.tokenizer, args.streams, args.prompt)
    cuts = [random.Random(args.seed + i).randrange(1, args.tokens) for i in range(args.streams)]  # noqa: S311
    scheduler = Scheduler(model, max_sequences=2 * args.streams, max_batch_size=args.streams, compute=compute)
    rows = []
    try:
        for invariant in (False, True):
            compute.call(model.set_batch_invariant, invariant)
            _run(scheduler, [_sequence(model, prompts[0], config, params, None, "")])  # warm-up
            answers = [t for t, _ in _run(scheduler, [_sequence(model, p, config, params, None, "") for p in prompts])]
            for way in ("replay", "prefill"):
                made = [
                    _sequence(model, p, config, params, answer[:k], way) for p, answer, k in zip(prompts, answers, cuts)
                ]
                continued = _run(scheduler, made)
                differ = [_first_difference(rest, answer[k:]) for (rest, _), answer, k in zip(continued, answers, cuts)]
                rows.append(
                    {
                        "batch_invariant": invariant,
                        "way": way,
                        "equal": sum(d is None for d in differ),
                        "streams": args.streams,
                        "first_difference_after_cut": [d for d in differ if d is not None],
                        "cuts": cuts,
                        "gap_s_median": statistics.median(gap for _, gap in continued),
                        "gap_s": [gap for _, gap in continued],
                    }
                )
                print(f"invariant {invariant} {way}: {rows[-1]['equal']}/{args.streams} equal", flush=True)
    finally:
        scheduler.close()
        compute.close()
    return {"model": loaded.name, "dtype": args.dtype, "preset": args.preset, "tokens": args.tokens, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lazyserve bench migration", description=__doc__)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--preset", default="default", help="pruning preset of every stream")
    parser.add_argument("--streams", type=int, default=16, help="streams decoded together, then continued")
    parser.add_argument("--prompt", type=int, default=400, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each answer has in all")
    parser.add_argument("--seed", type=int, default=0, help="where each stream is cut")
    parser.add_argument("--out", default="out/bench_migration.json")
    args = parser.parse_args(argv)
    report = bench(args)
    print(f"\n{report['model']}, {report['dtype']}, preset {report['preset']}, {report['tokens']} tokens a stream")
    print(
        markdown_table(
            [
                "batch-invariant",
                "continuation",
                "equal to the uninterrupted",
                "first differs (tokens after cut)",
                "gap",
            ],
            [
                [
                    "on" if r["batch_invariant"] else "off",
                    r["way"],
                    f"{r['equal']}/{r['streams']}",
                    ", ".join(map(str, r["first_difference_after_cut"])) or "-",
                    f"{r['gap_s_median']:.2f} s",
                ]
                for r in report["rows"]
            ],
        )
    )
    return write_report(args.out, report)


if __name__ == "__main__":
    raise SystemExit(main())
