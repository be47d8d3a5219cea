"""The page at `/`, in a real browser: headless Chromium (Debian's package, driven by playwright
through `executable_path`; nothing is downloaded) against a gateway serving SmolLM2 with a decode
worker and a prefill worker. What a person does, through the controls' accessible names: chat
with a streamed answer, compare unpruned and pruned, read the map of where the prompt went, watch
the service, give an API key. Each view's screenshot is written under out/page/.

And the two API additions the page relies on: /tokenize's token_strs, and the files' headers."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from conftest import RunningGateway, wait_for
from playwright.sync_api import expect

from services.router.page import WEB

SHOTS = Path(__file__).resolve().parents[2] / "out" / "page"
MODEL = "SmolLM2-135M-Instruct"
# Pruned from the first token (no prompt minimum), cut after layer 10 of 30, so that a short
# prompt shows every depth and decode revives tokens.
SCHEDULE = {"stages": [[10, 0.3]], "window": 8, "min_prompt_tokens": 0}
TIMEOUT_MS = 120_000


def chromium() -> str:
    """The system's Chromium: LAZYSERVE_CHROMIUM, else the first of Debian's and others' names."""
    found = os.environ.get("LAZYSERVE_CHROMIUM") or next(
        filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None
    )
    assert found, "no Chromium on this host: `make browser` installs Debian's chromium package"
    return found


def document(chars: int = 1600) -> str:
    from pydoc_data.topics import topics

    return topics["typesseq"][:chars]


@pytest.fixture(scope="module")
def stack(smollm2):
    from services.decode.server import start_decode_worker
    from services.decode.settings import DecodeSettings
    from services.prefill.settings import PrefillSettings
    from services.prefill.worker import start_prefill_worker
    from services.router.app import create_app
    from services.router.settings import GatewaySettings
    from shared.models.text import load_text_model
    from shared.settings import EngineSettings

    engine = EngineSettings(model=MODEL, threads=2)
    decode = start_decode_worker(DecodeSettings(port=0, engine=engine), smollm2)
    prefill = start_prefill_worker(PrefillSettings(port=0, engine=engine), smollm2)
    text = load_text_model(MODEL)
    gateways = []

    def start(**overrides) -> RunningGateway:
        settings = GatewaySettings(prefill_workers=[prefill.address], decode_workers=[decode.address], **overrides)
        gateways.append(RunningGateway(create_app(settings, text)))
        return gateways[-1]

    start.decode, start.prefill, start.main = decode, prefill, start(engine=engine)
    yield start
    for gateway in gateways:
        gateway.stop()
    prefill.stop(grace=0)
    decode.stop(grace=0)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        launched = playwright.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        yield launched
        launched.close()


def open_page(browser, url: str):
    page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))

    def on_console(message) -> None:
        # Chromium logs every 4xx it fetched ("Failed to load resource"); those the page expects
        # (a refused key, a refused schedule) are said on the page, which the tests read.
        if message.type == "error" and not message.text.startswith("Failed to load resource"):
            errors.append(message.text)

    page.on("console", on_console)
    page.goto(url)
    page.errors = errors
    return page


@pytest.fixture
def page(browser, stack):
    opened = open_page(browser, stack.main.url)
    opened.wait_for_selector("body[data-ready=true]")
    yield opened
    assert opened.errors == [], "the page logged errors"
    opened.context.close()


def shot(target, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    target.screenshot(path=str(SHOTS / f"{name}.png"))


def final_event(body: str) -> tuple[dict, dict]:
    """(metrics, usage) from a streamed chat completion's events."""
    metrics = usage = None
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[6:])
            metrics = event.get("metrics") or metrics
            usage = event.get("usage") or usage
    return metrics, usage


def figures(container) -> dict[str, str]:
    """An answer's figures (<dl>), as {term: value}."""
    terms = container.locator("dt").all_inner_texts()
    return dict(zip(terms, container.locator("dd").all_inner_texts(), strict=True))


def use_schedule(page, schedule: dict) -> None:
    page.get_by_label("Pruning").select_option("schedule")
    page.get_by_label("Schedule (JSON)").fill(json.dumps(schedule))


def compose(page, message: str, max_tokens: int, schedule: dict | None = None) -> None:
    """Set the controls as a person would, the message last."""
    if schedule is not None:
        use_schedule(page, schedule)
    page.get_by_label("Max tokens").fill(str(max_tokens))
    page.get_by_label("Message").fill(message)


# ---------------------------------------------------------------------------- the API the page uses
def test_the_page_and_its_files_are_served_with_a_strict_policy(stack):
    index = httpx.get(f"{stack.main.url}/", timeout=10)
    assert index.status_code == 200 and index.headers["content-type"].startswith("text/html")
    policy = index.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy and "frame-ancestors 'none'" in policy
    script = httpx.get(f"{stack.main.url}/ui/app.js", timeout=10)
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert script.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(f"{stack.main.url}/ui/nothing.js", timeout=10).status_code == 404
    assert httpx.head(f"{stack.main.url}/", timeout=10).status_code == 200
    # Nothing is fetched from another host: no address in the files but SVG's namespace name.
    for path in WEB.iterdir():
        addresses = set(re.findall(r"https?://[^\s\"'`)]+", path.read_text()))
        assert addresses <= {"http://www.w3.org/2000/svg"}, path.name
    # The page is not an API route.
    assert "/" not in httpx.get(f"{stack.main.url}/openapi.json", timeout=10).json()["paths"]


def test_tokenize_gives_each_tokens_text_when_asked(stack, smollm2):
    url = f"{stack.main.url}/tokenize"
    prompt = "Héllo, wörld!\n  Two spaces."
    reply = httpx.post(url, json={"prompt": prompt, "return_token_strs": True}, timeout=10).json()
    tokenizer = smollm2.tokenizer
    assert reply["tokens"] == tokenizer(prompt).input_ids
    assert reply["token_strs"] == [tokenizer.decode([token]) for token in reply["tokens"]]
    assert "".join(reply["token_strs"]) == prompt  # every character here is whole in one token
    assert httpx.post(url, json={"prompt": prompt}, timeout=10).json()["token_strs"] is None
    bad = httpx.post(url, json={"prompt": prompt, "return_token_strs": "yes"}, timeout=10)
    assert bad.status_code == 400 and "return_token_strs" in bad.text


# ---------------------------------------------------------------------------- in the browser
def test_a_chat_streams_its_answer(page, stack):
    # Record the answer's length at every change, to see it arrive in pieces.
    page.evaluate(
        """() => {
        window.lengths = [];
        new MutationObserver(() => {
            const answer = document.querySelector('.message.assistant .text');
            if (answer) window.lengths.push(answer.textContent.length);
        }).observe(document.getElementById('conversation'), {subtree: true, childList: true, characterData: true});
    }"""
    )
    page.get_by_label("Max tokens").fill("40")
    box = page.get_by_role("textbox", name="Message")
    box.fill("What is the capital of France?")
    box.press("Shift+Enter")  # a new line, not a send
    box.press_sequentially("Answer in one sentence.")
    assert box.input_value() == "What is the capital of France?\nAnswer in one sentence."
    assert page.locator(".message").count() == 0
    box.press("Enter")
    answer = page.locator(".message.assistant").last
    answer.locator("dl.figures").wait_for(timeout=TIMEOUT_MS)
    text = answer.locator(".text").inner_text()
    lengths = page.evaluate("window.lengths")
    assert len(set(lengths)) >= 3, f"the answer arrived in one piece: {lengths}"
    assert lengths == sorted(lengths) and max(lengths) == len(text)
    assert box.input_value() == ""
    # The same answer the API gives the same request (greedy).
    messages = [{"role": "user", "content": "What is the capital of France?\nAnswer in one sentence."}]
    expected = stack.main.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    assert text == expected.choices[0].message.content
    shown = figures(answer.locator("dl.figures"))
    assert re.fullmatch(r"\d+\.\d\d s", shown["TTFT"]) and float(shown["tokens/s"]) > 0
    assert int(shown["prompt tokens"]) == expected.usage.prompt_tokens
    assert shown["pruning"] == "default" and shown["computed"] == "100.0%"  # under the preset's minimum
    # The next turn carries the conversation, and its prompt's start is cached.
    box.fill("And of Italy?")
    page.get_by_role("button", name="Send").click()
    page.locator(".message.assistant dl.figures").nth(1).wait_for(timeout=TIMEOUT_MS)
    second = figures(page.locator(".message.assistant dl.figures").nth(1))
    assert int(second["prompt tokens"]) > int(shown["prompt tokens"]) and int(second["cached tokens"]) > 0
    said = f"The first {second['cached tokens']} tokens' early layers came from the prefix cache"
    expect(page.get_by_role("figure", name="Where the prompt went")).to_contain_text(said)
    shot(page, "playground")


def test_the_map_shows_each_prompt_token_at_the_depth_the_api_gives(page, stack):
    message = document() + "\n\nWhat does s.count(x) return?"
    compose(page, message, 24, SCHEDULE)
    with page.expect_response("**/v1/chat/completions", timeout=TIMEOUT_MS) as response:
        page.get_by_role("button", name="Send").click()
    figure = page.get_by_role("figure", name="Where the prompt went")
    figure.wait_for(timeout=TIMEOUT_MS)
    metrics, usage = final_event(response.value.text())
    depths, revived = metrics["token_depths"], metrics["revived_positions"]

    cells = figure.locator(".cell[data-index]")
    assert cells.count() == len(depths) == usage["prompt_tokens"]
    assert [int(d) for d in cells.evaluate_all("cells => cells.map(c => c.dataset.depth)")] == depths
    marked = cells.evaluate_all("cells => cells.filter(c => c.dataset.revived).map(c => Number(c.dataset.index))")
    assert marked == revived and revived, "this schedule revives tokens during decode"
    assert min(depths) == 11 and max(depths) == 30  # cut after layer 10 of 30
    # Each cell reads as its token: together they are the templated prompt the server tokenized.
    tokens = httpx.post(
        f"{stack.main.url}/tokenize",
        json={"messages": [{"role": "user", "content": message}], "return_token_strs": True},
        timeout=10,
    ).json()
    assert cells.all_inner_texts() == [s or "\u2205" for s in tokens["token_strs"]]
    # Beside it, the live tokens per layer: at the end, those deeper than the layer.
    live = figure.locator("g.layer").evaluate_all("groups => groups.map(g => Number(g.dataset.live))")
    assert live == [sum(d > layer for d in depths) for layer in range(30)]
    # The same request through the SDK gives the same depths (the page adds nothing of its own).
    again = stack.main.openai().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": message}],
        max_tokens=24,
        temperature=0,
        extra_body={"pruning": SCHEDULE, "return_token_depths": True},
    )
    assert again.model_extra["metrics"]["token_depths"] == depths
    figure.scroll_into_view_if_needed()
    shot(figure, "map")


def test_compare_shows_both_answers_and_where_they_part(page, stack):
    message = document() + "\n\nSummarise the text above in one sentence."
    compose(page, message, 24, SCHEDULE)
    page.get_by_role("button", name="Compare").click()
    page.locator("#difference:not(:empty)").wait_for(timeout=TIMEOUT_MS)
    section = page.get_by_role("region", name="Compare: unpruned and schedule")
    off, pruned = (
        section.get_by_role("article", name="Unpruned", exact=True),
        section.get_by_role("article", name="Pruned", exact=True),
    )
    client = stack.main.openai()
    expected = {}
    for side, pruning in ((off, "off"), (pruned, SCHEDULE)):
        shown = figures(side.locator("dl.figures"))
        assert re.fullmatch(r"\d+\.\d\d s", shown["TTFT"])
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": message}],
            max_tokens=24,
            temperature=0,
            logprobs=True,
            extra_body={"pruning": pruning},
        )
        assert side.locator(".answer").inner_text() == reply.choices[0].message.content
        expected[side] = [item.token for item in reply.choices[0].logprobs.content]
    assert figures(off.locator("dl.figures"))["computed"] == "100.0%"
    assert float(figures(pruned.locator("dl.figures"))["computed"].rstrip("%")) < 100
    first, second = expected[off], expected[pruned]
    said = page.locator("#difference").inner_text()
    if first == second:
        assert said == f"Same answer, token for token ({len(first)} tokens)."
    else:
        at = next(i for i, (a, b) in enumerate(zip(first + [None], second + [None], strict=False)) if a != b)
        assert said.startswith(f"The answers first differ at token {at + 1}:")
        assert section.locator("mark").count() >= 1
    # Neither answer joined the conversation; the message stays, to be sent if wanted.
    assert page.locator(".message").count() == 0 and page.get_by_label("Message").input_value() == message
    shot(section, "compare")


def test_the_service_view_lists_the_workers_and_refreshes(page, stack):
    from services.decode.settings import DecodeSettings

    page.get_by_role("tab", name="Service").click()
    rows = page.get_by_role("table", name="Workers").locator("tbody tr")
    rows.first.wait_for()
    cells = {row.locator("td").all_inner_texts()[0]: row.locator("td").all_inner_texts() for row in rows.all()}
    seen = {tuple(texts[i] for i in (0, 1, 4, 6)) for texts in cells.values()}
    # The decode worker's sequences: what the gateway placed there, of what it reports it holds.
    assert seen == {
        ("decode", stack.decode.address, f"0 of {DecodeSettings().max_sequences}", "healthy"),
        ("prefill", stack.prefill.address, "–", "not asked"),
    }
    # The prefill queues: nothing placed, no prompt waiting in the decode worker's rounds; a rate
    # once a worker has prefilled something (earlier tests' requests).
    assert re.fullmatch(r"0 tokens, 0 waiting(, [\d,]+ tok/s)?", cells["decode"][5]), cells["decode"][5]
    assert re.fullmatch(r"0 tokens(, [\d,]+ tok/s)?", cells["prefill"][5]), cells["prefill"][5]
    cards = figures(page.locator("#service-figures"))
    assert cards["in flight"] == "0" and cards["pruning preset"] == "default" and cards["prefix caching"] == "on"
    assert cards["queued"] == "0 of 1024" and cards["oldest queued"] == "–"
    assert cards["goodput (last minute)"] == "no targets set"
    assert cards["shared state"] == "no Redis"  # no --redis-url
    updated = page.locator("#service-updated").inner_text()
    expect(page.locator("#service-updated")).not_to_have_text(updated, timeout=10_000)  # polled again
    shot(page, "service")


def test_the_service_view_says_when_redis_is_down_and_when_it_is_back(browser, stack, own_redis):
    from services.router.workers import RedisWorkers
    from shared.net.registry import Heartbeat, WorkerInfo

    info = WorkerInfo(role="decode", address=stack.decode.address, model=MODEL)
    heartbeat = Heartbeat(own_redis.url, info, ttl_s=2.0)
    try:
        assert wait_for(lambda: RedisWorkers(own_redis.url).list(), timeout=5)
        gateway = stack(redis_url=own_redis.url)
        page = open_page(browser, gateway.url)
        page.wait_for_selector("body[data-ready=true]")
        page.get_by_role("tab", name="Service").click()
        state = page.locator("#service-figures div").filter(has_text="shared state").locator("dd")
        expect(state).to_have_text("Redis")
        expect(state).not_to_have_class(re.compile("bad"))
        own_redis.stop()  # the next poll's /status finds Redis gone: the gateway serves degraded
        expect(state).to_have_text("Redis down: degraded", timeout=15_000)
        expect(state).to_have_class(re.compile("bad"))
        shot(page.locator("#service-figures"), "service-degraded")
        own_redis.start()
        expect(state).to_have_text("Redis", timeout=15_000)
        expect(state).not_to_have_class(re.compile("bad"))
        assert page.errors == []
        page.context.close()
    finally:
        heartbeat.stop()


def test_bad_input_is_said_and_the_message_is_kept(page):
    box = page.get_by_label("Message")
    page.get_by_label("Pruning").select_option("schedule")
    page.get_by_label("Schedule (JSON)").fill("{not json")
    box.fill("Hello")
    box.press("Enter")
    alert = page.locator("#composer-error")
    alert.filter(has_text="the schedule is not JSON").wait_for()
    use_schedule(page, {"stages": [[40, 0.5]]})  # past the model's 30 layers: the server's 400
    page.get_by_role("button", name="Send").click()
    alert.filter(has_text="stage layer 40").wait_for(timeout=TIMEOUT_MS)
    assert box.input_value() == "Hello" and page.locator(".message").count() == 0
    assert page.get_by_role("button", name="Send").is_enabled()


def test_with_keys_on_the_page_asks_for_one_and_keeps_it_in_the_tab(browser, stack):
    gateway = stack(api_keys=["the-right-key"])
    page = open_page(browser, gateway.url)
    page.errors.clear()
    key = page.get_by_role("textbox", name="API key")
    key.wait_for()
    key.fill("a-wrong-key")
    page.get_by_role("button", name="Use key").click()
    page.locator("#key-error").filter(has_text="refused").wait_for()
    key.fill("the-right-key")
    page.get_by_role("button", name="Use key").click()
    page.wait_for_selector("body[data-ready=true]")
    assert page.evaluate("sessionStorage.getItem('lazyserve.apiKey')") == "the-right-key"
    assert "key" not in page.url
    page.reload()  # the tab keeps it
    page.wait_for_selector("body[data-ready=true]")
    page.get_by_label("Max tokens").fill("4")
    page.get_by_label("Message").fill("Hi")
    page.get_by_label("Message").press("Enter")
    page.locator(".message.assistant dl.figures").wait_for(timeout=TIMEOUT_MS)
    page.get_by_role("button", name="Forget key").click()
    page.get_by_role("textbox", name="API key").wait_for()
    assert page.evaluate("sessionStorage.getItem('lazyserve.apiKey')") is None
    assert page.errors == []
    page.context.close()


@pytest.mark.starts_ray
@pytest.mark.slow
def test_the_page_works_against_make_run(browser):
    """`make run` is `lazyserve up` with its defaults (SmolLM2, the default preset, the prefill actor
    on a local Ray), here on free ports: a long document goes to the prefill worker, is pruned, and
    its map and the service's workers show in the page."""
    from conftest import free_port, kill_sessions, start_process

    args = ["up", "--port", str(free_port()), "--decode-port", str(free_port()), "--prefill-port", str(free_port())]
    process, url = start_process(args, "gateway", timeout=240, session=True)
    try:
        page = open_page(browser, url)
        page.wait_for_selector("body[data-ready=true]")
        compose(page, document(6000) + "\n\nWhat does s.count(x) return? Answer briefly.", 16)
        with page.expect_response("**/v1/chat/completions", timeout=TIMEOUT_MS) as response:
            page.get_by_label("Message").press("Enter")
        figure = page.get_by_role("figure", name="Where the prompt went")
        figure.wait_for(timeout=TIMEOUT_MS)
        assert response.value.headers["x-lazyserve-route"] == "disaggregated"  # over the 1024-token threshold
        metrics, usage = final_event(response.value.text())
        assert metrics["pruning"] == "default" and metrics["computed_fraction"] < 1
        assert figure.locator(".cell[data-index]").count() == usage["prompt_tokens"] > 1024
        assert [
            int(d) for d in figure.locator(".cell[data-index]").evaluate_all("c => c.map(x => x.dataset.depth)")
        ] == (metrics["token_depths"])
        shot(page, "make-run")
        page.get_by_role("tab", name="Service").click()
        rows = page.get_by_role("table", name="Workers").locator("tbody tr")
        rows.first.wait_for()
        assert sorted(row.locator("td").first.inner_text() for row in rows.all()) == ["decode", "prefill"]
        assert page.errors == []
        page.context.close()
    finally:
        process.terminate()
        process.wait(timeout=60)
        kill_sessions({process.pid})


def test_a_file_becomes_the_message_and_a_long_prompt_is_answered_without_a_map(page, tmp_path):
    from pydoc_data.topics import topics

    # Over return_token_depths' 4096 tokens: the answer comes, and the map says why it is not drawn.
    text = topics["typesseq"][:18000]  # about 4,500 tokens
    attached = tmp_path / "notes.txt"
    attached.write_text(text)
    box = page.get_by_label("Message")
    box.fill("Which method removes all items?")
    page.get_by_label("Attach a text file").set_input_files(str(attached))
    # The page reads the file asynchronously (File.text()): wait for it, as a user would see it arrive.
    expect(box).to_have_value(f"{text}\n\nWhich method removes all items?")  # the file first, then what was typed
    page.get_by_label("Max tokens").fill("2")
    with page.expect_request("**/v1/chat/completions") as request:
        box.press("Enter")
    assert request.value.post_data_json["return_token_depths"] is False
    page.locator(".message.assistant dl.figures").wait_for(timeout=TIMEOUT_MS)
    figure = page.get_by_role("figure", name="Where the prompt went")
    expect(figure).to_contain_text("the map is drawn for prompts of up to 4096")
    assert figure.locator(".cell[data-index]").count() == 0


def test_a_send_waits_for_a_file_still_being_read(page):
    # Reading a file is asynchronous; made slow here (File.text() delayed by a second), Enter pressed
    # at once still sends the file with the question, not the question alone.
    page.evaluate(
        """() => {
        const text = Blob.prototype.text;
        Blob.prototype.text = function () {
            return new Promise((done) => setTimeout(() => done(text.call(this)), 1000));
        };
    }"""
    )
    note = "Lists are mutable sequences; tuples are immutable."
    box = page.get_by_label("Message")
    compose(page, "Which of them is mutable?", 2)
    page.get_by_label("Attach a text file").set_input_files(
        files=[{"name": "note.txt", "mimeType": "text/plain", "buffer": note.encode()}]
    )
    with page.expect_request("**/v1/chat/completions", timeout=TIMEOUT_MS) as request:
        box.press("Enter")
    assert request.value.post_data_json["messages"][-1]["content"] == f"{note}\n\nWhich of them is mutable?"
    page.locator(".message.assistant dl.figures").wait_for(timeout=TIMEOUT_MS)
    assert box.input_value() == ""


def test_stop_keeps_the_answer_so_far(page, stack):
    compose(page, "Count from 1 to 200, separated by commas.", 400)
    page.get_by_role("button", name="Send").click()
    answer = page.locator(".message.assistant .text")
    expect(answer).not_to_be_empty(timeout=TIMEOUT_MS)
    page.get_by_role("button", name="Stop").click()
    expect(page.locator(".message.assistant")).to_contain_text("stopped")
    kept = answer.inner_text()
    assert kept and page.get_by_role("button", name="Send").is_enabled()
    # The server let the request go: nothing stays in flight.
    expect(page.get_by_role("button", name="Stop")).to_be_hidden()
    deadline_s = 10
    for _ in range(deadline_s * 10):
        if httpx.get(f"{stack.main.url}/status", timeout=5).json()["in_flight"] == 0:
            break
        page.wait_for_timeout(100)
    assert httpx.get(f"{stack.main.url}/status", timeout=5).json()["in_flight"] == 0


# ------------------------------------------------------------- a base model: Gemma 3, no chat template
GEMMA = "gemma-3-270m"


@pytest.fixture(scope="module")
def gemma_stack(load):
    """Gemma 3 270M behind a gateway, a decode worker and a prefill worker: prompts of 1024 tokens
    and more go through the prefill worker and the transfer."""
    from services.decode.server import start_decode_worker
    from services.decode.settings import DecodeSettings
    from services.prefill.settings import PrefillSettings
    from services.prefill.worker import start_prefill_worker
    from services.router.app import create_app
    from services.router.settings import GatewaySettings
    from shared.models.text import load_text_model
    from shared.settings import EngineSettings

    loaded = load(GEMMA)
    engine = EngineSettings(model=GEMMA, threads=2)
    decode = start_decode_worker(DecodeSettings(port=0, engine=engine), loaded)
    prefill = start_prefill_worker(PrefillSettings(port=0, engine=engine), loaded)
    settings = GatewaySettings(prefill_workers=[prefill.address], decode_workers=[decode.address], engine=engine)
    gateway = RunningGateway(create_app(settings, load_text_model(GEMMA)))
    yield gateway
    gateway.stop()
    prefill.stop(grace=0)
    decode.stop(grace=0)


def test_a_base_model_continues_the_text_and_caches_its_prefix(browser, gemma_stack):
    page = open_page(browser, gemma_stack.url)
    page.wait_for_selector("body[data-ready=true]")
    expect(page.locator("#model-name")).to_contain_text("no chat template")
    # A long text (past the local threshold: prefilled by the prefill worker, pruned by `default`,
    # whose stage moved to a global layer) the model continues, as /v1/completions continues it.
    text = document(6000)
    compose(page, text, 12)
    page.get_by_role("button", name="Send").click()
    answer = page.locator(".message.assistant").last
    answer.locator("dl.figures").wait_for(timeout=TIMEOUT_MS)
    client = gemma_stack.openai()
    expected = client.completions.create(model=GEMMA, prompt=text, max_tokens=12, temperature=0)
    assert answer.locator(".text").inner_text() == expected.choices[0].text
    shown = figures(answer.locator("dl.figures"))
    assert int(shown["prompt tokens"]) == expected.usage.prompt_tokens > 1024
    assert shown["pruning"] == "default" and float(shown["computed"].rstrip("%")) < 100
    # The next turn continues the same document: its start comes from the prefix cache.
    page.get_by_label("Message").fill("\n\nIn short,")
    page.get_by_role("button", name="Send").click()
    page.locator(".message.assistant dl.figures").nth(1).wait_for(timeout=TIMEOUT_MS)
    second = figures(page.locator(".message.assistant dl.figures").nth(1))
    assert int(second["cached tokens"]) > 1024
    # A chat request is refused with the reason, not answered through a template it lacks.
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model=GEMMA, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert page.errors == []
    shot(page, "base-model")
    page.context.close()
