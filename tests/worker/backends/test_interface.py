"""The torch and MLX backends mirror each other: the same public names in the same files, and the
shared batch check."""

from __future__ import annotations

import importlib
import inspect

import pytest

from muxworker.worker.backends.interface import check_batch

# The one name that differs on purpose: each backend's executor class says which it is.
_SAME = {"TorchExecutor": "Executor", "MLXExecutor": "Executor"}


def _public(module) -> set[str]:
    names = set()
    for name, obj in vars(module).items():
        if name.startswith("_") or inspect.ismodule(obj):
            continue
        if getattr(obj, "__module__", None) == module.__name__ or name.isupper():
            names.add(_SAME.get(name, name))
    return names


@pytest.mark.parametrize("leaf", ["model", "cache", "executor"])
def test_the_backends_define_the_same_public_names(leaf):
    pytest.importorskip("mlx.core")
    torch_names = _public(importlib.import_module(f"muxworker.worker.backends.torch.{leaf}"))
    mlx_names = _public(importlib.import_module(f"muxworker.worker.backends.mlx.{leaf}"))
    assert torch_names == mlx_names
    assert torch_names  # not vacuous


@pytest.mark.parametrize(
    "tokens,positions,rows,message",
    [
        ([1, 2], [0], [0], "2 tokens but 1 positions"),
        ([1, 99], [0, 1], [0], r"token ids must lie in \[0, 50\)"),
        ([1, 2], [0, 64], [0], r"positions must lie in \[0, 64\)"),
        ([1, 2], [0, 1], [2], r"logits rows must lie in \[0, 2\)"),
        ([-1], [0], [0], "token ids"),
    ],
)
def test_check_batch_refuses_out_of_range_input(tokens, positions, rows, message):
    with pytest.raises(ValueError, match=message):
        check_batch(tokens, positions, rows, vocab_size=50, max_positions=64)
    check_batch([1, 2], [0, 1], [1], vocab_size=50, max_positions=64)
