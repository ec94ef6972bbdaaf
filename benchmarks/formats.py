"""Decode and prefill speed, load time and peak memory of tierlm vs llama.cpp on random-weight GGUF files of
real model shapes, per GGUF format (Q4_0, Q4_K_M, Q6_K, Q8_0 ...), against a memory-bandwidth bound.

Shapes: "1b" = Llama-3.2-1B's (tied embeddings), "8b" = Llama-3.1-8B's (untied output), "tiny" for a smoke
test; SmolLM2's vocabulary (49152 tokens, tokenizer.* keys copied from the default model's GGUF) so both
engines tokenize. Each shape is written once as a Q8_0 GGUF with gguf-py (weights normal, std 0.02; norms
ones; no rope_freqs tensor, which costs nothing per token) and converted with llama.cpp's own quantizer
(llama_model_quantize) to each format; all cached in ~/.cache/tierlm-bench/formats/<shape>/.
Per file and round, a fresh process per engine, tierlm then llama.cpp, both on --threads threads:
tierlm: `tierlm.load(path)` twice (first and warm load), peak RSS (VmHWM) after loading, decode tok/s at
batch 1 and 8 as benchmarks/engines.py measures it ((new tokens - 1) x batch / (wall time of the full
generate - that of a one-token generate), after one warm-up), prefill tok/s = prompt tokens / time of a
one-token generate over a --prefill-tokens prompt (after one warm-up; tierlm prefills in its default chunks).
llama.cpp (llama-cpp-python, n_ctx 1024, n_batch 512): decode tok/s = wall clock of eval() of one token at
a time after the prompt (greedy), prefill tok/s = eval() of the same long prompt; batch 1 only.
Bound: memory read bandwidth (best of 5 `torch.ones(2**28).sum()` on --threads threads, in the parent after
the children) / bytes a decode step reads (every tensor of the file, token_embd only one row unless it is
also the tied output head; the KV cache of the short prompt is left out). Medians over --rounds.
Run: python benchmarks/formats.py [--help]
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    MB,
    _proc_status_kb,
    contention_warning,
    cpu_header,
    current_rss_mb,
    default_model_file,
    fmt,
    machine_load,
    median,
    print_table,
    status,
    timed,
    write_json,
)

# hidden, layers, FFN, heads, kv heads, tied output, rope theta
SHAPES = {
    "tiny": dict(hidden=256, layers=2, ffn=512, heads=4, kv=2, tied=True, theta=500000.0),
    "1b": dict(hidden=2048, layers=16, ffn=8192, heads=32, kv=8, tied=True, theta=500000.0),
    "8b": dict(hidden=4096, layers=32, ffn=14336, heads=32, kv=8, tied=False, theta=500000.0),
}
FORMATS = "Q4_0,Q4_K_M,Q6_K,Q8_0"
CACHE = Path.home() / ".cache" / "tierlm-bench" / "formats"
RESULT = "RESULT "  # a child's last stdout line: this prefix, then JSON
N_CTX = 1024
VOCAB = 49152  # SmolLM2's token count, checked against the copied tokens
TEXT = (
    "The sea was calm that morning, and the fishermen pushed their boats out before sunrise. "
    "They talked quietly about the weather, the price of fish and the long winter ahead. "
    "An old man on the pier mended his nets and watched the gulls circle over the harbour. "
    "Children ran along the beach, collecting shells and shouting at the waves. "
    "In the village the baker opened his shop, and the smell of fresh bread filled the street. "
    "A teacher walked to the school with a bag of books under her arm. "
    "By noon the wind had turned, and dark clouds gathered over the hills to the west. "
    "The boats came back early, their decks full of silver fish and tired men. "
)
SENTENCES = [s.strip() + "." for s in TEXT.split(". ") if s.strip()]  # the batch-8 prompts
LONG_TEXT = TEXT * 16  # well over 512 tokens, cut to --prefill-tokens


def tensor_specs(shape: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape: rows = output features) in llama.cpp's order."""
    h, f = shape["hidden"], shape["ffn"]
    q, kv = h, shape["kv"] * (h // shape["heads"])
    layer = [("attn_norm", (h,)), ("attn_q", (q, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h))]
    layer += [("attn_output", (h, q)), ("ffn_norm", (h,)), ("ffn_gate", (f, h)), ("ffn_up", (f, h))]
    layer += [("ffn_down", (h, f))]
    specs = [("token_embd.weight", (VOCAB, h))]
    specs += [(f"blk.{i}.{n}.weight", d) for i in range(shape["layers"]) for n, d in layer]
    specs.append(("output_norm.weight", (h,)))
    return specs + ([] if shape["tied"] else [("output.weight", (VOCAB, h))])


def random_q8(rng, rows: int, cols: int):
    """A random normal (std 0.02) matrix as Q8_0 blocks, made a few rows at a time."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    out = np.empty((rows, cols // 32 * 34), dtype=np.uint8)
    step = max(1, (1 << 24) // cols)
    for start in range(0, rows, step):
        chunk = rng.standard_normal((min(step, rows - start), cols), dtype=np.float32)
        chunk *= 0.02
        out[start : start + len(chunk)] = quants.quantize(chunk, GGMLQuantizationType.Q8_0)
    return out


def write_q8(name: str, shape: dict, dst: Path) -> None:
    """The shape as a Q8_0 GGUF, written tensor by tensor (only one tensor in memory at a time)."""
    import gguf
    import numpy as np

    vocab = gguf.GGUFReader(default_model_file())
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name(f"random {name}")
    hyper = {"context_length": 131072, "embedding_length": shape["hidden"], "block_count": shape["layers"]}
    hyper |= {"feed_forward_length": shape["ffn"], "attention.head_count": shape["heads"]}
    hyper |= {
        "attention.head_count_kv": shape["kv"],
        "rope.dimension_count": shape["hidden"] // shape["heads"],
    }
    for key, value in hyper.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_rope_freq_base(shape["theta"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, field in vocab.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), field.types[0], sub)
    tokens = len(vocab.fields["tokenizer.ggml.tokens"].data)
    assert tokens == VOCAB, tokens
    w.add_vocab_size(tokens)
    specs = tensor_specs(shape)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for tensor, dims in specs:
        if len(dims) == 1:
            w.add_tensor_info(tensor, dims, np.dtype(np.float32), dims[0] * 4)
        else:
            row = dims[1] // 32 * 34  # Q8_0: 34 bytes per block of 32
            w.add_tensor_info(tensor, (dims[0], row), np.dtype(np.uint8), dims[0] * row, q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for i, (tensor, dims) in enumerate(specs):
        if i % 20 == 0:
            status(f"  writing {dst.name}: tensor {i + 1}/{len(specs)} ({tensor})")
        w.write_tensor_data(np.ones(dims, np.float32) if len(dims) == 1 else random_q8(rng, *dims))
    w.close()
    os.replace(tmp, dst)


def convert(src: Path, dst: Path, fmt_name: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{fmt_name}")
    params.allow_requantize = True  # the source is Q8_0
    tmp, log = dst.with_name(f".{dst.name}.{os.getpid()}.tmp"), dst.with_suffix(".quantize.log")
    with open(log, "w") as f:  # llama.cpp logs every tensor to fd 2: into this file instead
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"llama_model_quantize to {fmt_name} failed ({rc}):\n{log.read_text()[-2000:]}")
    os.replace(tmp, dst)


def ensure_files(name: str, formats: list[str]) -> dict[str, Path]:
    folder = CACHE / name
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "source-Q8_0.gguf"
    if not src.is_file():
        status(f"{name}: writing the random Q8_0 source {src} ...")
        seconds, _ = timed(lambda: write_q8(name, SHAPES[name], src))
        status(f"  done in {seconds:.0f} s ({src.stat().st_size / MB:,.0f} MB)")
    files = {}
    for f in formats:
        files[f] = folder / f"{f}.gguf"
        if not files[f].is_file():
            status(f"{name}: llama.cpp quantizing to {f} ...")
            seconds, _ = timed(lambda f=f: convert(src, files[f], f))
            status(f"  done in {seconds:.0f} s ({files[f].stat().st_size / MB:,.0f} MB)")
    return files


def bandwidth_gb_s(threads: int) -> float:
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(2**28)
    best = min(timed(x.sum)[0] for _ in range(5))
    return x.numel() * 4 / best / 1e9


def bytes_per_token(path: Path) -> tuple[int, bool]:
    """Bytes a decode step reads (token_embd: one row, unless it is the tied output head) and whether tied."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    tied = "output.weight" not in tensors
    if not tied:
        embd = tensors["token_embd.weight"]
        total -= int(embd.n_bytes) - int(embd.n_bytes) // int(embd.shape[-1])  # shape is (hidden, vocab)
    return total, tied


def peak_rss_mb() -> float:
    """This process's peak RSS: VmHWM, as common.peak_rss_mb's ru_maxrss keeps the high-water mark of the
    parent across fork and exec (its GGUF writing, its 1 GiB bandwidth probe)."""
    return _proc_status_kb("VmHWM") * 1024 / MB


def child_tierlm(path: Path, args) -> dict:
    import torch
    from engines import TierlmEngine

    import tierlm

    torch.set_num_threads(args.threads)
    base = current_rss_mb()
    first_s, model = timed(lambda: tierlm.load(path))
    first_peak = peak_rss_mb()  # one load's peak (the second load's would add the first model's leftovers)
    del model
    gc.collect()
    load_s, model = timed(lambda: tierlm.load(path))
    loaded_peak = peak_rss_mb()
    q = model.plan.quantization
    engine, n = TierlmEngine(model), args.new_tokens
    out = {"first_load_s": first_s, "load_s": load_s, "baseline_rss_mb": base, "peak_rss_mb": first_peak}
    out["peak_rss_two_loads_mb"] = loaded_peak
    out["quantization"] = None if q is None else {"mode": q.mode, "group": q.group, "int8": len(q.int8)}
    for batch in (1, 8):
        rows = [model.tokenizer.encode(s) for s in SENTENCES[:batch]]
        engine.sample(rows, n)  # warm-up
        s = engine.sample(rows, n)
        out[f"decode_b{batch}_tok_s"] = (n - 1) * batch / (s.total_s - s.prefill_s)
        out[f"loop_b{batch}_tok_s"] = s.loop_tok_s
    rows = [model.tokenizer.encode(LONG_TEXT)[: args.prefill_tokens]]
    engine._generate(rows, 1)  # warm-up
    seconds, _ = timed(lambda: engine._generate(rows, 1))
    out["prefill_tok_s"] = len(rows[0]) / seconds
    out["final_peak_rss_mb"] = peak_rss_mb()
    return out


def child_llama(path: Path, args) -> dict:
    import llama_cpp
    import numpy as np

    base = current_rss_mb()
    options = dict(n_threads=args.threads, n_threads_batch=args.threads, n_ctx=N_CTX, n_batch=512)
    load_s, llm = timed(lambda: llama_cpp.Llama(model_path=str(path), verbose=False, **options))
    loaded_peak = peak_rss_mb()

    def decode(prompt: list[int], n: int) -> float:
        llm.reset()
        llm.eval(prompt)
        start = time.perf_counter()
        for _ in range(n - 1):  # the first new token comes from the prompt's logits
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        return (n - 1) / (time.perf_counter() - start)

    def prefill(prompt: list[int]) -> float:
        llm.reset()
        seconds, _ = timed(lambda: llm.eval(prompt))
        return len(prompt) / seconds

    short = llm.tokenize(SENTENCES[0].encode())
    decode(short, args.new_tokens)  # warm-up
    rate = decode(short, args.new_tokens)
    prompt = llm.tokenize(LONG_TEXT.encode())[: args.prefill_tokens]
    prefill(prompt)  # warm-up
    out = {"load_s": load_s, "baseline_rss_mb": base, "peak_rss_mb": loaded_peak, "decode_b1_tok_s": rate}
    out["prefill_tok_s"] = prefill(prompt)
    out["final_peak_rss_mb"] = peak_rss_mb()
    return out


def run_child(engine: str, path: Path, args) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", engine, "--file", str(path)]
    cmd += ["--threads", str(args.threads), "--new-tokens", str(args.new_tokens)]
    cmd += ["--prefill-tokens", str(args.prefill_tokens)]
    seconds, proc = timed(lambda: subprocess.run(cmd, capture_output=True, text=True))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
        status(f"    {engine} FAILED (exit {proc.returncode}): {tail[0]}")
        return {"error": f"exit {proc.returncode}: {proc.stderr[-2000:]}", "process_s": seconds}
    result = json.loads(lines[-1][len(RESULT) :])
    status(f"    {engine}: {seconds:.0f} s, decode b1 {result['decode_b1_tok_s']:.1f} tok/s")
    return {**result, "process_s": seconds}


def medians(results: list[dict]) -> dict | None:
    ok = [r for r in results if "error" not in r]
    if not ok:
        return None
    keys = [k for k, v in ok[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return {**ok[0], **{k: median([r[k] for r in ok if r.get(k) is not None]) for k in keys}}


def weights_mode(q: dict | None) -> str:
    if q is None:
        return "float"
    group = f"/g{q['group']}" if q["mode"] == "int4" else ""
    return q["mode"] + group + (f"+{q['int8']}int8" if q["int8"] else "")


def ratio(a: float | None, b: float | None) -> str:
    return fmt(a / b, 2) + "x" if a and b else "-"


def print_rows(rows: list[dict], args) -> None:
    headers = ["shape", "format", "file MB", "tierlm weights", "load s", "RSS MB", "l.cpp RSS MB"]
    headers += ["b1 tok/s", "b1 l.cpp", "b1 x", "b1 bound", "of bound", "b8 tok/s", "b8 l.cpp"]
    headers += ["prefill tok/s", "prefill l.cpp", "prefill x"]
    table = []
    for r in rows:
        t, ll, bound = r["tierlm_median"] or {}, r["llama_median"] or {}, r["bound_tok_s"]
        b1 = t.get("decode_b1_tok_s")
        tp, lp = t.get("prefill_tok_s"), ll.get("prefill_tok_s")
        cells = [
            r["shape"],
            r["format"],
            fmt(r["file_mb"], 0),
            weights_mode(t["quantization"]) if t else "error",
        ]
        cells += [fmt(t.get("load_s"), 2), fmt(t.get("peak_rss_mb"), 0), fmt(ll.get("peak_rss_mb"), 0)]
        cells += [fmt(b1), fmt(ll.get("decode_b1_tok_s")), ratio(b1, ll.get("decode_b1_tok_s")), fmt(bound)]
        cells += [fmt(100 * b1 / bound, 0) + "%" if b1 else "-", fmt(t.get("decode_b8_tok_s")), "—"]
        table.append(cells + [fmt(tp), fmt(lp), ratio(tp, lp)])
    print_table(
        headers, table, f"Formats: medians of {args.rounds} round(s), a fresh process per engine and round"
    )
    print(
        f"tierlm weights: plan.quantization (mode/group, +N = projections kept int8); load s: tierlm's warm "
        f"(second) load in its process; RSS MB: peak RSS of loading (tierlm: its first load).\n"
        f"b1 / b8: decode tok/s at batch 1 / 8 ({args.new_tokens} new tokens, greedy), l.cpp = llama.cpp "
        f"(batch 1 only); x = tierlm / llama.cpp; bound = bandwidth / bytes read per token; of bound = tierlm "
        f"b1 / bound.\nprefill: {args.prefill_tokens}-token prompt, one new token."
    )
    for r in rows:
        for engine in ("tierlm", "llama"):
            for e in r[engine]:
                if "error" in e:
                    print(f"\n{engine} failed on {r['shape']} {r['format']}: {e['error'][-1500:]}")
                    break


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="benchmarks/formats.py", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1b", help=f"comma-separated: {', '.join(SHAPES)} (default 1b)")
    p.add_argument("--formats", default=FORMATS, help=f"comma-separated llama.cpp ftypes (default {FORMATS})")
    p.add_argument("--rounds", type=int, default=2, help="rounds of (tierlm, llama.cpp) processes per file")
    p.add_argument("--threads", type=int, default=2, help="of both engines and of the bandwidth probe")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--json", help="also write the raw results to this file")
    p.add_argument("--child", choices=("tierlm", "llama"), help=argparse.SUPPRESS)
    p.add_argument("--file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        result = (child_tierlm if args.child == "tierlm" else child_llama)(Path(args.file), args)
        print(RESULT + json.dumps(result), flush=True)
        return
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    formats = [f.strip().upper() for f in args.formats.split(",") if f.strip()]
    if unknown := [s for s in shapes if s not in SHAPES]:
        p.error(f"unknown shape(s) {unknown}; use {', '.join(SHAPES)}")
    import llama_cpp

    if unknown := [f for f in formats if not hasattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{f}")]:
        p.error(f"llama.cpp has no ftype {unknown}")
    if args.rounds < 1 or args.new_tokens < 2 or not 1 <= args.prefill_tokens <= N_CTX - 1:
        p.error(f"--rounds >= 1, --new-tokens >= 2 and 1 <= --prefill-tokens < {N_CTX} are needed")
    warning, start_load = contention_warning(), machine_load()
    files = {s: ensure_files(s, formats) for s in shapes}
    rows = []
    for shape in shapes:
        for f, path in files[shape].items():
            per_token, tied = bytes_per_token(path)
            row = {"shape": shape, "format": f, "file": str(path), "file_mb": path.stat().st_size / MB}
            row |= {"tied": tied, "bytes_per_token": per_token, "tierlm": [], "llama": []}
            for i in range(args.rounds):
                status(f"{shape} {f}: round {i + 1}/{args.rounds}")
                for engine in ("tierlm", "llama"):
                    row[engine].append(run_child(engine, path, args))
            row["tierlm_median"], row["llama_median"] = medians(row["tierlm"]), medians(row["llama"])
            rows.append(row)
    bandwidth = bandwidth_gb_s(args.threads)  # after the children: torch's idle threads would compete
    for row in rows:
        row["bound_tok_s"] = bandwidth * 1e9 / row["bytes_per_token"]
    print(cpu_header())
    print(
        f"memory read bandwidth: {bandwidth:.1f} GB/s (best of 5 torch.ones(2**28).sum(), {args.threads} "
        f"threads); llama-cpp-python {llama_cpp.__version__}; threads: {args.threads}; "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}; {start_load} at the start, {machine_load()} at the end"
    )
    if warning:
        print(warning)
    print_rows(rows, args)
    if args.json:
        write_json(args.json, {"settings": vars(args), "bandwidth_gb_s": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()
