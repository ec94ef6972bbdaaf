"""Compiled decode steps built ahead of time (AOTInductor packages), once, and loaded by every later process.

The whole decode step (scope "model") is exported with torch.export, the static cache's tensors being
inputs it mutates in place, and compiled by AOTInductor with CompileConfig's inductor options (freezing,
max-autotune C++ GEMMs, the int8/int4 aten kernels) into a `.pt2` package. Packages live in
<cache root>/aot/<key>/, keyed by everything that changes the code (`package_key`): the checkpoint's files,
dtype, quantization and group size, batch, cache length, CompileConfig, torch, the CPU's instruction set
and tierlm's own model code. A package is written into a temporary folder and renamed into place, built
under a lock so that processes asking for one key at once build it once; one that is truncated, or whose
recorded CPU features are not this CPU's, is rebuilt with a warning, never loaded.

Two kinds of step are packaged: generate's, over a StaticCache ("static"), and continuous batching's, over
a SlotCache ("slots": the first rows of the batch's big cache, each row writing at its own slot). A slot
step's inputs are the SlotCache's own tensors (`SlotCache.state()`): each layer's K/V as contiguous views
of the big cache's first rows, which the package writes in place, and the rows' validity and slots, which
it reads; the views and the big cache are never inputs of one call together.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import platform
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch

from tierlm import cpu, kernels
from tierlm.cache import StaticCache
from tierlm.compile import CompileConfig, use_inductor_cache
from tierlm.generation.slots import SlotCache
from tierlm.step_export import StepModule, state_tensors, step_kind
from tierlm.weights.files import commit_folder, file_identity, identity_key, locked_folder
from tierlm.weights.gguf_cache import cache_root
from tierlm.weights.temporaries import remove_stale_temporaries, temporary

log = logging.getLogger("tierlm")
FORMAT = 1  # bump when what a package holds or how it is called changes
PACKAGE = "step.pt2"
# tierlm's sources that shape the exported graph: a package built from other code is another package.
CODE = (
    "config.py",
    "families.py",
    "models",
    "quant.py",
    "kernels/__init__.py",
    "kernels/avx2_quant.cpp",  # a package calls tierlm's AVX2 kernels by name
    "cache.py",
    "aot.py",
    "compile.py",  # the inductor options a package is built with
    "step_export.py",
    "generation/slots.py",
)
MAX_LOADED = 4  # loaded packages a model keeps (each holds its own frozen weights), as it keeps static caches


class PackageRejectedWarning(UserWarning):
    """A stored package was not loaded (truncated, unreadable, or built for another CPU); it is rebuilt."""


def applies(cc: CompileConfig, device: torch.device) -> bool:
    """Whether the step for `cc` is built ahead of time: the whole step, by inductor, on the CPU (layer
    scope and CUDA graphs stay with torch.compile)."""
    return cc.scope == "model" and cc.backend == "inductor" and device.type == "cpu"


def store_root() -> Path:
    return cache_root() / "aot"


# The vector extensions inductor chooses its C++ kernels' instruction set from (cpu_vec_isa.pick_vec_isa reads
# these same torch.cpu probes); read here directly, because importing torch._inductor costs ~2 s of start-up.
VECTOR_PROBES = ("avx2", "avx512", "vnni", "avx512_bf16", "amx_tile", "amx_fp16")


def cpu_features() -> dict:
    """The instruction set a package's kernels are compiled for: torch's dispatch level, the extensions
    tierlm reads, and the vector extensions inductor picks its kernels' instruction set from. Off x86 (where
    NEON or SVE, and SVE's length, decide) every capability torch reports is recorded."""
    f = cpu.detect()
    vector = sorted(n for n in VECTOR_PROBES if getattr(torch.cpu, f"_is_{n}_supported")())
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        caps = dict(torch.cpu.get_capabilities()) if hasattr(torch.cpu, "get_capabilities") else {}
        vector += sorted(f"{k}={v}" for k, v in caps.items() if "cache" not in k and not k.startswith("num_"))
    return {
        "capability": f.capability,
        "native_bf16": f.native_bf16,
        "amx": f.amx,
        "vnni": f.vnni,
        # int4/int8 products by tierlm's kernels (selected here and built), not aten's
        "int_kernels": kernels.selected() is not None,
        "vector": vector,
        # AMX kernels need the kernel's permission, which inductor's ISA check asks for and a package never
        # does: ask here (every process computes the key before it loads), and key on whether it was given.
        "amx_permitted": bool(torch.cpu._init_amx()) if "amx_tile" in vector else False,
    }


def checkpoint_identity(path: Path) -> list[str]:
    """The files' identities (path, size, mtime), as the GGUF cache and offload folders key them."""
    path = Path(path)
    if path.is_file():
        return [file_identity(path)]
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".json", ".gguf"))
    return [file_identity(p) for p in files]


def quantization(decoder: torch.nn.Module) -> str:
    """'none', 'int8' or 'int4-g<group>', read from the decoder's modules (int4 keeps an int8 LM head)."""
    from tierlm.quant import Int4Linear, Int8Linear

    groups = {m.group_size for m in decoder.modules() if isinstance(m, Int4Linear)}
    if groups:
        return "int4-g" + "-".join(str(g) for g in sorted(groups))
    return "int8" if any(isinstance(m, Int8Linear) for m in decoder.modules()) else "none"


def code_digest() -> str:
    here = Path(__file__).resolve().parent
    files = sorted(p for name in CODE for p in ([here / name] if "." in name else (here / name).glob("*.py")))
    digest = hashlib.sha256()
    for p in files:
        digest.update(str(p.relative_to(here)).encode() + b"\0" + p.read_bytes())
    return digest.hexdigest()[:16]


def inductor_options(cc: CompileConfig, device: str) -> dict:
    """The inductor settings the package is compiled with: CompileConfig's (mode, freezing, options).
    cpp_wrapper is dropped: an AOTInductor package is always a C++ wrapper."""
    options = dict(cc.compile_kwargs(device).get("options", {}))
    options.pop("cpp_wrapper", None)
    return options


def package_key(model, batch: int, cache_len: int, cc: CompileConfig, step: str = "static") -> dict:
    """Everything that changes a package's code, as a JSON-able dict (its digest names the folder).
    step: "static" (a StaticCache's step) or "slots" (continuous batching's, over a SlotCache)."""
    device = str(model.device)
    use_inductor_cache()
    config = dataclasses.asdict(cc)
    config["options"] = sorted((k, repr(v)) for k, v in (cc.options or {}).items())
    key = {
        "format": FORMAT,
        "step": step,
        "checkpoint": checkpoint_identity(model.path),
        "dtype": str(model.dtype).removeprefix("torch."),
        "quantization": quantization(model.decoder),
        "batch": batch,
        "cache_len": cache_len,
        "compile": config,
        # inductor's options are the resolved mode's (fixed by the torch version, in the key) plus the
        # config's; resolved here without importing torch._inductor (~2 s of a warm start)
        "inductor": {"mode": cc.resolved_mode(device), "freezing": cc.resolved_freezing(device)},
        "device": device,
        "torch": torch.__version__,
        "cpu": cpu_features(),
        "code": code_digest(),
    }
    return json.loads(json.dumps(key))  # as the manifest reads back (tuples become lists)


def digest(key: dict) -> str:
    return identity_key([json.dumps(key, sort_keys=True)])


@dataclasses.dataclass(frozen=True)
class Package:
    """A stored package: its folder and what its manifest records."""

    folder: Path
    manifest: dict

    @property
    def path(self) -> Path:
        return self.folder / PACKAGE

    @property
    def name(self) -> str:
        return self.folder.name

    def describe(self) -> str:
        """'batch 1, cache 512, bfloat16, int8' for listings and progress lines ('continuous batch 4, ...'
        for continuous batching's step)."""
        key = self.manifest.get("key", {})
        quant = key.get("quantization", "?")
        batch = "continuous batch" if key.get("step") == "slots" else "batch"
        parts = [
            f"{batch} {key.get('batch', '?')}",
            f"cache {key.get('cache_len', '?')}",
            key.get("dtype", "?"),
        ]
        return ", ".join(parts + ([quant] if quant != "none" else []))


def find(key: dict, root: Path | None = None, quiet: bool = False) -> Package | None:
    """The stored package for `key`, or None when there is none or it must not be loaded (with a warning
    saying why: truncated, unreadable, or its recorded CPU features are not this CPU's)."""
    folder = (root or store_root()) / digest(key)
    manifest_path = folder / "manifest.json"
    if not folder.is_dir():
        return None
    problem = None
    try:
        manifest = json.loads(manifest_path.read_text())
        size = (folder / PACKAGE).stat().st_size
    except (OSError, ValueError) as e:
        manifest, size, problem = {}, None, f"unreadable ({e.__class__.__name__})"
    if problem is None and manifest.get("cpu") != key["cpu"]:
        problem = (
            f"built for another CPU ({_cpu_words(manifest.get('cpu'))}; this one is {_cpu_words(key['cpu'])})"
        )
    elif problem is None and size != manifest.get("bytes"):
        problem = f"truncated ({size} of {manifest.get('bytes')} bytes)"
    elif problem is None and manifest.get("key") != key:
        problem = "its manifest records another key"
    if problem is not None:
        if not quiet:
            _reject(folder, problem)
        return None
    return Package(folder, manifest)


def _cpu_words(features) -> str:
    if not isinstance(features, dict):
        return "unknown"
    return f"{features.get('capability')}, vector extensions {', '.join(features.get('vector') or ['none'])}"


def _reject(folder: Path, problem: str) -> None:
    warnings.warn(
        f"compiled-step package {folder} is {problem}: rebuilding it, not loading it",
        PackageRejectedWarning,
        stacklevel=3,
    )


@contextmanager
def build_lock(root: Path) -> Iterator[None]:
    """Hold the store's build lock (one build at a time; a second builder of a key finds it built)."""
    root.mkdir(parents=True, exist_ok=True)
    waiting = partial(log.info, "waiting for another process building a compiled step in %s ...", root)
    with locked_folder(root, waiting):
        yield


def build(model, cache: StaticCache | SlotCache, cc: CompileConfig, key: dict, root: Path) -> Package:
    """Export and compile the decode step for `cache`'s shape into the store (under its lock)."""
    device = str(model.device)
    use_inductor_cache()
    folder = root / digest(key)
    tmp = temporary(folder)
    remove_stale_temporaries(root)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    start = time.perf_counter()
    try:
        with torch.inference_mode(False), torch.no_grad():
            state = [torch.zeros_like(t) for t in state_tensors(cache)]
            b = cache.batch
            example = (
                torch.zeros(b, 1, dtype=torch.long),
                torch.zeros(b, 1, dtype=torch.long),
                torch.zeros(1, dtype=torch.long),
            )
            model.decoder.ensure_rope(cache.max_len, model.device)
            model.decoder.widen_compiled_attention(  # as JIT
                "max-autotune" not in cc.resolved_mode(device), cpu.detect().compiled_wide_attention
            )
            model.decoder.vector_products(compiled=False)  # whole steps keep F.linear, as JIT
            model.decoder.attention_regions(False)  # one exported graph (steps.build differs)
            # fixed shapes: _StepModule's forward passes no `length`, so the step reads the whole cache
            exported = torch.export.export(StepModule(model.decoder, cache), (*example, *state), strict=False)
            torch._inductor.aoti_compile_and_package(
                exported, package_path=str(tmp / PACKAGE), inductor_configs=inductor_options(cc, device)
            )
        seconds = time.perf_counter() - start
        manifest = {
            "key": key,
            "cpu": key["cpu"],
            "bytes": (tmp / PACKAGE).stat().st_size,
            "built": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "build_seconds": round(seconds, 1),
            "source": str(model.path),
            "sources": [
                str(Path(model.path).resolve())
            ],  # `tierlm cache` marks the package orphaned without it
        }
        commit_folder(tmp, folder, manifest, parent_locked=True)  # build() runs under build_lock(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Package(folder, manifest)


class PackagedStep:
    """A decode step loaded from a package: step(tokens, positions, slots, length) -> logits [b, vocab]."""

    def __init__(self, runner, cache: StaticCache | SlotCache, package: Package, how: str) -> None:
        self.runner, self.cache, self.package, self.how = runner, cache, package, how
        self.state = state_tensors(cache)
        # The step's inputs are flat tensors and its output one tensor: no call-spec (un)flattening.
        self.run = runner.boxed_run

    def __call__(self, tokens, positions, slots, length):
        return self.run([tokens, positions, slots, *self.state])[0]

    def progress(self, i: int, n: int, seconds: float) -> str:
        """'[i+1/n] batch 2, cache 512, float32: <path> (12.3 MB, 0.4 s)', `tierlm compile`'s line."""
        size = self.package.path.stat().st_size
        where = f"{self.package.describe()}: {self.package.path}"
        return f"[{i + 1}/{n}] {where} ({size / 1e6:.1f} MB, {seconds:.1f} s)"


class Packages:
    """A model's packaged steps: each found in the store (or built into it) once, loaded once, and
    reused by every cache of its shape."""

    def __init__(self, model, root: Path | None = None) -> None:
        self.model, self.root = model, root or store_root()
        self.loaded: dict[str, tuple[object, Package, str]] = {}  # digest -> (runner, package, how)

    def applies(self, cc: CompileConfig, cache=None) -> bool:
        """Whether this model's step for `cc` (and `cache`) comes from a package: resident weights only
        (they freeze), and a plain StaticCache or continuous batching's SlotCache (whose rows hold no
        sliding-window ring; other caches stay JIT). `cache` may be a cache's class, before it exists."""
        kind = cache if isinstance(cache, type) else type(cache)  # a cache, or the class of one to come
        if cache is None or kind is StaticCache:
            known = True
        else:
            known = kind is SlotCache and not any(getattr(self.model.decoder, "sliding", ()))
        return applies(cc, self.model.device) and self.model.streamer is None and known

    def step(self, cache: StaticCache | SlotCache, cc: CompileConfig) -> PackagedStep:
        """The packaged step for `cache`'s shape: loaded when the store has it, else built, then loaded."""
        kind = step_kind(cache)
        key = package_key(self.model, cache.batch, cache.max_len, cc, kind)
        name = digest(key)
        entry = self.loaded.pop(name, None)
        if entry is None:
            batch = "continuous batch" if kind == "slots" else "batch"
            what = f"{batch} {cache.batch}, cache {cache.max_len}"
            entry = self._load_or_build(key, what, cache, cc)
            while len(self.loaded) >= MAX_LOADED:  # least recently used goes (a step in use keeps its own)
                del self.loaded[next(iter(self.loaded))]
        self.loaded[name] = entry  # most recently used last
        runner, package, how = entry
        return PackagedStep(runner, cache, package, how)

    def prepare(
        self,
        batches: list[int],
        cache_len: int,
        cc: CompileConfig,
        report: Callable[[str], None] | None = None,
    ) -> list[PackagedStep]:
        """Find or build the packages for each batch size at one cache length, one report line each."""
        steps = []
        for i, batch in enumerate(batches):
            start = time.perf_counter()
            cache = StaticCache(self.model.config, batch, cache_len, self.model.dtype, self.model.device)
            step = self.step(cache, cc)
            if report is not None:
                report(step.progress(i, len(batches), time.perf_counter() - start))
            steps.append(step)
        return steps

    def _load_or_build(self, key: dict, what: str, cache, cc: CompileConfig):
        start = time.perf_counter()
        package = find(key, self.root)
        runner = _try_load(package) if package is not None else None
        if runner is None:
            with build_lock(self.root):
                package = find(key, self.root, quiet=True)  # another process may have built it meanwhile
                runner = _try_load(package) if package is not None else None
                if runner is None:
                    log.info("compiled step: building a package (%s) ...", what)
                    package = build(self.model, cache, cc, key, self.root)
                    runner = load(package)
                    how = f"built package {package.name} ({what}) in {time.perf_counter() - start:.1f} s"
                    log.info("compiled step: %s", how)
                    return runner, package, how
        built = package.manifest.get("built")
        how = f"loaded package {package.name} ({what}), built {built}, {time.perf_counter() - start:.1f} s"
        log.info("compiled step: %s", how)
        return runner, package, how


def load(package: Package):
    """The package's runner. torch._inductor.aoti_load_package wraps this same C++ loader, but importing it
    imports torch._inductor (~2 s) and its call re-reads the call spec each step; the step needs neither."""
    try:
        return torch._C._aoti.AOTIModelPackageLoader(str(package.path), "model", False, 1, -1)
    except (AttributeError, TypeError):  # another torch's loader: through the public wrapper
        from torch._inductor import aoti_load_package

        return aoti_load_package(str(package.path)).loader


def _try_load(package: Package):
    try:
        return load(package)
    except Exception as e:  # a damaged package is rebuilt, never trusted
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        _reject(package.folder, f"unloadable ({first})")
        return None
