"""CPU products of a few rows (a decoding step, a verify forward), each computed in the form measured fastest.

A decoding step multiplies 1-64 rows by every weight matrix once: on a CPU that is bound by streaming the
weights (540 MB a forward for SmolLM2-135M in fp32), so a forward over a few rows could cost about what one
row costs. BLAS kernels tuned for large products do not get there, and differently on every CPU: on one
development machine (Intel, MKL, fp32) the stock kernel over 2-8 rows was slower than over one row and
`(W @ x.T).T` halved a 4-token forward; on another it doubled every multi-token forward; on an AMD EPYC
(AVX2, one thread, weights streamed from memory) the stock kernel's LM head took 11.5 ms for one row and
22 ms for two. So three forms are measured, none assumed:

  stock       `x @ W.T` (torch's kernel)
  transposed  `(W @ x.T).T`
  skinny      `specgui/cpu/csrc/skinny_linear.c`: each block of weight rows read from memory once and
              multiplied with every input row in registers (AVX-512 where the CPU has it, else AVX2 + FMA;
              `SPECGUI_SIMD` picks one: `simd`), compiled on first use with the machine's C compiler (none, or no
              AVX2: the form is not offered).
              Its rows come out the same whatever other rows share the call, so a verify forward's rows equal
              plain steps' bit for bit.

bfloat16 weights (`--dtype bfloat16` on a CPU, a choice the user makes, never made for them) take the same
forms: the skinny kernel streams the bf16 weights (half of fp32's bytes), widens them exactly and multiplies in
fp32; its result is rounded to bf16 as torch's kernel rounds it. torch's own bf16 kernel on an AMD EPYC with
native bf16 instructions made a one-row forward slower than fp32's (36 ms against 30).

`install` routes every distinct weight shape of the model, for 1 ... 64 rows, through the skinny form where this
machine builds it (`choose` says why no timing picks another); elsewhere it times torch's and the transposed form,
calling the model's own modules of that shape in turn so that the weights come from memory as they do in a forward,
and routes each row count through the faster. The choice is saved per CPU, thread count and shape
(`<cache>/kernels/`), so later loads read it instead of timing again.

Exactness, where rows are bit-equal by construction and where only within rounding:
  * Bit-equal on every machine that builds the skinny library: a row of any product of 1 row or more through the
    skinny form (fp32, bf16, int8), and so, with the decoder layers in C (`specgui/cpu/layers.py`), every row of a
    forward that follows a cached prefix, at any row count, against the plain steps that produce the same tokens:
    a verify's rows, a tree's, a draft pass's. Greedy identity leans on this.
  * Within rounding only: a prompt's prefill of more than `cpu_layers.PROMPT_ROWS` rows (BLAS; the same numbers for
    every method, so nothing compares its rows with others), transformers' modules (a bf16 model's attention and
    norms, layers of other shapes, tests' references), and everything on a machine without the skinny library or on
    a GPU: there a verify's row can differ from the plain step's in the last bits (the shape of a BLAS product picks
    its summation order), greedy identity holds except at a near-tie of the top two logits, and the margins the
    decode loop records say where.

The model's decoder layers call the skinny form directly where they run in C (`specgui/cpu/layers.py`, fp32); the
choice here routes every other call (the LM head, a bf16 model, layers of other shapes). It is installed on the
model's own `nn.Linear` modules, so everything that runs the model benefits alike, transformers' `generate` (and its
prompt lookup) included: comparisons stay like for like. `python -m specgui bench --small-batch-matmul off` measures
without it.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import time
import types
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch
from torch import nn

from specgui.core import progress
from specgui.errors import SpecGUIError
from specgui.model.cachedir import cache_root, exclusive

FORMS = ("stock", "transposed", "skinny")
DTYPES = (torch.float32, torch.bfloat16)  # weight dtypes the forms are chosen for
MAX_ROWS = 64
PROBE_ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64)  # row counts timed (the cost profile's); others take the one below
CHOICE_REPEATS = 7  # timings of each form per row count; the least counts (`choose`)
STREAM_BYTES = 48 * 2**20  # a timing cycles through enough of a shape's modules to read this much (past the L3)
SOURCE = Path(__file__).with_name("csrc") / "skinny_linear.c"
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")  # and the vector form's own (`SIMD_FLAGS`)
# The skinny library's vector forms, best first: the flags each adds, the CPU flags it needs, the name printed.
# AVX-512's 32 registers of 16 floats and AVX2's 16 of 8 take different tiles (the C file) and sum in other orders.
SIMD_FLAGS = {"avx512": ("-mavx512f",), "avx2": ()}
SIMD_NEEDS = {"avx512": frozenset({"avx2", "fma", "avx512f"}), "avx2": frozenset({"avx2", "fma"})}
SIMD_LABELS = {"avx512": "avx512", "avx2": "avx2+fma"}
LOG = logging.getLogger("specgui.cpu.kernels")
Shape = tuple[int, int, torch.dtype]  # a weight's (out, in) and dtype


def install(model: nn.Module, cache_dir: Path | None = None, forced: str | None = None) -> dict[str, int]:
    """Route every plain fp32 or bf16 CPU `nn.Linear` of `model` through the form measured fastest on its weight shape,
    per row count up to MAX_ROWS (`forced`: one form for every row count, for tests and comparisons). Choices are
    read from / saved to `cache_dir` when given. Returns how many modules take each form at one row or more."""
    shapes: dict[Shape, list[nn.Linear]] = {}
    for module in model.modules():
        if (type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype in DTYPES
                and module.weight.is_contiguous() and not hasattr(module, "_hf_hook")):
            shapes.setdefault((*module.weight.shape, module.weight.dtype), []).append(module)
    offered = available_forms()
    if forced is not None and forced not in offered:
        raise ValueError(f"kernel form {forced!r} is not available here (available: {', '.join(offered)})")
    saved_path = _choice_path(cache_dir) if cache_dir is not None and forced is None else None
    tables = _tables(shapes, offered, saved_path) if forced is None else {}
    counts: dict[str, int] = {}
    for shape, modules in shapes.items():
        table = tables[shape] if forced is None else [forced] * (MAX_ROWS + 1)
        for module in modules:
            module.row_forms = tuple(table)
            module.forward = types.MethodType(_forward, module)
        for form in set(table[1:]):
            counts[form] = counts.get(form, 0) + len(modules)
    return counts


def _tables(shapes: dict[Shape, list[nn.Linear]], offered: tuple[str, ...],
            saved_path: Path | None) -> dict[Shape, list[str]]:
    """Each shape's form per row count: saved, else measured (under the file's lock, so that processes sharing
    the cache measure a shape once) and saved."""
    def key(shape: Shape) -> str:
        out, inp, dtype = shape
        return f"{out}x{inp}" + ("" if dtype == torch.float32 else f" {str(dtype).removeprefix('torch.')}")

    saved = _read_choices(saved_path, offered)
    if any(key(shape) not in saved for shape in shapes):
        with exclusive(saved_path) if saved_path is not None else contextlib.nullcontext():
            saved = _read_choices(saved_path, offered)  # another process may have measured them meanwhile
            missing = [shape for shape in shapes if key(shape) not in saved]
            with progress.phase("choosing the matmul form of each weight shape (once per CPU)",
                                total=len(missing)) as phase:
                for shape in missing:
                    saved[key(shape)] = choose(shapes[shape], offered)
                    progress.advance(phase, key(shape))
            if saved_path is not None and missing:
                _write_choices(saved_path, saved)
    return {shape: saved[key(shape)] for shape in shapes}


def signature(model: nn.Module) -> str:
    """A short name of the forms installed on `model` (part of a cost profile's key: other kernels, other costs)."""
    tables = sorted({getattr(m, "row_forms", ()) for m in model.modules() if type(m) is nn.Linear})
    if tables == [()]:
        return "stock"
    return hashlib.sha1(json.dumps(tables).encode()).hexdigest()[:10]


def build() -> str | None:
    """The skinny library's build (a digest of its source and flags), None where it does not build: what was timed
    through one build does not price another (a cost profile's key)."""
    return _source_digest() if skinny_library() is not None else None


def available_forms() -> tuple[str, ...]:
    """The forms this machine can run: stock and transposed always, skinny where its library builds."""
    return FORMS if skinny_library() is not None else FORMS[:2]


def choose(modules: list[nn.Linear], offered: tuple[str, ...], repeats: int = CHOICE_REPEATS) -> list[str]:
    """Per row count 0..MAX_ROWS, the form these modules' shape takes (index 0 unused).

    Where the skinny form is offered it takes every row count, untimed: it is the one form whose rows come out the
    same whatever rows share the call, and a verify forward's rows must equal the plain steps that produce the same
    tokens bit for bit (greedy identity leans on it). torch's kernel and the transposed form round a row differently
    by the shape of the product on some CPUs (1.8e-7 in the LM head's logits on an Intel Xeon between one row and
    four, where an AMD EPYC gave equality), so choosing them by speed, as this did, made exactness depend on the
    machine. Elsewhere (no C compiler, no AVX2) the faster of the two is measured (the least of `repeats` timings:
    another process's burst only ever adds time) and rows agree only within rounding."""
    if "skinny" in offered:
        return ["stock"] + ["skinny"] * MAX_ROWS
    weight = modules[0].weight
    cycle = modules[: max(1, min(len(modules), STREAM_BYTES // (weight.numel() * weight.element_size())))]
    best = []
    with torch.inference_mode():
        for rows in PROBE_ROWS:
            x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
            times = _least_s({form: [(FUNCTIONS[form], m.weight, m.bias, x) for m in cycle] for form in offered},
                             repeats)
            best.append(min(times, key=times.get))
    return ["stock"] + [best[max(i for i, n in enumerate(PROBE_ROWS) if n <= r)] for r in range(1, MAX_ROWS + 1)]


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (else what `platform` knows): two CPUs of one architecture and
    core count can differ by 1.75x in a forward, so what is measured on one names the model, not only "x86_64"."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name" and value.strip():
                return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -- the forms ---------------------------------------------------------------------------------------------------


def _stock(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(x, weight, bias)


def _transposed(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    out = (weight @ x.t()).t()
    return out if bias is None else out + bias


def _skinny(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    library = skinny_library()
    return _call(library.skinny_linear if weight.dtype == torch.float32 else library.skinny_linear_bf16, x, weight,
                 bias)


FUNCTIONS = {"stock": _stock, "transposed": _transposed, "skinny": _skinny}


def skinny_int8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ (weight * scale[:, None]).T + bias` for rows `x` [M, K] (fp32 or bf16) and int8 `weight` [N, K] with one
    `scale` per row [N], streaming the int8 weights, in x's dtype (the skinny kernel's int8 form; call only where
    `skinny_library()` is not None)."""
    return _call(skinny_library().skinny_linear_i8, x, weight, scale, bias)


def _call(function: Callable[..., int], x: torch.Tensor, weight: torch.Tensor,
          *vectors: torch.Tensor | None) -> torch.Tensor:
    """One skinny-library product over rows `x` [M, K] and `weight` [N, K], with its optional per-output vectors
    (scale, bias: fp32, in the function's order); the result in x's dtype. bf16 rows widen exactly to an fp32
    copy (`float` keeps a view's strides: the kernel reads rows, so the copy is made contiguous). A forward makes
    ~200 of these calls, so fp32 inputs skip every conversion (each torch call costs ~0.5-1 us, the C call ~1)."""
    rows = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    held = [v if v is None or v.dtype == torch.float32 else v.float() for v in vectors]  # alive until the call returns
    out = torch.empty(rows.shape[0], weight.shape[0])
    function(rows.data_ptr(), weight.data_ptr(), *[v if v is None else v.data_ptr() for v in held], out.data_ptr(),
             rows.shape[0], rows.shape[1], weight.shape[0], torch.get_num_threads())
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear_as(self, self.weight, self.bias, x)


def linear_as(module: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T + bias` in the form `module` takes at x's row count (`install`), for a weight cut from
    module's own (a draft vocabulary's rows of the LM head: `specgui.core.vocab`): the skinny kernel sums each output
    in an order that does not depend on how many outputs there are, so a row-prefix of the weight gives those
    outputs bit for bit. A module never installed computes it with torch."""
    forms = getattr(module, "row_forms", None)
    width = x.shape[-1]
    rows = x.numel() // width
    if forms is None:
        return nn.functional.linear(x, weight, bias)
    form = forms[min(rows, MAX_ROWS)]  # past MAX_ROWS only the row-independent form goes on (`choose`)
    if (rows > MAX_ROWS and form != "skinny") or x.dtype != weight.dtype or x.requires_grad or form == "stock" \
            or not x.is_cpu:  # a module moved to a GPU after it was installed: torch's own product there
        return nn.functional.linear(x, weight, bias)
    out = FUNCTIONS[form](weight, bias, x.reshape(rows, width))
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


# -- the skinny library -------------------------------------------------------------------------------------------


@cache
def simd() -> str | None:
    """The vector form the skinny library is built for: `SPECGUI_SIMD` ("avx2" or "avx512") where set, else the best
    this CPU has; None where none runs here (not x86-64, no AVX2 and FMA). Forcing "avx2" on an AVX-512 machine runs
    what a laptop without AVX-512 runs (its own build, its own summation order), so any machine can measure and test
    that form. An unknown value, or a form this CPU lacks, is a one-line error."""
    wanted = os.environ.get("SPECGUI_SIMD", "").strip().lower()
    if wanted and wanted not in SIMD_FLAGS:
        raise SpecGUIError(f"SPECGUI_SIMD={wanted!r} is not a vector form: use one of {', '.join(SIMD_FLAGS)}, "
                           "or leave it unset for the best this CPU has")
    if wanted and not SIMD_NEEDS[wanted] <= _x86_flags():
        missing = sorted(SIMD_NEEDS[wanted] - _x86_flags())
        raise SpecGUIError(f"SPECGUI_SIMD={wanted}: this CPU lacks {', '.join(missing)}")
    return wanted or best_simd()


def best_simd() -> str | None:
    """The best vector form this CPU runs (what `simd()` is where `SPECGUI_SIMD` is unset), None where none does."""
    return next((form for form, needs in SIMD_NEEDS.items() if needs <= _x86_flags()), None)


def _x86_flags() -> frozenset[str]:
    return _cpu_flags() if platform.machine() in ("x86_64", "AMD64") else frozenset()


def simd_label() -> str:
    """What the profile prints and saves as the skinny kernels' form: "avx2+fma" or "avx512", or why none runs (the
    fallback: torch's kernels, and transformers' modules for the decoder layers)."""
    form = simd()
    if form is None:
        return "none (no AVX2 and FMA here: torch's kernels)"
    if skinny_library() is None:
        return "none (no C compiler or the build failed: torch's kernels)"
    return SIMD_LABELS[form]


@cache
def skinny_library() -> ctypes.CDLL | None:
    """The compiled skinny kernel for the vector form `simd()` (built once per source and flags into the cache), or
    None where it cannot run: no form runs here, no C compiler, or a failed build (logged once at first use)."""
    form = simd()
    if form is None:
        LOG.warning("no AVX2 and FMA here: the skinny kernels and the C decoder layers do not run; torch's kernels "
                    "and transformers' modules do (docs/cpu-kernels.md says what that costs)")
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        LOG.warning("no C compiler: the skinny kernels and the C decoder layers do not run; torch's kernels and "
                    "transformers' modules do (docs/cpu-kernels.md says what that costs)")
        return None
    target = cache_root() / "kernels" / f"skinny_linear-{form}-{_source_digest()}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        with progress.phase(f"building the C kernel ({SOURCE.name}, {SIMD_LABELS[form]}), once per source"):
            done = subprocess.run([compiler, *_cflags(), str(SOURCE), "-o", str(partial)], capture_output=True,
                                  text=True)
        if done.returncode != 0:
            LOG.warning("the skinny matmul kernel did not build: %s", done.stderr.strip().splitlines()[-1:])
            return None
        os.replace(partial, target)  # atomic: processes building at once each leave a whole library
    library = ctypes.CDLL(str(target))
    library.skinny_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    library.skinny_linear.restype = ctypes.c_int
    library.skinny_linear_i8.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 3 + [ctypes.c_int]
    library.skinny_linear_i8.restype = ctypes.c_int
    library.skinny_linear_bf16.argtypes = library.skinny_linear.argtypes
    library.skinny_linear_bf16.restype = ctypes.c_int
    pointer, number, threads = ctypes.c_void_p, ctypes.c_long, ctypes.c_int  # a layer's plan: its address
    for name, arguments in (("layer_attention_in", [pointer] * 5 + [number, threads]),
                            ("layer_attention_out", [pointer] * 6 + [number, number, pointer, number, threads]),
                            ("layer_mlp", [pointer] * 3 + [number, threads]),
                            ("layers_forward", [pointer, number] + [pointer] * 4 + [number, threads])):
        getattr(library, name).argtypes = arguments
        getattr(library, name).restype = ctypes.c_int
    return library


def reset() -> None:
    """Forget the vector form and its library, so that the next call reads `SPECGUI_SIMD` again (tests run both)."""
    for cached in (simd, skinny_library, _source_digest):
        cached.cache_clear()


@cache
def _source_digest() -> str:
    return hashlib.sha1(SOURCE.read_bytes() + " ".join(_cflags()).encode()).hexdigest()[:12]


def _cflags() -> tuple[str, ...]:
    """The build flags of the form `simd()`: the digest of a library (its file name, a cost profile's key) covers
    them, so the AVX2 and AVX-512 builds never share a library or a price."""
    return CFLAGS + SIMD_FLAGS[simd() or "avx2"]


@cache
def _cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


# -- measuring and saving -------------------------------------------------------------------------------------------


def _least_s(passes: dict[str, list[tuple]], repeats: int) -> dict[str, float]:
    """Least seconds per call of each form's pass of (function, weight, bias, input) calls, after a warm-up pass; the
    forms take turns in every round, so a machine slowing down mid-way weighs on all of them alike."""
    samples: dict[str, list[float]] = {form: [] for form in passes}
    for round_ in range(repeats + 1):
        for form, calls in passes.items():
            start = time.perf_counter()
            for function, weight, bias, x in calls:
                function(weight, bias, x)
            if round_:
                samples[form].append((time.perf_counter() - start) / len(calls))
    return {form: min(s) for form, s in samples.items()}


def _choice_path(cache_dir: Path) -> Path:
    key = (f"{cpu_name()} x{torch.get_num_threads()} torch {torch.__version__} {simd()} {_source_digest()}"
           f" row-independent least of {CHOICE_REPEATS}")
    return cache_dir / "kernels" / f"choices-{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"


def _read_choices(path: Path | None, offered: tuple[str, ...]) -> dict[str, list[str]]:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, list) and len(v) == MAX_ROWS + 1 and set(v) <= set(offered)}


def _write_choices(path: Path, choices: dict[str, list[str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(choices, indent=0), encoding="utf-8")
    os.replace(partial, path)
