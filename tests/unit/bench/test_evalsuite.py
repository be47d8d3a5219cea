"""The suite's generator and scorers: deterministic, answers really in the prompt, lengths on target."""

import pytest

from bench.evalsuite import scorers
from bench.evalsuite.tasks import TASKS, make_case, make_suite


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer


@pytest.mark.parametrize("task", TASKS)
def test_same_seed_same_case(tokenizer, task):
    assert make_case(tokenizer, task, 1024, 0.5, seed=3) == make_case(tokenizer, task, 1024, 0.5, seed=3)
    assert (
        make_case(tokenizer, task, 1024, 0.5, seed=3).content != make_case(tokenizer, task, 1024, 0.5, seed=5).content
    )


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [1024, 4096])
def test_length_within_five_percent(tokenizer, task, length):
    from bench.evalsuite.tasks import _count

    case = make_case(tokenizer, task, length, 0.5, seed=0)
    assert abs(_count(tokenizer, case.url, case.content) - length) <= 0.05 * length


@pytest.mark.parametrize("task", ["passkey", "multikey", "multidoc", "fewshot"])
@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_answer_is_in_the_prompt_at_its_depth(tokenizer, task, depth):
    case = make_case(tokenizer, task, 2048, depth, seed=2)
    evidence = case.content[case.answer_offset :]
    # The evidence starts at the recorded offset and holds the answer.
    line = evidence[: evidence.find("\n", 1) if task == "fewshot" else evidence.find(".") + 1 or None]
    assert case.answer in (evidence[: evidence.find("Sentiment: ") + 20] if task == "fewshot" else line)
    # ...at the stated depth of the context (the question at the end does not count).
    assert abs(case.answer_offset / len(case.content) - depth) < 0.12
    if task in ("passkey", "multikey", "multidoc"):
        assert case.content.count(case.answer) >= 1


def test_code_answer_is_the_next_source_line(tokenizer):
    case = make_case(tokenizer, "code", 1024, 0.5, seed=0)
    assert case.answer and case.answer_offset == len(case.content)
    assert case.content.endswith("\n")


def test_splits_do_not_share_prompts(tokenizer):
    dev = make_suite(tokenizer, ["passkey"], [1024], "dev", 2)
    test = make_suite(tokenizer, ["passkey"], [1024], "test", 2)
    assert {c.split for c in dev} == {"dev"} and {c.split for c in test} == {"test"}
    assert not {c.content for c in dev} & {c.content for c in test}


def test_scorers_on_known_inputs():
    assert scorers.contains("The pass key is 12345.", "12345") == 1.0
    assert scorers.contains("I do not know", "12345") == 0.0
    assert scorers.label(" positive, not negative", "positive", ("positive", "negative")) == 1.0
    assert scorers.label(" negative", "positive", ("positive", "negative")) == 0.0
    assert scorers.label(" neutral", "positive", ("positive", "negative")) == 0.0
    assert scorers.edit_similarity("\nreturn x + 1\nmore", "return x + 1") == 1.0
    assert scorers.edit_similarity("abcd", "abef") == 0.5
    assert scorers.rouge_l("a b c d", "a b c d") == 1.0
    assert scorers.rouge_l("a x c", "a b c") == pytest.approx(2 / 3)
    assert scorers.rouge_l("x y", "a b") == 0.0
    assert scorers.prefix_agreement([1, 2, 3, 9], [1, 2, 3, 4]) == 0.75
    assert scorers.prefix_agreement([5], [1, 2]) == 0.0
    assert scorers.same_answer(" negative\nReview", "negative\n") == 1.0  # a leading space is no new answer
    assert scorers.same_answer(" Positive.", "positive") == 1.0
    assert scorers.same_answer(" positive", " negative") == 0.0
    assert scorers.same_answer("", " 1234") == 0.0


def test_summary_pairs_cases_and_counts_only_solved_ones_as_retained():
    from bench.evalsuite.harness import summarize, table

    def record(task, config, score, ref_score, ttft, full=4.0, top1=1.0, output=" 1234.", ref_output="1234\n"):
        return {
            "output": output,
            "ref_output": ref_output,
            "target_tokens": 1024,
            "task": task,
            "config": config,
            "score": score,
            "ref_score": ref_score,
            "ttft_s": ttft,
            "ttft_full_s": full,
            "computed_fraction": 0.5,
            "first_top1": top1,
            "first_kl": 0.0,
            "teacher_top1": top1,
            "teacher_kl": 0.0,
            "prefix_match": top1,
            "revived_token_layers": 0,
            "seconds": ttft,
        }

    records = [
        record("passkey", "off", 1.0, 1.0, 4.0),
        record("passkey", "off", 0.0, 0.0, 4.0),
        record("code", "off", 0.5, 0.5, 4.0),
        record("passkey", "lazy", 0.0, 1.0, 1.0, top1=0.0, output=" 1000."),
        record("passkey", "lazy", 1.0, 0.0, 2.0),
        record("code", "lazy", 0.25, 0.5, 2.0),
    ]
    rows = {row["config"]: row for row in summarize(records)}
    assert rows["off"]["accuracy_delta"] == (0.0, 0.0, 0.0)
    assert rows["lazy"]["accuracy_delta"][0] == pytest.approx(0.0)  # one case lost, one gained: paired
    assert rows["lazy"]["retained"][0] == 0.0 and rows["lazy"]["solved_cases"] == 1  # the solved case was lost
    assert rows["lazy"]["code_delta"][0] == pytest.approx(-0.25)
    assert rows["lazy"]["first_top1"][0] == pytest.approx(2 / 3)
    assert rows["lazy"]["ttft_speedup"] == pytest.approx(2.0)  # median of 4x, 2x, 2x
    assert rows["lazy"]["answer_cases"] == 2 and rows["lazy"]["cases"] == 3
    assert rows["lazy"]["same_answer"][0] == pytest.approx(0.5)  # " 1000." differs; " 1234." is "1234\n"
    assert rows["off"]["same_answer"][0] == 1.0
    assert "| 1024 | lazy | 3 | 2.00x |" in table(list(rows.values()))


def _run_dir(tmp_path, name, records, resolved):
    import json

    directory = tmp_path / name
    directory.mkdir()
    (directory / "results.json").write_text(json.dumps({"settings": {"resolved": resolved}, "records": records}))
    return str(directory)


def _record(case, task, config, score, ref_score):
    return {
        "output": " positive" if score else " negative",
        "ref_output": " positive" if ref_score else " negative",
        "case": case,
        "target_tokens": 4096,
        "task": task,
        "config": config,
        "score": score,
        "ref_score": ref_score,
        "first_top1": 1.0,
        "teacher_top1": 1.0,
    }


def test_runs_split_by_task_pool_into_one_report_and_clashes_are_refused(tmp_path):
    from bench.evalsuite.harness import load_runs, task_rows

    lazy = {"mode": "lazy", "stages": [[18, 0.2]]}
    passkey = _run_dir(
        tmp_path,
        "passkey",
        [_record("p1", "passkey", "off", 1.0, 1.0), _record("p1", "passkey", "lazy", 1.0, 1.0)],
        {"off": {"mode": "off"}, "lazy": lazy},
    )
    fewshot = _run_dir(
        tmp_path,
        "fewshot",
        [
            _record("f1", "fewshot", "lazy", 0.0, 1.0),  # a solved case lost
            _record("f2", "fewshot", "lazy", 1.0, 0.0),  # an unsolved one gained
            _record("f3", "fewshot", "lazy", 1.0, 1.0),
        ],
        {"lazy": lazy},
    )
    records, resolved = load_runs([passkey, fewshot])
    assert len(records) == 5 and resolved == {"off": {"mode": "off"}, "lazy": lazy}
    rows = {(row["config"], row["task"]): row for row in task_rows(records)}
    few = rows[("lazy", "fewshot")]
    assert (few["cases"], few["solved_by_off"], few["still_solved"]) == (3, 2, 1)
    assert few["score_delta"][0] == pytest.approx(0.0)  # -1 and +1 over three cases, paired
    assert few["same_answer"][0] == pytest.approx(1 / 3)
    assert (rows[("lazy", "passkey")]["solved_by_off"], rows[("lazy", "passkey")]["still_solved"]) == (1, 1)

    with pytest.raises(ValueError, match="also in an earlier run"):
        load_runs([passkey, passkey])
    other = _run_dir(tmp_path, "other", [], {"lazy": {"mode": "lazy", "stages": [[12, 0.2]]}})
    with pytest.raises(ValueError, match="differs"):
        load_runs([passkey, other])
