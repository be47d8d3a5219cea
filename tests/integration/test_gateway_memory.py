"""The gateway's memory comes back after a burst of oversized and ordinary requests.

The gateway runs as its own process (`lazyserve gateway`, the command `up` and compose run) so
its resident memory is its own. A warm-up round first (tokenizer caches and the like are kept on
purpose), then rounds of: prompts of megabytes under the body cap (refused by the character bound
before tokenizing), bodies over the cap (refused while reading), and ordinary completions, all in
parallel. The RSS after the rounds must be within a small margin of the RSS after the warm-up.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from conftest import free_port, wait_for

MARGIN_MB = 80
ROUNDS = 3


@pytest.fixture
def gateway_process(tiny_llama, decode_worker_session):
    port = free_port()
    args = ["gateway", "--model", "tiny-llama", "--threads", "1", "--port", str(port)]
    args += ["--decode-workers", decode_worker_session(tiny_llama)]
    process = subprocess.Popen([sys.executable, "-m", "services.cli", *args], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        assert wait_for(up, timeout=120), "the gateway did not start"
        yield url, psutil.Process(process.pid)
    finally:
        process.terminate()
        process.wait(timeout=30)


def _burst(url: str) -> list[int]:
    huge_prompt = {"messages": [{"role": "user", "content": "word " * 700_000}], "max_tokens": 2}  # 3.5 MB
    over_cap = json.dumps({"prompt": "x" * (5 << 20)})  # 5 MiB, over the 4 MiB body cap

    def chunked():
        for start in range(0, len(over_cap), 1 << 16):
            yield over_cap[start : start + (1 << 16)].encode()

    calls = [lambda: httpx.post(f"{url}/v1/chat/completions", json=huge_prompt, timeout=60)] * 3
    calls += [lambda: httpx.post(f"{url}/v1/completions", content=chunked(), timeout=60)] * 3
    ordinary = {"prompt": "The quick brown fox", "max_tokens": 4}
    calls += [lambda: httpx.post(f"{url}/v1/completions", json=ordinary, timeout=60)] * 6
    with ThreadPoolExecutor(len(calls)) as pool:
        return sorted(reply.status_code for reply in pool.map(lambda call: call(), calls))


def test_memory_comes_back_after_a_burst(gateway_process):
    url, process = gateway_process
    expected = [200] * 6 + [400] * 3 + [413] * 3
    assert _burst(url) == expected  # the warm-up round
    warm = process.memory_info().rss
    peak = warm
    for _ in range(ROUNDS):
        assert _burst(url) == expected
        peak = max(peak, process.memory_info().rss)
    after = process.memory_info().rss
    print(f"gateway RSS: warm {warm / 2**20:.0f} MiB, after {ROUNDS} bursts {after / 2**20:.0f} MiB")
    assert after - warm < MARGIN_MB * 2**20, (warm / 2**20, after / 2**20)
