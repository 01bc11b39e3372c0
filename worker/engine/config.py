"""The engine's limits and scheduling knobs (the worker's flags), as a dataclass."""

from __future__ import annotations

from dataclasses import dataclass

from muxworker.worker.models.args import ConfigError


@dataclass
class EngineConfig:
    """Limits and scheduling knobs of one engine (the worker's flags)."""

    max_sessions: int = 8
    max_session_tokens: int = 4096
    max_decode_sequences: int = 8
    max_inflight_requests: int = 64
    prefill_chunk_tokens: int = 512
    prefix_cache_entries: int = 0
    seed: int | None = None
    n_draft: int = 0  # tokens proposed per session per step (by a draft model, or by --speculative ngram)
    speculative: str | None = None  # "ngram": prompt lookup (ngram.py); None: a draft model, if given

    def __post_init__(self) -> None:
        for name in (
            "max_sessions",
            "max_session_tokens",
            "max_decode_sequences",
            "max_inflight_requests",
            "prefill_chunk_tokens",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.prefix_cache_entries < 0:
            raise ConfigError(f"prefix_cache_entries must be >= 0, got {self.prefix_cache_entries!r}")
        if not isinstance(self.n_draft, int) or isinstance(self.n_draft, bool) or self.n_draft < 0:
            raise ConfigError(f"n_draft must be an integer >= 0, got {self.n_draft!r}")
        if self.speculative not in (None, "ngram"):
            raise ConfigError(f"speculative must be None or 'ngram', got {self.speculative!r}")
