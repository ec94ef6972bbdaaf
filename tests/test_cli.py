"""The real `tierlm` command in a subprocess: generate, --json, plan, chat, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tierlm import cpu

TIERLM = [sys.executable, "-m", "tierlm.cli"]


def tierlm(*args, stdin: str | None = None, timeout: int = 300, warnings: str = "ignore", **env_vars):
    env = {**os.environ, "PYTHONWARNINGS": warnings, **env_vars}
    return subprocess.run(
        [*TIERLM, *args], input=stdin, capture_output=True, text=True, timeout=timeout, env=env
    )


def test_generate_default_model_streams_text():
    # the reply depends on the dtype, and "auto" is bf16 or fp32 depending on the CPU: pin it
    proc = tierlm(
        "generate", "--dtype", "float32", "--chat", "--max-new-tokens", "16", "What is the capital of France?"
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "loading" in proc.stderr  # a status line while the model loads


def test_generate_json_output_parses():
    proc = tierlm("generate", "--json", "--max-new-tokens", "8", "--min-new-tokens", "8", "Once upon a time")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["token_ids"]) == 8 and out["text"] and out["finish_reason"] == "length"
    assert out["stats"]["new_tokens"] == 8 and out["stats"]["cache"] == "static"


def test_ignore_eos_decodes_past_the_end_of_the_answer():
    """The default model answers in a few tokens and ends with EOS; --ignore-eos (llama.cpp's flag) goes on."""
    args = ("generate", "--json", "--chat", "--dtype", "float32", "--max-new-tokens", "24")
    question = "What is the capital of France?"
    answered, ignored = tierlm(*args, question), tierlm(*args, "--ignore-eos", question)
    assert answered.returncode == 0 and ignored.returncode == 0, answered.stderr + ignored.stderr
    answered, ignored = json.loads(answered.stdout), json.loads(ignored.stdout)
    assert answered["finish_reason"] == "stop" and len(answered["token_ids"]) < 24
    assert ignored["finish_reason"] == "length" and len(ignored["token_ids"]) == 24
    assert (
        ignored["token_ids"][: len(answered["token_ids"])] == answered["token_ids"]
    )  # EOS sampled, kept going


def test_generate_reads_prompt_from_stdin():
    proc = tierlm("generate", "--json", "--max-new-tokens", "4", stdin="The sky is")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["stats"]["prompt_tokens"] == 3


def test_generate_explain_prints_the_compile_decision():
    proc = tierlm(
        "generate",
        "--explain",
        "--compile",
        "--max-new-tokens",
        "2",
        "--device-map",
        '{"": "cpu", "model.layers.29": "disk"}',
        "Hello",
        warnings="default",
    )
    assert proc.returncode == 0, proc.stderr
    assert (  # the warning for scope "model" under offload is one line, not Python's file:line and source
        "tierlm: warning: compile_config has scope 'model', but the whole decode step cannot be compiled "
        "while weights stream (model.layers.29 is offloaded to disk)" in proc.stderr
    )
    assert ".py:" not in proc.stderr and "self.decision" not in proc.stderr, proc.stderr
    assert (  # --compile under offload compiles the layer body, and says what streams around it
        "compile: layer body on cpu (30 layers; model.layers.29 streams from disk); whole step: no "
        "(model.layers.29 is offloaded to disk; scope 'model' fell back to 'layer')" in proc.stderr
    )
    assert f"tierlm: cpu: {cpu.detect().describe()}" in proc.stderr  # what was detected and selected


def test_compiling_shows_progress():
    proc = tierlm("generate", "--compile-scope", "layer", "--max-new-tokens", "3", "--json", "Hello")
    assert proc.returncode == 0, proc.stderr
    assert "tierlm: compiling the decode step (scope layer, mode default" in proc.stderr
    assert "tierlm: compiled in" in proc.stderr
    assert json.loads(proc.stdout)["stats"]["compiled"] is True


def test_the_first_float_load_of_a_gguf_says_it_dequantizes_it_once(tmp_path):
    """Dequantizing a GGUF into the cache takes minutes for a large file: the first float load says so. A
    quantized load of the default (Q4_1: its codes as int4) reads the file itself and writes no weights."""
    fresh = {"TIERLM_CACHE_DIR": str(tmp_path)}
    args = ("generate", "--max-new-tokens", "1", "--json", "Hi")
    quantized = tierlm(*args, "--quantize", "int4", **fresh)
    assert quantized.returncode == 0 and "dequantizing" not in quantized.stderr, quantized.stderr
    assert not list(tmp_path.rglob("weights-*"))
    first = tierlm(*args, "--quantize", "none", **fresh)
    assert first.returncode == 0, first.stderr
    assert "tierlm: dequantizing SmolLM2-135M-Instruct.Q4_1.gguf to torch." in first.stderr
    assert f"once, into {tmp_path}" in first.stderr
    again = tierlm(*args, "--quantize", "none", **fresh)
    assert again.returncode == 0 and "dequantizing" not in again.stderr, again.stderr


def test_text_prompt_without_tokenizer_is_a_one_line_error(tiny_checkpoints):
    proc = tierlm("generate", "--model", str(tiny_checkpoints["llama"]), "Hello")
    assert proc.returncode != 0
    assert (
        proc.stderr.strip().splitlines()[-1]
        == "tierlm: error: text prompts need a tokenizer; this model has none (pass token ids)"
    )


@pytest.mark.parametrize(
    "args, needle",
    [
        (["generate", "--bogus-flag", "hi"], "unrecognized arguments: --bogus-flag"),
        (["generate", "--model", "/no/such/model.gguf", "hi"], "does not exist"),
        (["generate", "--max-new-tokens", "0", "hi"], "max_new_tokens"),
        (["generate", "--temperature", "-1", "hi"], "temperature"),
        (["generate", "--device-map", "{not json", "hi"], "not valid JSON"),
        (["plan", "--device-map", '{"model.layerz.0": "disk"}'], "model.layers"),
        (["plan", "--device-map", "gpu"], "device_map 'gpu' is neither a device"),
        (["plan", "--max-memory", ""], "--max-memory is empty"),
        (["cache", "purge"], "invalid choice: 'purge'"),
        (
            ["generate", "--max-new-tokens", "100000", "hi"],
            "exceed the model's context of 8192: use --max-new",
        ),
        (["generate", "--compile", "--no-compile", "hi"], "--no-compile contradicts --compile"),
        (["serve", "--port", "99999"], "--port must be in 0-65535, got 99999"),
        (["serve", "--api-key", ""], "--api-key must not be empty"),
        (["serve", "--replicas", "0"], "--replicas must be >= 1, got 0"),
        (["serve", "--max-model-len", "1"], "--max-model-len must be >= 2, got 1"),
        (["compile", "--max-model-len", "600"], "--max-model-len goes with --serve"),
        (  # before Ray starts: each replica would fail after loading the model, and Ray retry it
            ["serve", "--replicas", "1", "--port", "0", "--max-model-len", "9000"],
            "--max-model-len 9000 exceeds the model's context of 8192",
        ),
        (
            ["compile", "--serve", "--max-model-len", "9000"],
            "--max-model-len 9000 exceeds the model's context of 8192",
        ),
        (["serve", "--served-model-name", " "], "--served-model-name must not be empty"),
        (
            ["compile", "--serve", "--batching", "static", "--max-batch-size", "-1"],
            "--max-batch-size must be >= 1",
        ),
    ],
)
def test_errors_are_one_line_with_nonzero_exit(args, needle):
    proc = tierlm(*args)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("tierlm: error")]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_on_a_port_in_use_is_one_line_before_the_model_loads():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = tierlm("serve", "--port", str(port), timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"tierlm: error: cannot serve on 127.0.0.1:{port}: Address already in use"
    ]


def test_a_prompt_that_is_not_utf8_is_a_one_line_error():
    proc = subprocess.run(
        [*TIERLM, "generate", "--max-new-tokens", "2"], input=b"a\xff\xfeb", capture_output=True, timeout=300
    )
    assert proc.returncode == 1
    assert proc.stderr.decode().splitlines() == [
        "tierlm: error: the prompt is not valid UTF-8 (at character 1)"
    ]


def test_chat_goes_on_after_a_message_the_context_cannot_hold():
    """An over-long message is one error line; the session, and what was said before, go on."""
    turns = ["Hi, my name is Ada.", "a " * 9000, "What is my name?"]
    proc = tierlm("chat", "--max-new-tokens", "4", stdin="\n".join(turns) + "\n")
    assert proc.returncode == 0, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("tierlm: error")]
    assert len(errors) == 1 and "exceeds the model's context of 8192" in errors[0], proc.stderr
    assert errors[0].endswith("this message was not sent")
    replies = proc.stdout.split("> ")[1:]
    assert len(replies) == 4 and replies[1] == "" and replies[0].strip() and replies[2].strip()


def test_chat_with_tools_prints_each_call_and_reads_its_result(tmp_path):
    """`tierlm chat --tools FILE`: a named tool choice makes the first answer a call, printed with its JSON
    arguments; the next input line is its result, and the model then answers in text."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city", "unit"],
                },
            },
        }
    ]
    (tmp_path / "tools.json").write_text(json.dumps(tools))
    args = (
        "chat",
        "--tools",
        str(tmp_path / "tools.json"),
        "--tool-choice",
        "get_weather",
        "--max-new-tokens",
        "40",
    )
    proc = tierlm(*args, stdin="What is the weather in Paris?\n18 degrees, clear\n")
    assert proc.returncode == 0, proc.stderr
    call = next(line for line in proc.stdout.splitlines() if "call get_weather(" in line)
    arguments = json.loads(call[call.index("(") + 1 : call.rindex(")")])
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    after = proc.stdout.split("get_weather result> ", 1)[1]
    assert after.strip() and not after.lstrip().startswith("call ")  # a text answer (tool_choice auto now)
    bad = tierlm("chat", "--tools", str(tmp_path / "missing.json"), stdin="")
    assert bad.returncode != 0 and bad.stderr.strip().startswith("tierlm: error: --tools")


def test_plan_shows_tiers_streaming_and_decision():
    proc = tierlm(
        "plan", "--dtype", "float32", "--device-map", "auto", "--max-memory", "cpu=350MB", "--compile"
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "model.layers.0-" in out and "disk" in out
    assert "streamed per token:" in out and "from disk" in out
    assert "compile: layer body on cpu (30 layers; model.layers." in out and "stream from disk" in out
    assert "whole step: no (" in out and "offloaded to disk" in out
    assert f"cpu: {cpu.detect().describe()}" in out


def test_plan_takes_one_device_as_the_device_map():
    """As transformers' device_map="cpu": the whole model there (a JSON error before)."""
    proc = tierlm("plan", "--dtype", "float32", "--device-map", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "nothing (all weights resident)" in proc.stdout


def test_plan_counts_quantized_weights_at_their_packed_size():
    from tierlm.plan import plan

    float_bytes = plan(dtype="bfloat16").module_bytes
    int4_plan = plan(dtype="bfloat16", quantize="int4")
    int4_bytes = int4_plan.module_bytes
    assert int4_plan.quantization[:2] == (
        "int4",
        32,
    )  # the default GGUF is Q4_1: its 32-wide blocks carry over
    layer = "model.layers.0"
    # q/k/v/o/gate/up/down at 4.5 bits per weight (codes + bf16 scale and zero per 32) plus the float norms
    assert 0.25 < int4_bytes[layer] / float_bytes[layer] < 0.32
    assert int4_bytes["lm_head"] > 0  # a tied LM head gets its own packed copy
    # bf16 as in the library half above: "auto" is bf16 or fp32 depending on the CPU
    proc = tierlm(
        "plan",
        "--dtype",
        "bfloat16",
        "--quantize",
        "int8",
        "--device-map",
        "auto",
        "--max-memory",
        "cpu=250MB",
    )
    assert proc.returncode == 0, proc.stderr
    assert "int8 weights" in proc.stdout and "nothing (all weights resident)" in proc.stdout


def test_plan_says_whether_the_gguf_stays_packed_and_quantize_none_widens_it():
    """With no --quantize the default GGUF's Q4_1 blocks stay packed where this CPU's detection says so
    (tierlm.cpu), and the plan says it is that default; --quantize none asks for float weights."""
    default = tierlm("plan")
    assert default.returncode == 0, default.stderr
    first = default.stdout.splitlines()[0]
    if cpu.detect().keeps_q4_packed:
        assert (
            "int4 weights (group 32): the GGUF's 4-bit blocks kept as int4 (their own codes), this CPU's default"
            in first
        )
    else:
        assert "weights" not in first
    float_weights = tierlm("plan", "--quantize", "none")
    assert float_weights.returncode == 0, float_weights.stderr
    assert float_weights.stdout.splitlines()[0].endswith("30 layers, bfloat16)")


def test_max_memory_alone_implies_device_map_auto():
    """Budgets only mean something to an inferred map: --max-memory alone is never silently ignored."""
    implied = tierlm("plan", "--dtype", "float32", "--max-memory", "cpu=350MB")
    assert implied.returncode == 0, implied.stderr
    assert "disk" in implied.stdout and "streamed per token:" in implied.stdout
    explicit = tierlm("plan", "--dtype", "float32", "--device-map", "auto", "--max-memory", "cpu=350MB")

    def steady(text: str) -> list[str]:  # the memory this process finds moves between two runs
        return [line for line in text.splitlines() if not line.startswith("memory of this process:")]

    assert steady(implied.stdout) == steady(explicit.stdout)
    assert "implies --device-map auto" in " ".join(tierlm("generate", "--help").stdout.split())


def test_chat_keeps_history_and_exits_on_eof():
    import tierlm as lib

    turns = ["Hi, my name is Ada.", "What is my name?"]
    proc = tierlm("chat", "--dtype", "float32", "--max-new-tokens", "12", stdin="\n".join(turns) + "\n")
    assert proc.returncode == 0, proc.stderr
    replies = [r.rstrip("\n") for r in proc.stdout.split("> ")[1:3]]
    model = lib.load(dtype="float32")  # exact tokens: the same fp32 on every CPU
    history = [
        {"role": "user", "content": turns[0]},
        {"role": "assistant", "content": replies[0]},
        {"role": "user", "content": turns[1]},
    ]
    prompt = model.tokenizer.apply_chat_template(history)
    assert replies[1] == model.generate(prompt, max_new_tokens=12).texts[0]  # the second turn saw the first
    assert proc.stdout.endswith("> \n")  # EOF at the third prompt ends the session cleanly


def test_bench_passes_its_arguments_through_in_order(capsys):
    from tierlm.cli import main

    with pytest.raises(SystemExit) as exit_info:  # decode.py's own check rejects --runs 0
        main(["bench", "--runs", "0", "--new-tokens", "4"])
    assert exit_info.value.code == 2
    assert "--runs >= 1" in capsys.readouterr().err


def test_chat_in_a_terminal_reads_a_message_longer_than_its_line_limit():
    """A terminal's line discipline cuts a line at 4095 bytes: 9000 words (past the 8192-token context) came
    through as 2047, and were answered, without a word. With readline the whole message arrives."""
    import pty
    import select
    import threading

    pid, fd = pty.fork()
    if pid == 0:  # the child: tierlm chat on the terminal
        os.environ["PYTHONWARNINGS"] = "ignore"
        os.execv(sys.executable, [*TIERLM, "chat", "--max-new-tokens", "1"])
    out = bytearray()
    done = threading.Event()

    def drain() -> None:  # readline echoes every byte: read it, or the child blocks writing
        while not done.is_set():
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    out.extend(os.read(fd, 65536))
                except OSError:
                    return

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while b"> " not in out and time.monotonic() < deadline:  # loaded: the prompt
            time.sleep(0.2)
        message = ("a " * 9000).encode() + b"\r"
        for i in range(0, len(message), 512):
            os.write(fd, message[i : i + 512])
            time.sleep(0.01)
        while b"exceeds the model's context" not in out and time.monotonic() < deadline:
            time.sleep(0.2)
        os.write(fd, b"/exit\r")
        os.waitpid(pid, 0)
    finally:
        done.set()
        reader.join()
        os.close(fd)
    assert b"exceeds the model's context of 8192" in out, bytes(out[-400:])


def test_the_clis_log_lines_go_to_stderr_as_it_is_when_they_are_logged(capsys):
    """The CLI's handler writes to sys.stderr of the moment: an in-process run (tests run `tierlm serve`'s
    main) whose captured stream is closed later left server log lines failing with "Logging error"."""
    import io
    import logging

    from tierlm.cli.common import show_library_progress

    gone = io.StringIO()
    real, sys.stderr = sys.stderr, gone
    try:
        show_library_progress()
    finally:
        sys.stderr = real
    gone.close()
    logging.getLogger("tierlm.server").info("a line after that stream closed")
    err = capsys.readouterr().err
    assert "tierlm: a line after that stream closed" in err and "Logging error" not in err
