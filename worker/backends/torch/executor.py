"""Executors: a model plus its KV cache behind the small interface the engine schedules against.

The engine never touches tensors of a backend; it hands an executor a packed batch as plain lists
and gets float32 logits back on the CPU, and it moves checkpoint rows through ``LayerState``
(numpy, logical layout). ``TorchExecutor`` runs on CPU or CUDA; an MLX executor mirrors it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from muxworker import native as _native
from muxworker.transport.checkpoint import LayerState, numpy_storage_dtype
from muxworker.transport.checkpoint.segments import byte_view
from muxworker.worker.backends.interface import SeqSpan, WeightGroup, check_batch
from muxworker.worker.backends.torch import quant as _quant
from muxworker.worker.backends.torch.cache import KVCache
from muxworker.worker.backends.torch.model import Transformer, build_model
from muxworker.worker.backends.torch.native_step import MAX_ROWS as _NATIVE_ROWS
from muxworker.worker.backends.torch.native_step import NativeStep, unsupported
from muxworker.worker.backends.torch.prepared import load_prepared, prepared_path, save_prepared
from muxworker.worker.backends.torch.quant import QuantBlocks, quantize_blocks, rotary_row_map
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

    ``weights="quantized"``: a converted GGUF's linear layers and output layer keep their GGUF
    blocks (read in place, for the native decode step: ``model.quantized``, quant.py) beside their
    dense copies (dequantized, for prefill, cached memory-mapped by prepared.py); every other tensor
    is dequantized to ``dtype``. ``quantize``: quantize a float model's linear layers and output
    layer at load, "int4" (Q4_1 blocks) or "int8" (Q8_0); the dense copies are then the quantized
    values, so prefill and decode multiply the same weights.
    """
    dev = resolve_device(device)
    dt = DTYPES[dtype]
    if files.gguf and weights == "quantized" and quantize is not None:
        raise ValueError("--quantize applies to float models; a GGUF keeps its own quantization")
    if files.gguf and quantize is None:
        # The GGUF dequantized into the dtype: the dense copies of --weights quantized, the whole
        # model of --weights float (the same tensors, so the same prepared file on the CPU).
        gguf = files.weight_files[0].resolve()
        index = gguf_tensors.GGUFTensorIndex.open(files.path)
        cache = prepared_path(files.path, dt, dev)
        model = load_prepared(args, cache, dt, gguf) if dev.type == "cpu" else None
        if model is None:
            state = {name: torch.from_numpy(index.dequantize(name)).to(dt) for name in index.names()}
            model = build_model(args, state, dtype=dt, device=dev)
            if dev.type == "cpu":
                save_prepared(model, cache, dt, gguf)
        if weights == "quantized":
            model.quantized = _gguf_blocks(index)
        return model
    if weights == "quantized" and quantize is None:
        raise ValueError(
            f"{files.path} holds float weights: --weights quantized needs a quantized GGUF, "
            "or --quantize int4|int8 to quantize at load"
        )
    state = dict(load_state_dict(files.path, device="cpu", dtype=dt if quantize is None else None))
    blocks = None
    if quantize is not None:
        if quantize not in _quant.QUANTIZE_TYPES:
            raise ValueError(f"--quantize must be one of {', '.join(_quant.QUANTIZE_TYPES)}, got {quantize!r}")
        if "lm_head.weight" not in state:  # tied: the head is the embedding's values
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        blocks = {
            name: quantize_blocks(w, _quant.QUANTIZE_TYPES[quantize])
            for name, w in state.items()
            if _is_linear(name) or name == "lm_head.weight"
        }
        for name, q in blocks.items():
            if name != "lm_head.weight" or not args.tie_word_embeddings:
                state[name] = torch.from_numpy(q.dequantize())
    model = build_model(args, state, dtype=dt, device=dev)
    model.quantized = blocks
    return model


def _is_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def _gguf_blocks(index: gguf_tensors.GGUFTensorIndex) -> dict[str, QuantBlocks] | None:
    """The GGUF blocks of the linear layers and the output layer (a tied model's is the embedding),
    read in place; None when a linear layer is in a type the native step does not multiply. An
    output layer in another type (F16, F32, ...) is quantized to Q8_0 here, as llama.cpp's
    products quantize it too."""
    out: dict[str, QuantBlocks] = {}
    head = "lm_head.weight" if "lm_head.weight" in index.entries else "model.embed_tokens.weight"
    for name in (*(n for n in index.names() if _is_linear(n)), head):
        e = index.entries[name]
        key = "lm_head.weight" if name == head else name
        if len(e.shape) != 2 or (e.type not in _native.QUANT_TYPES and key != "lm_head.weight"):
            return None
        rows, cols = e.shape
        if e.type not in _native.QUANT_TYPES:
            out[key] = quantize_blocks(torch.from_numpy(index.dequantize(name)), "Q8_0")
            continue
        row_map = None if e.rotary_heads is None else rotary_row_map(rows, e.rotary_heads)
        out[key] = QuantBlocks(index.raw(name).reshape(rows, -1), e.type, (rows, cols), row_map)
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
        # Short spans (decode, drafts' verification, short prompt chunks) of a quantized model on
        # the CPU run the native step; everything else, and every span of a float model, torch.
        quantized = model.quantized
        self.native_unavailable = unsupported(model, quantized, self.device)
        if self.native_unavailable is None and quantized is not None:
            # A chunk of T rows may overwrite the ring rows its first row still needs unless the
            # ring has T - 1 spare rows: with them a sliding-window model's short chunks (the
            # first turn after a resume, a tool result) run natively too, not only single rows.
            rollback_rows = max(rollback_rows, _NATIVE_ROWS - 1)
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
        self.native: NativeStep | None = None
        if self.native_unavailable is None and quantized is not None:
            self.native = NativeStep(model, quantized, self.cache, torch.get_num_threads())

    @property
    def weight_groups(self) -> list[WeightGroup]:
        """Every weight tensor once, grouped by type and how it is held: a quantized model's GGUF
        blocks (mapped in place, or packed at load by --quantize) run the native decode step; their
        dense copies run prefill; norms and the embedding (and every weight of a float model) run
        every pass."""
        quantized = self.model.quantized or {}
        decode = "decode" if self.native is not None else "unused (no native step)"
        groups: dict[tuple[str, str, str], list[int]] = {}

        def add(key: tuple[str, str, str], nbytes: int) -> None:
            entry = groups.setdefault(key, [0, 0])
            entry[0] += 1
            entry[1] += nbytes

        for q in quantized.values():
            add((q.type, "mapped" if isinstance(q.blocks, np.memmap) else "packed", decode), q.nbytes)
        copies = "prefill" if self.native is not None else "every pass"
        seen: set[int] = set()
        for name, t in (*self.model.named_parameters(), *self.model.named_buffers()):
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen or t.numel() == 0 or name.endswith(("._cos", "._sin")):
                continue
            seen.add(ptr)
            dtype = str(t.dtype).removeprefix("torch.")
            add(
                (dtype, "dense", copies if quantized and name.endswith("_proj.weight") else "every pass"),
                t.untyped_storage().nbytes(),
            )
        return [WeightGroup(k[0], k[1], k[2], n, b) for k, (n, b) in groups.items()]

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
        native = self.native
        if native is None:
            return self._torch_forward(tokens, positions, spans, logits_rows)
        # Short spans take the native step, and so does the tail of a long prompt chunk from its
        # first logits row on (when that tail is short): the row a first token is sampled from is
        # computed the same way whether its prompt was prefilled whole, in chunks, or reused from
        # an earlier turn with only its last token fed again.
        wanted = sorted(logits_rows)
        short: list[SeqSpan] = []
        long: list[SeqSpan] = []
        for s in spans:
            if s.length <= native.max_rows:
                short.append(s)
                continue
            first = next((r for r in wanted if s.offset <= r < s.offset + s.length), None)
            tail = s.offset + s.length - first if first is not None else 0
            if 0 < tail <= native.max_rows:
                head = s.length - tail
                long.append(SeqSpan(s.slot, s.start, head, s.offset))
                short.append(SeqSpan(s.slot, s.start + head, tail, s.offset + head))
            else:
                long.append(s)
        if not long:
            return torch.from_numpy(native.forward(tokens, positions, short, logits_rows))
        # Long prompt chunks run dense in torch first, each in a forward of its own: a dense
        # bfloat16 product's rounding depends on how many rows it multiplies, so a chunk batched
        # with another session's would cache other keys and values than the same chunk alone. A
        # split chunk's tail (below) reads the rows its head wrote.
        in_short = {r for s in short for r in range(s.offset, s.offset + s.length)}
        out = torch.empty(len(logits_rows), self.args.vocab_size, dtype=torch.float32)
        for s in long:
            mine = [i for i, r in enumerate(logits_rows) if s.offset <= r < s.offset + s.length and r not in in_short]
            rows = slice(s.offset, s.offset + s.length)
            dense = self._torch_forward(
                tokens[rows],
                positions[rows],
                [SeqSpan(s.slot, s.start, s.length, 0)],
                [logits_rows[i] - s.offset for i in mine],
            )
            if mine:
                out[mine] = dense
        picked = [i for i, r in enumerate(logits_rows) if r in in_short]
        if short:
            out[picked] = torch.from_numpy(native.forward(tokens, positions, short, [logits_rows[i] for i in picked]))
        return out

    def _torch_forward(
        self, tokens: Sequence[int], positions: Sequence[int], spans: Sequence[SeqSpan], logits_rows: Sequence[int]
    ) -> torch.Tensor:
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
