"""Batch invariance by default (issue 58 item 4): a request's greedy and seeded tokens are its solo run's,
whatever else the server is doing.

The default model as `load()` gives it (int4 weights on tierlm's kernels, bf16 activations), a real server on
loopback: 16 concurrent chat requests of mixed lengths, half greedy and half seeded at temperature 0.9, each
compared token for token with the same request sent alone.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_server import serve

import tierlm

QUESTIONS = [
    "Hi",
    "What is the capital of France?",
    "Write a haiku about the sea, the wind, and a small boat far from the shore.",
    "Explain in two sentences why the sky is blue, then say what colour sunsets are and why they look that way.",
]


def ask(url: str, i: int) -> dict:
    body = {
        "model": "tiny",
        "messages": [
            {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + " " * (i // len(QUESTIONS))}
        ],
        "max_tokens": 12 + i % 5,
        "logprobs": True,
    }
    body.update({"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "seed": 100 + i})
    with httpx.Client(trust_env=False, timeout=300) as http:
        reply = http.post(f"{url}/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def tokens(choice: dict) -> list[str]:
    return [t["token"] for t in choice["logprobs"]["content"]]


@pytest.fixture(scope="module")
def model(default_model_path):
    return tierlm.load(default_model_path)


def test_sixteen_concurrent_requests_each_equal_their_solo_runs(model):
    with serve(model, max_batch_size=16) as live:
        with ThreadPoolExecutor(16) as pool:
            together = list(pool.map(lambda i: ask(live.url, i), range(16)))
        stats = httpx.get(f"{live.url}/stats", trust_env=False).json()
        solo = [ask(live.url, i) for i in range(16)]
    assert max(int(k) for k, v in stats["batch_sizes"].items() if v) > 4  # they did run together
    for i, (a, b) in enumerate(zip(together, solo)):
        assert tokens(a) == tokens(b), (i, a["message"]["content"], b["message"]["content"])
        assert a["message"]["content"] == b["message"]["content"]
