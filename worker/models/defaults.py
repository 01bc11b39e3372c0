"""The defaults a user would pick, defined once: dtype, weight format and thread count.

The worker's flags (``--dtype auto``, ``--weights``, ``--threads``) and the configuration an
application binds its session store to (``worker_configuration``) both resolve through these
functions, so a store declared with the defaults matches a worker started with them. Torch-free:
the CPU's features come from /proc/cpuinfo (Linux; elsewhere no native bfloat16 is assumed).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

__all__ = [
    "DTYPE_CHOICES",
    "DTYPE_NAMES",
    "QUANTIZE_CHOICES",
    "WEIGHTS_CHOICES",
    "auto_dtype",
    "cpu_has_native_bf16",
    "default_threads",
    "physical_cores",
    "resolve_dtype",
    "resolve_weights",
]

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # weights, activations and KV; checkpoints use the same names
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)
# quantized: a quantized GGUF's blocks stay as they are (the native decode step); float: every
# tensor is dequantized to --dtype at load.
WEIGHTS_CHOICES = ("quantized", "float")
# --quantize: a float model's linear layers and output layer quantized at load (int4: Q4_1 blocks;
# int8: Q8_0), by the gguf package's quantizer.
QUANTIZE_CHOICES = ("int4", "int8")

# CPU flags meaning bfloat16 matmuls run natively (AVX512-BF16 dot products, or AMX tiles).
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def _cpuinfo() -> tuple[frozenset[str], int]:
    """(flags of the first CPU, physical cores) from /proc/cpuinfo; (empty, 0) where unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return frozenset(), 0
    flags: frozenset[str] = frozenset()
    cores: set[tuple[str, str]] = set()
    physical = core = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags" and not flags:
            flags = frozenset(value.split())
        elif key == "physical id":
            physical = value.strip()
        elif key == "core id":
            core = value.strip()
            cores.add((physical, core))
    return flags, len(cores)


def cpu_has_native_bf16() -> bool:
    """True when this CPU computes bfloat16 natively (AVX512-BF16 or AMX-BF16)."""
    flags, _ = _cpuinfo()
    return any(f in flags for f in _BF16_FLAGS)


def auto_dtype(device: str, backend: str = "torch") -> str:
    """``--dtype auto``: bfloat16 on a GPU and on CPUs with native bfloat16 (torch), float32
    elsewhere: emulated bfloat16 is slower than float32, and MLX's CPU backend has no fast one."""
    if device.startswith("cuda") or device == "gpu":
        return "bfloat16"
    return "bfloat16" if backend == "torch" and cpu_has_native_bf16() else "float32"


def resolve_dtype(dtype: str, device: str, backend: str = "torch") -> str:
    """``dtype`` itself, or what "auto" means on ``device``."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    return auto_dtype(device, backend) if dtype == "auto" else dtype


def resolve_weights(
    weights: str | None, model_dir: str | os.PathLike[str], backend: str = "torch", quantize: str | None = None
) -> str:
    """What a worker's weights are, as its hello reports them and a store declares them:

    - "quantized": a converted GGUF's blocks kept as they are (the default for a GGUF on torch);
    - "int4" / "int8": a float model quantized at load (``quantize``);
    - "float": every tensor in --dtype (the default for everything else).
    """
    from muxworker.worker.models.gguf_tensors import TENSOR_INDEX

    if weights is not None and weights not in WEIGHTS_CHOICES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS_CHOICES)}, got {weights!r}")
    if quantize is not None:
        if quantize not in QUANTIZE_CHOICES:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {quantize!r}")
        return quantize
    if weights is not None:
        return weights
    linked = (Path(model_dir) / TENSOR_INDEX).is_file()
    return "quantized" if linked and backend == "torch" else "float"


def physical_cores() -> int:
    """Physical cores of this machine (hyperthreads not counted); os.cpu_count() where unknown."""
    _, cores = _cpuinfo()
    return cores or os.cpu_count() or 1


def default_threads() -> int:
    """``--threads``' default: one per physical core this process may run on. Measured on a 2-core
    VM, more threads than cores (hyperthreads, or torch's default on some machines) collapse under
    contention; fewer leave speed unused."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = os.cpu_count() or 1
    return max(1, min(allowed, physical_cores()))
