"""``MLXExecutor``: the MLX model and its KV cache behind the executor interface of executor.py.

The engine schedules against it exactly as against ``TorchExecutor``: ``forward`` takes a packed
batch as plain lists and returns float32 CPU torch logits (through numpy), and checkpoint rows move
as numpy ``LayerState`` in the logical layout ``[n, KV, D]`` (bfloat16 as its uint16 bits). So a
checkpoint exported by either backend restores on the other.

Every MLX call runs on the executor's device stream (``mx.stream``), never by changing MLX's global
default device. ``forward`` evaluates the logits and every cache array it wrote before returning, so
no work stays lazily deferred across engine steps.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
import numpy as np
import torch

from muxworker.transport.checkpoint import LayerState, numpy_storage_dtype
from muxworker.worker.backends.interface import SeqSpan, WeightGroup, check_batch
from muxworker.worker.backends.mlx.cache import KVCache
from muxworker.worker.backends.mlx.model import Transformer, build_model
from muxworker.worker.models import gguf_tensors
from muxworker.worker.models.args import ModelArgs
from muxworker.worker.models.loader import InvalidModelError, ModelFiles

__all__ = ["DTYPES", "MLXExecutor", "check_device", "load_model", "resolve_device"]

DTYPES: dict[str, mx.Dtype] = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# --device names this backend accepts: "cpu", or the MLX GPU (Metal on macOS, CUDA where mlx[cuda]
# is installed) under the names the worker's --device and MLX use for it.
_DEVICES = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "metal": "gpu"}


def check_device(device: str, dtype: str) -> None:
    """Raise ValueError when this backend cannot run ``dtype`` on ``device``; before any loading."""
    resolve_device(device)


def resolve_device(device: str) -> mx.Device:
    """The MLX device for a --device name; raise ValueError when unknown or absent."""
    kind = _DEVICES.get(str(device))
    if kind is None:
        raise ValueError(f"--backend mlx runs on device cpu or gpu (cuda, metal), got {device!r}")
    dev = mx.cpu if kind == "cpu" else mx.gpu
    if not mx.is_available(dev):
        raise ValueError(f"--device {device} was asked for but MLX has no GPU here (install mlx with Metal or CUDA)")
    return cast(mx.Device, dev)  # a DeviceType works wherever MLX takes a Device


def load_model(files: ModelFiles, args: ModelArgs, *, device: str, dtype: str) -> Transformer:
    """Load a model directory's weights into the MLX model, cast to ``dtype``."""
    try:
        dt = DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} is not supported; expected one of {', '.join(DTYPES)}") from None
    with mx.stream(resolve_device(device)):
        if files.gguf:  # a converted GGUF: its tensors dequantized (MLX runs float weights)
            index = gguf_tensors.GGUFTensorIndex.open(files.path)
            state = {name: mx.array(index.dequantize(name)) for name in index.names()}
        else:
            state = _load_state_dict(files.weight_files)
        return build_model(args, state, dtype=dt)


def _load_state_dict(weight_files: Sequence[str | os.PathLike[str]]) -> dict[str, mx.array]:
    """Every tensor of the safetensors files under its Hugging Face name, in its stored dtype."""
    state: dict[str, mx.array] = {}
    for file in weight_files:
        arrays = mx.load(str(file), format="safetensors")
        if not isinstance(arrays, dict):
            raise InvalidModelError(f"{file} did not load as a safetensors map of tensors")
        for name, array in arrays.items():
            if name in state:
                raise InvalidModelError(f"tensor {name!r} appears in more than one weight file ({file})")
            state[name] = array
    return state


class MLXExecutor:
    backend = "mlx"

    def __init__(
        self,
        model: Transformer,
        slots: int,
        max_session_tokens: int,
        rollback_rows: int = 0,
        *,
        device: str | mx.Device = "cpu",
    ) -> None:
        """``rollback_rows``: rows a slot may write past its length and drop again (speculative
        decoding verifies drafted tokens that way); sliding-window rings get that many spare rows."""
        self.model = model
        self.args: ModelArgs = model.args
        self.device = device if isinstance(device, mx.Device) else resolve_device(device)
        self.dtype = model.dtype
        with mx.stream(self.device):
            model.setup_rope(max_session_tokens)
            self.cache = KVCache(
                self.args.windows,
                slots,
                max_session_tokens,
                self.args.num_kv_heads,
                self.args.head_size,
                self.dtype,
                rollback_rows=rollback_rows,
            )

    @property
    def weight_groups(self) -> list[WeightGroup]:
        """Every weight dense, by dtype (MLX holds no quantized blocks here)."""
        from mlx.utils import tree_flatten

        leaves: list[tuple[str, Any]] = tree_flatten(self.model.parameters())  # type: ignore[assignment]
        groups: dict[str, list[int]] = {}
        for _, a in leaves:
            entry = groups.setdefault(_DTYPE_NAMES.get(a.dtype, str(a.dtype)), [0, 0])
            entry[0] += 1
            entry[1] += int(a.nbytes)
        return [WeightGroup(dtype, "dense", "every pass", n, b) for dtype, (n, b) in groups.items()]

    @property
    def dtype_name(self) -> str:
        return _DTYPE_NAMES[self.dtype]

    @property
    def device_name(self) -> str:
        return "cpu" if self.device == mx.cpu else "gpu"

    def forward(
        self, tokens: Sequence[int], positions: Sequence[int], spans: Sequence[SeqSpan], logits_rows: Sequence[int]
    ) -> torch.Tensor:
        """Run one packed batch; return float32 CPU logits [len(logits_rows), V]."""
        # MLX gathers do not check bounds: out-of-range ids or positions would read garbage.
        check_batch(
            tokens, positions, logits_rows, vocab_size=self.args.vocab_size, max_positions=self.model.rope_positions
        )
        with mx.stream(self.device):
            logits = self.model(
                mx.array(list(tokens), dtype=mx.int32),
                mx.array(list(positions), dtype=mx.int32),
                spans,
                self.cache,
                mx.array(list(logits_rows), dtype=mx.int32),
            )
            mx.eval(logits, self.cache.slot_arrays({s.slot for s in spans}))
        return torch.from_numpy(np.array(logits, copy=True))

    def export_layers(self, slot: int, length: int, position: int, floor: int = 0) -> list[LayerState]:
        storage = numpy_storage_dtype(self.dtype_name)
        out = []
        with mx.stream(self.device):
            for layer in self.cache.layers:
                start, k, v = layer.export_rows(slot, length, position, floor)
                out.append(LayerState(start, _to_numpy(k, storage), _to_numpy(v, storage)))
        return out

    def import_layers(self, slot: int, position: int, layers: list[LayerState]) -> int:
        storage = numpy_storage_dtype(self.dtype_name)
        floor = 0
        if len(layers) != len(self.cache.layers):
            raise ValueError(f"{len(layers)} layer states for a cache of {len(self.cache.layers)} layers")
        with mx.stream(self.device):
            for layer, state in zip(self.cache.layers, layers):
                if state.keys.dtype != storage or state.values.dtype != storage:
                    raise ValueError(f"layer rows are {state.keys.dtype}; a {self.dtype_name} cache needs {storage}")
                lo = max(state.start, layer.keep(position))
                a, b = lo - state.start, position - state.start
                layer.import_rows(
                    slot, lo, _from_numpy(state.keys[a:b], self.dtype), _from_numpy(state.values[a:b], self.dtype)
                )
                if lo > layer.keep(position):
                    floor = max(floor, lo)
            mx.eval(self.cache.slot_arrays([slot]))
        return floor

    # The cache lives in MLX arrays, which lend no stable host views: checkpoint files go through
    # export_layers / import_layers (worker/engine/checkpoint_files.py).
    direct_kv_io = False

    def export_start(self, slot: int, layer: int, length: int, position: int, floor: int = 0) -> int:
        raise NotImplementedError("the MLX cache has no direct file I/O (direct_kv_io is False)")

    def kv_views(
        self, slot: int, layer: int, lo: int, hi: int, writable: bool = False
    ) -> tuple[list[memoryview], list[memoryview]]:
        raise NotImplementedError("the MLX cache has no direct file I/O (direct_kv_io is False)")

    def kv_clear(self, slot: int, layer: int, lo: int, hi: int) -> None:
        raise NotImplementedError("the MLX cache has no direct file I/O (direct_kv_io is False)")

    def kv_zero_slot(self, slot: int) -> None:
        raise NotImplementedError("the MLX cache has no direct file I/O (direct_kv_io is False)")


def _to_numpy(a: mx.array, storage: np.dtype) -> np.ndarray:
    """An independent C-contiguous host copy; bfloat16 as its raw uint16 bits."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a, copy=True, order="C").view(storage)


def _from_numpy(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    """An MLX copy of host rows (read-only payload buffers are fine)."""
    arr = mx.array(np.ascontiguousarray(a))
    return arr.view(mx.bfloat16) if dtype == mx.bfloat16 else arr
