"""The checkpoints inside tests/data/legacy/: files of versions 1 and 2, written by the code that
still wrote them (see tests/data/legacy/README.md), which ``python -m muxworker.sessions DIR
migrate`` converts. The expected contents are rebuilt here from the same seeds."""

from __future__ import annotations

import numpy as np

from muxworker.transport.checkpoint import CPUCheckpoint, IdentityInputs, LayerState
from muxworker.transport.checkpoint.identity import ModelFileFingerprint

DATA = __import__("pathlib").Path(__file__).resolve().parent.parent / "data" / "legacy"
IDENTITY = "ab" * 32
INPUTS = IdentityInputs((ModelFileFingerprint("model.safetensors", 1234, 0xDEADBEEF),), {"dtype": "float32"})
GEOMETRY = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "windows": [None, 4]}
DRAFT_GEOMETRY = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 4, "windows": [None]}
POSITION = 10
DRAFT_POSITION = 8
#: The saved sessions of tests/data/legacy/store-v2 (and store-v1): id -> has draft state.
SESSIONS = {"plain": False, "with-draft": True}


def _rows(rng: np.random.Generator, n: int, kv: int, d: int) -> np.ndarray:
    return rng.standard_normal((n, kv, d)).astype(np.float32)


def legacy_checkpoint(*, draft: bool, seed: int = 0) -> CPUCheckpoint:
    """The checkpoint the fixtures hold (``identity`` set: the store's)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 300, POSITION).astype(np.int32)
    layers = [
        LayerState(0, _rows(rng, POSITION, 2, 4), _rows(rng, POSITION, 2, 4)),
        LayerState(POSITION - 4, _rows(rng, 4, 2, 4), _rows(rng, 4, 2, 4)),  # window 4 keeps 4 rows
    ]
    state = None
    if draft:
        state = {
            "geometry": DRAFT_GEOMETRY,
            "layers": [LayerState(0, _rows(rng, DRAFT_POSITION, 1, 4), _rows(rng, DRAFT_POSITION, 1, 4))],
            "pending_token_ids": tokens[DRAFT_POSITION:].copy(),
        }
    return CPUCheckpoint(
        format={"backend": "torch", "dtype": "float32", "layout_version": 1},
        geometry=GEOMETRY,
        position=POSITION,
        token_ids=tokens,
        layers=layers,
        draft=state,
        identity=IDENTITY,
    )
