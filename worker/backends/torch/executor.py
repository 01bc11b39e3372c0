"""Executors: a model plus its KV cache behind the small interface the engine schedules against.

The engine never touches tensors of a backend; it hands an executor a packed batch as plain lists
and gets float32 logits back on the CPU, and it moves checkpoint rows through ``LayerState``
(numpy, logical layout). ``TorchExecutor`` runs on CPU or CUDA; an MLX executor mirrors it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch

from muxworker.transport.checkpoint import LayerState, numpy_storage_dtype
from muxworker.transport.checkpoint.segments import byte_view
from muxworker.worker.backends.interface import SeqSpan, check_batch
from muxworker.worker.backends.torch.cache import KVCache
from muxworker.worker.backends.torch.model import Transformer, build_model
from muxworker.worker.backends.torch.prepared import load_prepared, prepared_path, save_prepared
from muxworker.worker.backends.torch.quant import Int4Weight, Weight, quantize_int4, quantize_int8
from muxworker.worker.models import gguf_tensors
from muxworker.worker.models.args import ModelArgs
from muxworker.worker.models.loader import ModelFiles, load_state_dict

__all__ = ["DTYPES", "TorchExecutor", "check_device", "load_model", "resolve_device"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_device(device: str, dtype: str) -> None:
    """Raise ValueError when this backend cannot run ``dtype`` on ``device``; before any loading:
    float32/bfloat16 on CPU; bfloat16/float16 (and float32) on CUDA."""
    dev = resolve_device(device)
    if dev.type == "cpu" and DTYPES[dtype] == torch.float16:
        raise ValueError("float16 is not supported on CPU; use float32 or bfloat16")


def resolve_device(device: str) -> torch.device:
    """The torch device for a --device name; raise ValueError when it is absent."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device")
    return dev


def load_model(
    files: ModelFiles,
    args: ModelArgs,
    *,
    device: str,
    dtype: str,
    weights: str = "float",
    quantize: str | None = None,
) -> Transformer:
    """Load a model directory's weights into the torch model, in ``dtype``, on ``device``.

    ``weights="quantized"``: a converted GGUF's Q4_0/Q4_1/Q4_K linear tensors stay 4-bit (the int4
    kernel); the output layer (the tied embedding, or output.weight when it is not 4-bit) runs the
    int8 kernel, requantized per row from its GGUF values (Q8_0 in the bundled model: int4 there
    loses several percent of top-1 agreement, a dense bfloat16 head reads twice the bytes); every
    other tensor (embeddings, norms, Q8_0/Q5/Q6 linears, F16) is dequantized to ``dtype``. ``quantize``: quantize a float model's linear weights at load,
    "int4" (group 32, min/max; the output layer stays dense) or "int8" (per row, absmax).
    """
    dev = resolve_device(device)
    dt = DTYPES[dtype]
    state: dict[str, Weight]
    if files.gguf and weights == "quantized":
        if quantize is not None:
            raise ValueError("--quantize applies to float models; a GGUF keeps its own quantization")
        gguf = files.weight_files[0].resolve()
        cache = prepared_path(files.path, dt, dev)
        if dev.type == "cpu" and (model := load_prepared(args, cache, dt, gguf)) is not None:
            return model
        model = build_model(args, _gguf_state(files, dt), dtype=dt, device=dev)
        if dev.type == "cpu":
            save_prepared(model, cache, dt, gguf)
        return model
    else:
        if weights == "quantized" and quantize is None:
            raise ValueError(
                f"{files.path} holds float weights: --weights quantized needs a quantized GGUF, "
                "or --quantize int4|int8 to quantize at load"
            )
        state = dict(load_state_dict(files.path, device="cpu", dtype=dt if quantize is None else None))
        if quantize is not None:
            state = _quantize(state, quantize)
    return build_model(args, state, dtype=dt, device=dev)


def _is_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def _gguf_state(files: ModelFiles, dtype: torch.dtype) -> dict[str, Weight]:
    index = gguf_tensors.GGUFTensorIndex.open(files.path)
    state: dict[str, Weight] = {}
    for name in index.names():
        if (_is_linear(name) or name == "lm_head.weight") and index.type_of(name) in gguf_tensors.INT4_TYPES:
            w = index.int4(name)
            state[name] = Int4Weight.from_numpy(w.codes, w.scales, w.zeros)
        elif name == "lm_head.weight":
            state[name] = quantize_int8(torch.from_numpy(index.dequantize(name)))
        else:
            state[name] = torch.from_numpy(index.dequantize(name)).to(dtype)
    if "lm_head.weight" not in state:  # tied: the head is the embedding, requantized for the int8 kernel
        state["lm_head.weight"] = quantize_int8(torch.from_numpy(index.dequantize("model.embed_tokens.weight")))
    return state


def _quantize(state: dict[str, Weight], mode: str) -> dict[str, Weight]:
    quantizers: dict[str, Callable[[torch.Tensor], Weight]] = {"int4": quantize_int4, "int8": quantize_int8}
    if mode not in quantizers:
        raise ValueError(f"--quantize must be one of {', '.join(quantizers)}, got {mode!r}")
    out: dict[str, Weight] = {}
    for name, w in state.items():
        assert isinstance(w, torch.Tensor)
        out[name] = quantizers[mode](w) if _is_linear(name) else w
    return out


class TorchExecutor:
    backend = "torch"

    def __init__(self, model: Transformer, slots: int, max_session_tokens: int, rollback_rows: int = 0) -> None:
        """``rollback_rows``: rows a slot may write past its length and drop again (speculative
        decoding verifies drafted tokens that way); sliding-window rings get that many spare rows."""
        self.model = model
        self.args = model.args
        param = model.model.embed_tokens.weight
        self.device = param.device
        self.dtype = param.dtype
        model.setup_rope(max_session_tokens)
        self.cache = KVCache(
            self.args.windows,
            slots,
            max_session_tokens,
            self.args.num_kv_heads,
            self.args.head_size,
            self.dtype,
            self.device,
            rollback_rows=rollback_rows,
        )

    @property
    def weight_nbytes(self) -> tuple[int, int]:
        """(bytes the weights take, of which the quantized layers' dense prefill copies)."""
        seen: set[int] = set()
        total = dense = 0
        for name, t in (*self.model.named_parameters(), *self.model.named_buffers()):
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen or t.numel() == 0 or name.endswith(("._cos", "._sin")):
                continue
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
            if name.endswith(".dense"):
                dense += t.untyped_storage().nbytes()
        return total, dense

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def device_name(self) -> str:
        return str(self.device)

    def forward(
        self, tokens: Sequence[int], positions: Sequence[int], spans: Sequence[SeqSpan], logits_rows: Sequence[int]
    ) -> torch.Tensor:
        """Run one packed batch; return float32 CPU logits [len(logits_rows), V]."""
        check_batch(
            tokens, positions, logits_rows, vocab_size=self.args.vocab_size, max_positions=self.cache.max_tokens
        )
        dev = self.device
        logits = self.model(
            torch.tensor(tokens, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            spans,
            self.cache,
            torch.tensor(logits_rows, dtype=torch.long, device=dev),
        )
        return logits.cpu()

    def export_layers(self, slot, length, position, floor=0):
        storage = numpy_storage_dtype(self.dtype_name)
        out = []
        for layer in self.cache.layers:
            start, k, v = layer.export_rows(slot, length, position, floor)
            out.append(LayerState(start, _to_numpy(k, storage), _to_numpy(v, storage)))
        return out

    def import_layers(self, slot, position, layers):
        if len(layers) != len(self.cache.layers):
            raise ValueError(f"{len(layers)} layer states for a cache of {len(self.cache.layers)} layers")
        floor = 0
        for layer, state in zip(self.cache.layers, layers):
            lo = max(state.start, layer.keep(position))
            a, b = lo - state.start, position - state.start
            k = _from_numpy(state.keys[a:b], self.dtype, self.device)
            v = _from_numpy(state.values[a:b], self.dtype, self.device)
            layer.import_rows(slot, lo, k, v)
            if lo > layer.keep(position):
                floor = max(floor, lo)
        return floor

    # -- direct file I/O of cache rows (worker/engine/checkpoint_files.py) ------------------------

    @property
    def direct_kv_io(self) -> bool:
        """Whether :meth:`kv_views` lends views of the cache itself (host memory: the CPU)."""
        return self.device.type == "cpu"

    def export_start(self, slot: int, layer: int, length: int, position: int, floor: int = 0) -> int:
        return self.cache.layers[layer].export_start(length, position, floor)

    def kv_views(
        self, slot: int, layer: int, lo: int, hi: int, writable: bool = False
    ) -> tuple[list[memoryview], list[memoryview]]:
        """Byte views of the cache rows of positions ``[lo, hi)`` of one layer, keys and values,
        each concatenating to the head-major ``[KV, hi - lo, D]`` block (the cache's own layout, so
        these are views, not copies). CPU only (:attr:`direct_kv_io`)."""
        cache = self.cache.layers[layer]
        runs = cache.runs(lo, hi)
        out = []
        for t in (cache.k, cache.v):
            views = []
            for head in range(t.shape[1]):
                for row, n in runs:
                    block = t[slot, head, row : row + n]
                    if block.dtype == torch.bfloat16:
                        block = block.view(torch.uint16)
                    views.append(byte_view(block.numpy()))
            out.append(views)
        return out[0], out[1]

    def kv_clear(self, slot: int, layer: int, lo: int, hi: int) -> None:
        """Zero one layer's rows of ``slot`` except those that will hold positions ``[lo, hi)``."""
        self.cache.layers[layer].clear_outside(slot, lo, hi)

    def kv_zero_slot(self, slot: int) -> None:
        for layer in self.cache.layers:
            layer.k[slot].zero_()
            layer.v[slot].zero_()


def _to_numpy(t: torch.Tensor, storage: np.dtype) -> np.ndarray:
    """An independent C-contiguous host copy; bfloat16 as its raw uint16 bits."""
    t = t.detach().to("cpu", copy=True).contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.uint16)
    return t.numpy().view(storage)


def _from_numpy(a: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor view of host rows (read-only payload buffers are fine: the cache copies them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given NumPy array is not writable"
        t = torch.from_numpy(np.ascontiguousarray(a))
    if dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t.to(device)
