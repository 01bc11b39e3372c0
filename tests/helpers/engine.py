"""Driving an in-process engine in tests: build one on a tiny model, step it until idle, prompts."""

from __future__ import annotations

import torch

from muxworker.worker.build import load_engine
from muxworker.worker.engine.config import EngineConfig
from muxworker.worker.engine.sampling import SamplingParams


def make(model_dir, **cfg):
    cfg.setdefault("max_session_tokens", 512)
    return load_engine(model_dir, EngineConfig(**cfg), device="cpu", dtype=torch.float32)


def run(engine, max_steps=10_000):
    """Step until idle; return {request_id: (text, result)}."""
    texts: dict[int, str] = {}
    results: dict[int, dict] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.text
            if out.result is not None:
                results[out.request_id] = out.result
    assert not engine.has_work()
    return {rid: (texts.get(rid, ""), res) for rid, res in results.items()}


def prompt_ids(n, seed=0, vocab=384):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def greedy(n=8, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0, stop_token_ids=[], **kw)
