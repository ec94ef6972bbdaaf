"""Compiled steps built ahead of time (tierlm.aot): built once by one process, loaded by the next.

Builds use CompileConfig(mode="default"), which builds in tens of seconds on the tiny fixture instead of
minutes; the default (max-autotune C++ GEMMs) goes through the same export, store and load. Every build
here costs ~30 s of CPU, so the tests share them: one fp32 package, built by two processes at once, and
continuous batching's steps at 1 and 2 rows, built once and loaded by a server process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from agreement import assert_greedy_agrees, greedy
from tokenizers import Tokenizer, models, pre_tokenizers

import tierlm
from tierlm import CompileConfig, aot, cpu
from tierlm.cache import StaticCache
from tierlm.cache_folder import cache_entries
from tierlm.generation.config import GenerationConfig
from tierlm.generation.continuous import Sequence, SlotBatch

CC = CompileConfig(mode="default")
MODE_ARGS = ["--compile-mode", "default", "--batch-sizes", "1", "--cache-len", "256"]
PROMPT = "w5 w17 w99 w230 w41 w7 w8"
N = 20
IDS = torch.tensor([[5, 17, 99, 230, 41, 7, 8]])

# Run in a subprocess in place of `python -m tierlm.cli`: records every export, AOT compile, inductor
# compile and dynamo frame, and prints them after the command (a server: when SIGTERM stops it), so a test
# sees what that process compiled.
SPY = """
import json, signal, sys
import torch, torch.export, torch._inductor, torch._inductor.compile_fx as cf
from torch._dynamo.utils import counters
calls = []
def spy(name, real):
    def f(*a, **k):
        calls.append(name)
        return real(*a, **k)
    return f
torch.export.export = spy("export", torch.export.export)
torch._inductor.aoti_compile_and_package = spy("aoti_compile_and_package", torch._inductor.aoti_compile_and_package)
cf.compile_fx = spy("compile_fx", cf.compile_fx)
def report():
    seen = {"calls": calls, "frames": counters["frames"]["total"], "graphs": counters["stats"]["unique_graphs"]}
    print("COMPILES " + json.dumps(seen), file=sys.stderr, flush=True)
def stopped(*_):  # uvicorn re-raises the SIGTERM it caught once it has shut down
    report()
    sys.exit(0)
signal.signal(signal.SIGTERM, stopped)
from tierlm import cli
rc = cli.main(sys.argv[1:])
report()
sys.exit(rc)
"""


def write_word_tokenizer(folder: Path, size: int) -> None:
    """Words w0 .. w<size-1>, one id each: enough for text prompts to a tiny random model."""
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("aot") / "llama"
    shutil.copytree(tiny_checkpoints["llama"], folder)
    write_word_tokenizer(folder, json.loads((folder / "config.json").read_text())["vocab_size"])
    return folder


def cli_env(store: Path) -> dict:
    """A store of its own; inductor's cache (precompiled headers, kernels) shared with the session."""
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(
        Path(os.environ["TIERLM_CACHE_DIR"]) / "inductor"
    )
    return {
        **os.environ,
        "TIERLM_CACHE_DIR": str(store),
        "TORCHINDUCTOR_CACHE_DIR": inductor,
        "PYTHONWARNINGS": "ignore",
    }


def tierlm_cli(*args, env: dict, spy: bool = False) -> subprocess.Popen:
    head = [sys.executable, "-c", SPY] if spy else [sys.executable, "-m", "tierlm.cli"]
    return subprocess.Popen(
        [*head, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(proc: subprocess.Popen, timeout: int = 900) -> tuple[str, str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return out, err


@pytest.fixture(scope="module")
def built(tiny, tmp_path_factory):
    """Two `tierlm compile` processes started at once on one empty store: (store, [(stdout, stderr)])."""
    store = tmp_path_factory.mktemp("store")
    args = ("compile", "--model", str(tiny), "--dtype", "float32", *MODE_ARGS)
    procs = [tierlm_cli(*args, env=cli_env(store)) for _ in range(2)]
    return store, [finish(p) for p in procs]


@pytest.fixture(scope="module")
def model(tiny):
    return tierlm.load(tiny, dtype="float32")


@pytest.fixture(scope="module")
def jit_tokens(tiny) -> list[int]:
    """The JIT-compiled step's greedy tokens (torch.compile, same CompileConfig), in this process."""
    result = tierlm.load(tiny, dtype="float32").generate(
        PROMPT, max_new_tokens=N, min_new_tokens=N, do_sample=False, compile_config=CC
    )
    assert result.stats.compile.compile
    return result.token_ids[0]


def test_two_processes_building_one_key_leave_one_valid_package(built, model):
    store, outputs = built
    stderr = "".join(err for _out, err in outputs)
    assert stderr.count("compiled step: built package") == 1  # one built it, the other waited and loaded it
    assert stderr.count("compiled step: loaded package") == 1
    name = aot.digest(aot.package_key(model, 1, 256, CC))
    assert [p.name for p in (store / "aot").iterdir()] == [name]  # no temporary left beside it
    assert sorted(p.name for p in (store / "aot" / name).iterdir()) == ["manifest.json", "step.pt2"]
    package = aot.find(aot.package_key(model, 1, 256, CC), store / "aot")
    assert package is not None and aot.load(package) is not None
    for out, _err in outputs:  # each printed where the package is and its size
        assert str(package.path) in out and "MB" in out
    (entry,) = cache_entries(store)  # `tierlm cache list` shows it
    assert entry.kind == "aot" and entry.about.startswith(
        "compiled step of llama: batch 1, cache 256, float32"
    )


def test_package_loaded_in_a_new_process_matches_jit_without_compiling(built, tiny, jit_tokens):
    store, _ = built
    args = ["generate", "--model", str(tiny), "--dtype", "float32", "--compile", "--compile-mode", "default"]
    args += ["--max-new-tokens", str(N), "--min-new-tokens", str(N), "--json", "--explain", PROMPT]
    out, err = finish(tierlm_cli(*args, env=cli_env(store), spy=True))
    seen = json.loads(err.split("COMPILES ", 1)[1])
    assert seen == {"calls": [], "frames": 0, "graphs": 0}, err  # nothing exported, traced or compiled
    assert "tierlm: compiled step: loaded package" in err and ", built 20" in err  # which package, when built
    assert err.count("compiled step:") == 1, err  # said once, not again by --explain
    result = json.loads(out)
    assert result["stats"]["compiled"] is True
    assert result["token_ids"] == jit_tokens  # fp32: exactly the JIT-compiled step's tokens


def test_a_warm_start_does_not_import_inductor(built, tiny, jit_tokens):
    """Importing torch._inductor costs about 2 s; a process that only loads packages never needs it."""
    store, _ = built
    script = textwrap.dedent(
        f"""
        import sys, json, tierlm
        from tierlm import CompileConfig, GenerationConfig
        model = tierlm.load({str(tiny)!r}, dtype="float32")
        model.use_compiled_packages()  # as generate --compile does: the store under $TIERLM_CACHE_DIR
        cc = CompileConfig(mode="default")
        gen = model.start([{PROMPT!r}], GenerationConfig(max_new_tokens={N}, min_new_tokens={N},
                                                          do_sample=False, compile_config=cc))
        list(gen.stream())
        inductor = "torch._inductor" in sys.modules
        print(json.dumps({{"inductor": inductor, "how": gen.step.how, "tokens": gen.result().token_ids[0]}}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], env=cli_env(store), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["how"].startswith("loaded package") and seen["tokens"] == jit_tokens
    assert seen["inductor"] is False


def copy_store(store: Path, tmp_path: Path) -> Path:
    root = tmp_path / "aot"
    shutil.copytree(store / "aot", root)
    return root


def test_truncated_package_is_rebuilt_not_loaded(built, tiny, jit_tokens, tmp_path):
    root = copy_store(built[0], tmp_path)
    (package,) = root.iterdir()
    data = (package / "step.pt2").read_bytes()
    (package / "step.pt2").write_bytes(data[: len(data) // 2])
    model = tierlm.load(tiny, dtype="float32")
    model.use_compiled_packages(root)
    config = GenerationConfig(max_new_tokens=N, min_new_tokens=N, do_sample=False, compile_config=CC)
    with pytest.warns(aot.PackageRejectedWarning, match=r"is truncated \(\d+ of \d+ bytes\): rebuilding it"):
        gen = model.start([PROMPT], config)
    assert gen.step.how.startswith("built package")
    list(gen.stream())
    assert gen.result().token_ids[0] == jit_tokens
    assert (package / "step.pt2").stat().st_size == json.loads((package / "manifest.json").read_text())[
        "bytes"
    ]
    assert [p.name for p in root.iterdir()] == [package.name]


def test_package_recording_another_cpu_is_rebuilt_not_loaded(built, model, tmp_path, monkeypatch):
    root = copy_store(built[0], tmp_path)
    (package,) = root.iterdir()
    manifest = json.loads((package / "manifest.json").read_text())
    other = "AVX2" if manifest["cpu"]["capability"] != "AVX2" else "AVX512"
    manifest["cpu"] = {**manifest["cpu"], "capability": other}  # as if copied from another machine
    (package / "manifest.json").write_text(json.dumps(manifest))
    loaded, builds = [], []

    class Stop(Exception):
        pass

    def build(_model, _cache, _cc, key, _root):
        builds.append(aot.digest(key))
        raise Stop  # the rebuild itself is what test_truncated_package_is_rebuilt_not_loaded runs

    monkeypatch.setattr(aot, "load", lambda p: loaded.append(p) or pytest.fail("loaded a foreign package"))
    monkeypatch.setattr(aot, "build", build)
    cache = StaticCache(model.config, 1, 256, model.dtype, model.device)
    with (
        pytest.warns(aot.PackageRejectedWarning, match=f"built for another CPU \\({other}"),
        pytest.raises(Stop),
    ):
        aot.Packages(model, root).step(cache, CC)
    assert loaded == [] and builds == [package.name]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "quantize"), [("bfloat16", None), ("bfloat16", "int8"), ("bfloat16", "int4")]
)
def test_reduced_precision_package_agrees_with_jit(tiny, tmp_path, dtype, quantize):
    store = tmp_path / "store"
    args = ["compile", "--model", str(tiny), "--dtype", dtype, *MODE_ARGS]
    finish(tierlm_cli(*args, *(["--quantize", quantize] if quantize else []), env=cli_env(store)))
    packaged = tierlm.load(tiny, dtype=dtype, quantize=quantize)
    packaged.use_compiled_packages(store / "aot")
    got = greedy(packaged, IDS, max_new_tokens=N, min_new_tokens=N, compile_config=CC)
    (step,) = packaged._compiled.values()
    assert step.how.startswith("loaded package")  # built by the other process, loaded here
    jit = greedy(
        tierlm.load(tiny, dtype=dtype, quantize=quantize),
        IDS,
        max_new_tokens=N,
        min_new_tokens=N,
        compile_config=CC,
    )
    assert_greedy_agrees(jit, got, quantize or dtype)


# --- the key: one test per input -------------------------------------------------------------------------


def another_cpu():
    """A stand-in for cpu.detect: this CPU with another instruction set."""
    f = cpu.detect()
    capability = "AVX2" if f.capability != "AVX2" else "AVX512"
    other = cpu.CpuFeatures(f.name, capability, f.native_bf16, f.amx, f.vnni)
    return lambda: other


KEY_CHANGES = {
    "batch": lambda m, mp: aot.package_key(m, 2, 256, CC),
    "cache_len": lambda m, mp: aot.package_key(m, 1, 512, CC),
    "compile_mode": lambda m, mp: aot.package_key(m, 1, 256, CompileConfig()),
    "compile_freezing": lambda m, mp: aot.package_key(
        m, 1, 256, CompileConfig(mode="default", freezing=False)
    ),
    "compile_options": lambda m, mp: aot.package_key(
        m, 1, 256, CompileConfig(mode="default", options={"cpp.simdlen": 256})
    ),
    "torch_version": lambda m, mp: (
        mp.setattr(torch, "__version__", "9.9.9"),
        aot.package_key(m, 1, 256, CC),
    )[1],
    "cpu_capability": lambda m, mp: (
        mp.setattr(cpu, "detect", another_cpu()),
        aot.package_key(m, 1, 256, CC),
    )[1],
    "cpu_vector_extensions": lambda m, mp: (  # the probes inductor picks its kernels' instruction set from
        mp.setattr(
            torch.cpu, "_is_amx_tile_supported", (lambda v: lambda: v)(not torch.cpu._is_amx_tile_supported())
        ),
        aot.package_key(m, 1, 256, CC),
    )[1],
    "tierlm_code": lambda m, mp: (
        mp.setattr(aot, "code_digest", lambda: "edited"),
        aot.package_key(m, 1, 256, CC),
    )[1],
}


@pytest.mark.parametrize("change", sorted(KEY_CHANGES))
def test_key_changes_with(change, model, monkeypatch):
    base = aot.package_key(model, 1, 256, CC)
    assert aot.digest(KEY_CHANGES[change](model, monkeypatch)) != aot.digest(base)


def test_key_changes_with_the_checkpoint(tiny, model, tmp_path):
    base = aot.digest(aot.package_key(model, 1, 256, CC))
    copy = shutil.copytree(tiny, tmp_path / "copy")  # another path
    assert aot.digest(aot.package_key(tierlm.load(copy, dtype="float32"), 1, 256, CC)) != base
    weights = copy / "model.safetensors"
    before = aot.digest(aot.package_key(tierlm.load(copy, dtype="float32"), 1, 256, CC))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # rewritten
    assert aot.digest(aot.package_key(tierlm.load(copy, dtype="float32"), 1, 256, CC)) != before


def test_key_changes_with_dtype_and_quantization(tiny, model):
    keys = {
        "float32": aot.package_key(model, 1, 256, CC),
        "bfloat16": aot.package_key(tierlm.load(tiny, dtype="bfloat16"), 1, 256, CC),
        "int8": aot.package_key(tierlm.load(tiny, dtype="bfloat16", quantize="int8"), 1, 256, CC),
        "int4-g64": aot.package_key(tierlm.load(tiny, dtype="bfloat16", quantize="int4"), 1, 256, CC),
        "int4-g32": aot.package_key(
            tierlm.load(tiny, dtype="bfloat16", quantize="int4", group_size=32), 1, 256, CC
        ),
    }
    assert len({aot.digest(k) for k in keys.values()}) == len(keys)
    assert keys["int4-g32"]["quantization"] == "int4-g32" and keys["int8"]["quantization"] == "int8"
    assert keys["bfloat16"]["dtype"] == "bfloat16"


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (
            ["--batch-sizes", "1,x"],
            "--batch-sizes must be comma-separated integers such as 1,2,4,8, got '1,x'",
        ),
        (
            ["--device-map", '{"": "cpu", "model.layers.1": "disk"}'],
            "tierlm compile builds the whole step of a model resident on the CPU; this one runs on cpu "
            "with offloaded weights",
        ),
    ],
)
def test_compile_command_errors_are_one_line(tiny, tmp_path, args, error):
    proc = tierlm_cli("compile", "--model", str(tiny), "--dtype", "float32", *args, env=cli_env(tmp_path))
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert err.strip().splitlines()[-1] == f"tierlm: error: {error}"
    assert not (tmp_path / "aot").exists() or not any((tmp_path / "aot").iterdir())  # nothing built


# --- continuous batching's steps (SlotCache rows), packaged --------------------------------------------------

SLOT_ROWS = 2  # serve --max-batch-size 2: steps at 1 and 2 rows
SLOT_NEEDED = 512  # the server sizes its cache for min(default max tokens, context) = 512 -> 513 slots
SLOT_PROMPTS = [PROMPT, "w3 w250 w9", "w77 w1 w300 w12 w64"]


def slot_config(**kw) -> GenerationConfig:
    return GenerationConfig(compile_config=CC, do_sample=False, **kw)


@pytest.fixture(scope="module")
def slot_store(tiny, tmp_path_factory):
    """A store warmed by `tierlm compile --serve --max-batch-size 2`: continuous batching's packaged steps
    at 1 and 2 rows, built once; (store, stdout, stderr)."""
    store = tmp_path_factory.mktemp("slot-store")
    args = ["compile", "--serve", "--max-batch-size", str(SLOT_ROWS), "--compile-mode", "default"]
    out, err = finish(tierlm_cli(*args, "--model", str(tiny), "--dtype", "float32", env=cli_env(store)))
    return store, out, err


def test_compile_for_serve_builds_one_slot_step_per_row_count(slot_store, model):
    store, out, err = slot_store
    assert err.count("tierlm: compiled step: built package") == 2, err
    lines = out.strip().splitlines()
    assert [line.split("]")[0] for line in lines[1:]] == ["[1/2", "[2/2"], out
    assert "continuous batch 1, cache 513, float32" in lines[1] and "MB" in lines[1]
    for rows in (1, 2):  # keyed apart from generate's static steps of the same shape
        key = aot.package_key(model, rows, 513, CC, "slots")
        package = aot.find(key, store / "aot")
        assert key["step"] == "slots" and package is not None and str(package.path) in out
        assert aot.digest(key) != aot.digest(aot.package_key(model, rows, 513, CC))
    assert len(list((store / "aot").iterdir())) == 2


def run_slot_batch(model) -> tuple[dict, SlotBatch]:
    """Three greedy requests through 2 rows: A decodes alone (1 row), B joins it (2 rows), B leaves while
    A runs on, C joins A's batch, A leaves and C ends in row 1 (still 2 rows). Tokens per request."""
    batch = SlotBatch(model, SLOT_ROWS, slot_config())
    batch.prepare(SLOT_NEEDED)
    tok = model.tokenizer
    tokens: dict[str, list[int]] = {}

    def join(name: str, prompt: str, n: int) -> None:
        batch.join(Sequence(name, tok.encode(prompt), slot_config(max_new_tokens=n, min_new_tokens=n)))

    def work(units: int | None = None) -> None:
        done = 0
        while batch.busy and (units is None or done < units):
            for u in batch.advance():
                if u.token is not None:
                    tokens.setdefault(u.key, []).append(u.token)
            done += 1

    join("A", SLOT_PROMPTS[0], 24)
    work(4)
    join("B", SLOT_PROMPTS[1], 5)
    work(14)
    join("C", SLOT_PROMPTS[2], 16)
    work()
    return tokens, batch


def test_packaged_slot_steps_equal_the_jit_continuous_steps_as_rows_join_and_leave(slot_store, tiny):
    store, _out, _err = slot_store
    packaged_model = tierlm.load(tiny, dtype="float32")
    packaged_model.use_compiled_packages(store / "aot")
    packaged, batch = run_slot_batch(packaged_model)
    assert sorted(batch.steps) == [1, 2]
    assert all(how.startswith("loaded package") for how in batch.steps.values()), batch.steps
    assert batch.stats["joined_running_batch"] >= 2 and batch.stats["left_running_batch"] >= 2
    assert [len(packaged[k]) for k in "ABC"] == [24, 5, 16]
    jit, jit_batch = run_slot_batch(tierlm.load(tiny, dtype="float32"))
    assert sorted(jit_batch.steps) == [1, 2] and all("torch.compile" in h for h in jit_batch.steps.values())
    assert packaged == jit  # fp32: exactly the JIT-compiled continuous steps' tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_served_compiled_continuous_batching_loads_its_packages_without_compiling(slot_store, tiny):
    """`tierlm serve --compile` (continuous batching) in a new process on a warm store: healthy with its
    steps loaded, not compiled; concurrent requests (more than its rows) get the eager solo tokens."""
    store, _out, _err = slot_store
    port = free_port()
    args = ["serve", "--model", str(tiny), "--dtype", "float32", "--compile", "--compile-mode", "default"]
    proc = tierlm_cli(
        *args, "--max-batch-size", str(SLOT_ROWS), "--port", str(port), env=cli_env(store), spy=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", trust_env=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)
        jobs = [(SLOT_PROMPTS[i % 3], 6 + 4 * i) for i in range(4)]

        def complete(job) -> str:
            body = {"model": "llama", "prompt": job[0], "max_tokens": job[1], "temperature": 0}
            r = httpx.post(f"{url}/v1/completions", json=body, trust_env=False, timeout=300)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(complete, jobs))
        stats = httpx.get(f"{url}/stats", trust_env=False).json()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    seen = json.loads(err.split("COMPILES ", 1)[1])
    assert seen == {"calls": [], "frames": 0, "graphs": 0}, err  # nothing exported, traced or compiled
    assert err.count("tierlm: compiled step: loaded package") == 2, err
    assert "tierlm: [2/2] continuous batch 2, cache 513, float32" in err
    assert sorted(stats["compiled_steps"]) == ["1", "2"], stats
    assert all(how.startswith("loaded package") for how in stats["compiled_steps"].values())
    assert stats["joined_running_batch"] >= 1 and stats["max_batch_size_seen"] == SLOT_ROWS
    eager = tierlm.load(tiny, dtype="float32")
    assert texts == [eager.generate(p, max_new_tokens=n).texts[0] for p, n in jobs]  # EOS ends both alike


def test_max_model_len_sizes_the_served_cache_and_its_steps_at_start(slot_store, tiny):
    """serve --compile --max-model-len: the continuous batch's cache and packaged steps are built for that
    length before the server answers, so a request of that length joins without growing the cache (which
    loads or builds steps of the new length on the worker while every running row waits)."""
    from tierlm.server.app import build_app

    store, _out, _err = slot_store
    model = tierlm.load(tiny, dtype="float32")
    model.use_compiled_packages(store / "aot")
    config = GenerationConfig(compile_config=CC)
    app = build_app(model, max_batch_size=1, generation_config=config, max_model_len=300)
    batch = app.state.tierlm.scheduler._batch
    assert batch.length == 301 and list(batch.steps) == [1], batch.steps  # + the decode's scratch column
    steps = dict(batch.steps)
    request = config.replace(max_new_tokens=290, min_new_tokens=290)
    batch.join(Sequence("A", list(range(5, 15)), request))  # 10 + 290 = max_model_len
    assert batch.length == 301 and batch.steps == steps
    assert next(iter(batch.advance())).token is not None  # its prefill: the first token


def test_a_later_continuous_batch_adopts_the_models_jit_step_and_decodes_its_own_rows(tiny):
    """The JIT path beside the packages: the model keeps one torch.compile'd step per shape, bound to the
    first batch's SlotCache; a later batch on the model (the server's worker makes one after a failed step)
    adopts that view, so the step reads the row slots this batch writes and its tokens are its own."""
    model = tierlm.load(tiny, dtype="float32")
    config = GenerationConfig(compile_config=CompileConfig(scope="layer"), do_sample=False)
    prompts = ([5, 17, 99, 230, 41], [7, 8, 9, 10, 11, 12, 13])
    for prompt in prompts:
        batch = SlotBatch(model, SLOT_ROWS, config)
        batch.join(Sequence("A", prompt, config.replace(max_new_tokens=N, min_new_tokens=N)))
        tokens = []
        while batch.busy:
            tokens += [u.token for u in batch.advance() if u.token is not None]
        assert batch.steps == {1: "torch.compile (JIT), compiled on first use"}
    assert len(model._compiled) == 1  # both batches ran the one step the model keeps for 1 row
    eager = model.generate(torch.tensor([prompts[1]]), max_new_tokens=N, min_new_tokens=N).token_ids[0]
    assert tokens == eager
