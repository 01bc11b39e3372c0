"""The bounds a model file must keep: one definition, used by the GGUF reader (gguf_file.py), the
converter (convert.py), the config (args.py) and the vocabulary builder (gguf_vocab.py).

Model files are untrusted input: a crafted header can claim 2^31 layers or a 2^63-entry array in a
file of a few kilobytes, and anything sized by such a count before it is checked grows without
bound. Every count and size is checked against these bounds before anything is allocated for it.
Each bound is taken from real models with generous headroom, so no real model is refused; where
llama.cpp has a hard limit we use the same one, so a file llama.cpp refuses is refused here too.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "MAX_ARRAY_LENGTH",
    "MAX_CONTEXT_LENGTH",
    "MAX_EMBEDDING_LENGTH",
    "MAX_FEED_FORWARD_LENGTH",
    "MAX_HEAD_DIM",
    "MAX_HEADS",
    "MAX_KEY_BYTES",
    "MAX_LAYERS",
    "MAX_METADATA_KEYS",
    "MAX_STRING_BYTES",
    "MAX_TENSOR_DIMS",
    "MAX_TENSOR_NAME_BYTES",
    "MAX_TENSORS",
    "MAX_VOCAB",
    "checked_float",
    "checked_int",
]

#: Transformer blocks: llama.cpp's LLAMA_MAX_LAYERS (the largest real models have 126: Llama 3.1 405B).
MAX_LAYERS = 512
#: Vocabulary entries (tokens, and the embedding's rows): four times Gemma 3's 262,144, the largest
#: vocabulary of a supported family. The bound is what keeps a claimed vocabulary from sizing the
#: token lists, the merges and the embedding before the file is known to hold them.
MAX_VOCAB = 1 << 20
#: Entries of any one metadata array: a vocabulary's arrays hold one entry per token or per merge
#: (a byte-level BPE's merges number about its tokens), so twice the vocabulary bound.
MAX_ARRAY_LENGTH = 2 * MAX_VOCAB
#: Bytes of one metadata string. The largest real ones are a chat template (tens of KB) or a whole
#: tokenizer.json some converters embed (tokenizer.huggingface.json, up to ~35 MB).
MAX_STRING_BYTES = 64 << 20
#: Bytes of a metadata key: the GGUF specification's limit (keys are ASCII, at most 65535 bytes).
MAX_KEY_BYTES = 65535
#: Bytes of a tensor name: ggml's GGML_MAX_NAME (64, the terminating NUL included).
MAX_TENSOR_NAME_BYTES = 63
#: Dimensions of a tensor: ggml's GGML_MAX_DIMS.
MAX_TENSOR_DIMS = 4
#: Tensors in one file (real files: a few hundred; ~1,100 for Llama 3.1 405B; MoE files with one
#: tensor per expert a few thousand).
MAX_TENSORS = 1 << 16
#: Metadata key/value pairs (real files: 20 to 60).
MAX_METADATA_KEYS = 1 << 16
#: Attention heads (query or key/value): Llama 3.1 405B and DeepSeek V3 have 128.
MAX_HEADS = 1 << 12
#: Width of a head (real: 64 to 256).
MAX_HEAD_DIM = 1 << 12
#: Hidden size (real: up to 16,384 for Llama 3.1 405B, 18,432 for DeepSeek V3).
MAX_EMBEDDING_LENGTH = 1 << 16
#: MLP width (real: up to 53,248 for Llama 3.1 405B).
MAX_FEED_FORWARD_LENGTH = 1 << 20
#: Context length: above Llama 4 Scout's 10M tokens.
MAX_CONTEXT_LENGTH = 1 << 24


def checked_int(
    value: Any, field: str, low: int, high: int, *, where: str = "", error: type[ValueError] = ValueError
) -> int:
    """``value`` as an int in ``[low, high]``, else ``error`` naming ``field`` (and ``where``, the
    file). bool is refused: a flag is not a count."""
    prefix = f"{where}: " if where else ""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise error(f"{prefix}{field} = {value!r} is not an integer")
    if not low <= value <= high:
        raise error(f"{prefix}{field} = {value} is out of range: expected {low} to {high}")
    return value


def checked_float(
    value: Any,
    field: str,
    *,
    low: float = 0.0,
    high: float = math.inf,
    where: str = "",
    error: type[ValueError] = ValueError,
) -> float:
    """``value`` as a finite float with ``low < value <= high``, else ``error`` naming ``field``."""
    prefix = f"{where}: " if where else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{prefix}{field} = {value!r} is not a number")
    value = float(value)
    if not math.isfinite(value) or not low < value <= high:
        bound = f"at most {high}" if math.isfinite(high) else "finite"
        raise error(f"{prefix}{field} = {value} is out of range: expected a number above {low}, {bound}")
    return value
