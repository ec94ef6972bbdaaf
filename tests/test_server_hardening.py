"""What an outside probe of the server found (issue 18): no silently ignored fields, no 500s, 404 for an
unknown model, one log line per event, and a served /openapi.json that schemathesis holds the server to."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import hypothesis
import pytest
import requests
import schemathesis
from conftest import write_tiny_checkpoint
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from test_server import KEY, NAME, Live, authorized, check_error, free_port, serve, write_tokenizer

import tierlm

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
SMALL_CONTEXT = 48  # every answer the fuzzer asks for stays short


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory) -> Path:
    """A 2-layer random model with the served tokenizer and a 48-token context."""
    folder = tmp_path_factory.mktemp("hardening") / "tiny"
    write_tiny_checkpoint(folder, "mistral", {"max_position_embeddings": SMALL_CONTEXT})
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def live(small_dir) -> Iterator[Live]:
    with serve(tierlm.load(small_dir, dtype="float32"), api_key=KEY, max_batch_size=4) as s:
        yield s


@pytest.fixture(scope="module")
def http(live) -> Iterator[httpx.Client]:
    with authorized(live) as client:
        yield client


def chat_body(**fields) -> dict:
    return {"model": NAME, "messages": MESSAGES, "max_tokens": 2, **fields}


def completion_body(**fields) -> dict:
    return {"model": NAME, "prompt": "hi", "max_tokens": 2, **fields}


# --- fields the server cannot honour are refused, naming the field -------------------------------------------

UNHONOURED = [  # (path, body, the param the error names)
    (
        CHAT,
        chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        "response_format",
    ),
    (CHAT, chat_body(tool_choice="auto"), "tool_choice"),
    (CHAT, chat_body(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
    (CHAT, chat_body(functions=[{"name": "f", "parameters": {}}]), "functions"),
    (CHAT, chat_body(function_call="auto"), "function_call"),
    (CHAT, chat_body(top_logprobs=2), "top_logprobs"),
    (CHAT, chat_body(modalities=["text", "audio"]), "modalities"),
    (CHAT, chat_body(audio={"voice": "alloy", "format": "wav"}), "audio"),
    (CHAT, chat_body(service_tier="priority"), "service_tier"),
    (CHAT, chat_body(reasoning_effort="high"), "reasoning_effort"),
    (CHAT, chat_body(verbosity="low"), "verbosity"),
    (CHAT, chat_body(web_search_options={}), "web_search_options"),
    # vLLM's extensions at a value other than vLLM's default (they were accepted and ignored)
    (CHAT, chat_body(guided_decoding_backend="xgrammar"), "guided_decoding_backend"),
    (CHAT, chat_body(spaces_between_special_tokens=False), "spaces_between_special_tokens"),
    (CHAT, chat_body(echo=True), "echo"),
    (CHAT, chat_body(continue_final_message=True), "continue_final_message"),  # beside the generation prompt
    (COMPLETIONS, completion_body(prompt_logprobs=1, stream=True), "prompt_logprobs"),  # vLLM's: not streamed
]


@pytest.mark.parametrize("path,body,param", UNHONOURED, ids=[f"{p}:{param}" for p, _, param in UNHONOURED])
def test_field_the_server_cannot_honour_is_400_naming_it(http, path, body, param):
    error = check_error(http.post(path, json=body), 400, param)
    assert error["message"].startswith(param)


def test_fields_at_their_default_or_without_effect_are_accepted(http):
    harmless = dict(
        response_format={"type": "text"},
        tools=[],
        tool_choice="none",
        parallel_tool_calls=True,
        logprobs=False,
        n=1,
        presence_penalty=0,
        modalities=["text"],
        service_tier="auto",
        user="u-1",
        store=False,
        metadata={"run": "7"},
        prediction={"type": "content", "content": "hello"},
    )
    response = http.post(CHAT, json=chat_body(**harmless))
    assert response.status_code == 200, response.text
    response = http.post(COMPLETIONS, json=completion_body(echo=False, best_of=1, suffix="", user="u-1"))
    assert response.status_code == 200, response.text
    vllm_defaults = dict(  # what vLLM's clients send by default (each was a 400)
        ignore_eos=False,
        min_tokens=0,
        use_beam_search=False,
        include_stop_str_in_output=False,
        skip_special_tokens=True,
        stop_token_ids=[],
        guided_decoding_backend="guidance",  # the backend here (llguidance)
    )
    response = http.post(COMPLETIONS, json=completion_body(**vllm_defaults, stop=list("abcde")))  # 5 stops
    assert response.status_code == 200, response.text
    response = http.post(CHAT, json=chat_body(**vllm_defaults, add_generation_prompt=True, echo=False))
    assert response.status_code == 200, response.text


def test_a_chat_can_continue_its_final_message_as_vllm_and_transformers(http, small_dir):
    """add_generation_prompt / continue_final_message reach the template (were fixed at true / false)."""
    tok = tierlm.load(small_dir, dtype="float32").tokenizer
    messages = [*MESSAGES, {"role": "assistant", "content": "Hello th"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    expected = tok.encode(text, add_special_tokens=False)
    assert text.endswith("Hello th")
    fields = dict(messages=messages, add_generation_prompt=False, continue_final_message=True)
    answer = http.post(CHAT, json=chat_body(**fields))
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == len(expected)
    tokenized = http.post("/tokenize", json={"model": NAME, **fields}).json()
    assert tokenized["tokens"] == expected and tokenized["count"] == len(expected)


def test_lm_eval_remote_tokenizer_reads_the_server(live, small_dir):
    """lm-evaluation-harness's remote tokenizer (vLLM's /tokenizer_info, /tokenize, /detokenize): loglikelihood
    tasks run against the server with no tokenizer folder of their own (a GGUF model has none)."""
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    tok = tierlm.load(small_dir, dtype="float32").tokenizer
    url = f"{live.url}/v1/completions"
    assert check_remote_tokenizer_support(url, auth_token=KEY)
    remote = RemoteTokenizer(url, auth_token=KEY)
    text = "Hello there <|im_end|> again"
    assert remote.encode(text) == tok.encode(text, add_special_tokens=False)
    assert remote.decode(tok.encode(text)) == tok.decode(tok.encode(text), skip_special_tokens=False)
    assert remote.eos_token_id == tok.eos_token_ids[0]
    assert remote.tokenizer_info["chat_template"] == tok.chat_template


def test_tokenizer_endpoints_refuse_bad_input_naming_it(http):
    check_error(http.post("/tokenize", json={"model": NAME}), 400, "prompt")
    check_error(http.post("/tokenize", json={"prompt": "a", "model": "gpt-4"}), 404, "model")
    check_error(http.post("/detokenize", json={"tokens": [99999]}), 400, "tokens")
    check_error(http.post("/detokenize", json={"tokens": "12"}), 400, "tokens")


def test_max_completion_tokens_past_the_context_is_named_in_the_error(http):
    error = check_error(http.post(CHAT, json=chat_body(max_tokens=None, max_completion_tokens=10**6)), 400)
    assert error["param"] == "max_completion_tokens" and "max_tokens" not in error["message"]


# --- no 500s ------------------------------------------------------------------------------------------------

SURROGATE = b'"a\\ud800b"'  # JSON for a lone UTF-16 surrogate: valid JSON, not valid Unicode
SURROGATE_BODIES = [  # (path, body with SURROGATE in place of "@", param)
    (COMPLETIONS, b'{"model": "tiny", "prompt": @, "max_tokens": 2}', "prompt"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": [@], "max_tokens": 2}', "prompt[0]"),
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": @}]}', "messages[0].content"),
    (
        CHAT,
        b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": @}]}]}',
        "messages[0].content[0].text",
    ),
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": @}', "stop"),
]


@pytest.mark.parametrize("path,raw,param", SURROGATE_BODIES, ids=[p for *_, p in SURROGATE_BODIES])
def test_lone_surrogate_is_400_naming_the_field(http, path, raw, param):
    response = http.post(
        path, content=raw.replace(b"@", SURROGATE), headers={"Content-Type": "application/json"}
    )
    assert "surrogate" in check_error(response, 400, param)["message"]
    assert http.get("/health").json()["status"] == "ok"


@pytest.mark.parametrize(
    "token", [b"Bearer s\xe9cret", b"Bearer " + KEY.encode() + b"\xff", b"bearer \xe9\xe9"]
)
def test_non_ascii_api_key_is_401_and_the_server_stays_healthy(live, http, token):
    response = httpx.post(
        f"{live.url}{CHAT}", json=chat_body(), headers={"Authorization": token}, trust_env=False
    )
    assert check_error(response, 401)["code"] == "invalid_api_key"
    assert http.post(CHAT, json=chat_body()).status_code == 200


def test_non_ascii_api_key_that_matches_is_accepted(small_dir):
    with serve(tierlm.load(small_dir, dtype="float32"), api_key="s\xe9cret") as s:
        token = "Bearer s\xe9cret".encode()
        response = httpx.post(
            f"{s.url}{CHAT}", json=chat_body(), headers={"Authorization": token}, trust_env=False
        )
    assert response.status_code == 200, response.text


# --- small ones ---------------------------------------------------------------------------------------------


def test_a_developer_message_is_the_system_message(http):
    """OpenAI's newer name for the system role; templates know only "system" (it became a user turn, or a
    turn named "developer")."""

    def completion(role: str) -> dict:
        messages = [{"role": role, "content": "Answer briefly."}, {"role": "user", "content": "Hi"}]
        body = chat_body(messages=messages, max_tokens=4, temperature=0, logprobs=True)
        response = http.post(CHAT, json=body)
        assert response.status_code == 200, response.text
        return response.json()

    developer, system = completion("developer"), completion("system")
    assert developer["usage"] == system["usage"]
    assert developer["choices"][0]["logprobs"] == system["choices"][0]["logprobs"]


@pytest.mark.parametrize(
    "path,body", [(CHAT, chat_body(model="gpt-4")), (COMPLETIONS, completion_body(model="x"))]
)
def test_unknown_model_is_404_model_not_found(http, path, body):
    error = check_error(http.post(path, json=body), 404, "model")
    assert (error["type"], error["code"]) == ("invalid_request_error", "model_not_found")  # OpenAI's
    assert check_error(http.get(f"/v1/models/{body['model']}"), 404, "model")["code"] == "model_not_found"


def test_openapi_documents_openai_errors_instead_of_422(live):
    schema = httpx.get(f"{live.url}/openapi.json", trust_env=False).json()  # served without the key
    operations = [op for path in schema["paths"].values() for op in path.values()]
    assert len(operations) == 9 and not [op for op in operations if "422" in op["responses"]]
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    error_ref = {"$ref": "#/components/schemas/ErrorBody"}
    for path in (CHAT, COMPLETIONS):
        responses = schema["paths"][path]["post"]["responses"]
        for status in ("400", "401", "404", "413", "503"):
            assert responses[status]["content"]["application/json"]["schema"] == error_ref, (path, status)
        assert "text/event-stream" in responses["200"]["content"]
    assert schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]["model"]["examples"] == [
        NAME
    ]


def test_serve_prints_each_log_line_once(small_dir):
    """The CLI gives the `tierlm` logger a handler; the server's lines must not get a second one. It serves
    under --served-model-name (as vLLM's flag), which /v1/models lists."""
    port = free_port()
    command = [sys.executable, "-m", "tierlm.cli", "serve", "--model", str(small_dir), "--dtype", "float32"]
    command += ["--served-model-name", "my-model"]
    proc = subprocess.Popen([*command, "--port", str(port)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", trust_env=False)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
                time.sleep(0.1)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", trust_env=False).json()
        assert [m["id"] for m in models["data"]] == ["my-model"]
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    lines = stderr.splitlines()
    assert sum("serving my-model" in line for line in lines) == 1, stderr
    assert sum("shutting down" in line for line in lines) == 1, stderr


# --- schemathesis against the served schema -----------------------------------------------------------------

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


def name_the_served_model(case: schemathesis.Case) -> None:
    """Address the served model, or every generated request is a 404 for a random model name."""
    if isinstance(case.body, dict):
        case.body["model"] = NAME


WELL_FORMED = {  # answers that run, streamed or not: bodies the fuzzer rarely writes
    COMPLETIONS: [
        completion_body(),
        completion_body(prompt=[5, 6, 7], stream=True, stream_options={"include_usage": True}),
        completion_body(prompt=["hi"], stop=["x"], temperature=0.5, seed=1),
    ],
    CHAT: [
        chat_body(),
        chat_body(stream=True, stream_options={"include_usage": True}),
        chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}], max_tokens=None),
    ],
}


def fuzz(operation, url: str, session: requests.Session, mode: schemathesis.GenerationMode) -> list[int]:
    """The statuses of 20 generated requests (and the WELL_FORMED ones), each answer held to CHECKS."""
    statuses = []

    @hypothesis.settings(
        max_examples=20,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def check(case: schemathesis.Case) -> None:
        name_the_served_model(case)
        response = case.call_and_validate(base_url=url, session=session, checks=CHECKS)
        statuses.append(response.status_code)

    for body in WELL_FORMED.get(operation.path, []) if mode == schemathesis.GenerationMode.POSITIVE else []:
        check = hypothesis.example(case=operation.Case(body=body, media_type="application/json"))(check)
    check()
    return statuses


def test_schemathesis_finds_no_server_error_and_no_schema_violation(live):
    """20 requests per operation valid by the served schema, and 20 invalid ones per POST (a 48-token context
    keeps answers short): every answer is a documented status, content type and body, and none a 5xx."""
    schema = schemathesis.openapi.from_dict(httpx.get(f"{live.url}/openapi.json", trust_env=False).json())
    session = requests.Session()
    session.trust_env = False
    session.headers["Authorization"] = f"Bearer {KEY}"
    operations = [result.ok() for result in schema.get_all_operations()]
    valid, invalid = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
    statuses = [s for op in operations for s in fuzz(op, live.url, session, valid)]
    statuses += [
        s for op in operations if op.method.upper() == "POST" for s in fuzz(op, live.url, session, invalid)
    ]
    assert not [s for s in statuses if s >= 500]
    assert {200, 400, 404} <= set(statuses)
