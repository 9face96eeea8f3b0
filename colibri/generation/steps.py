"""The records of a decode loop: Step (one generated token) and GenerationStats (counts and
seconds of a run, model.last_stats). colibri.generate makes Steps of one request's
scheduler events (speculative or not); colibri.generation.generate re-exports both names."""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Step", "GenerationStats"]


@dataclass
class Step:
    """One generated token: id, its text piece ('' while a character is incomplete or with no
    tokenizer), and, when asked for, the routing of the forward pass that consumed it."""
    index: int
    token: int
    text: str = ""
    routing: object | None = None


@dataclass
class GenerationStats:
    """Counts and seconds of the last generation (model.last_stats)."""
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    finish_reason: str = ""                 # "stop" | "length" | "ctx"
    cached_tokens: int = 0                  # prompt tokens copied from the prefix cache
    timings: dict = field(default_factory=dict)   # seconds per stage (router, experts, ...)

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def generation_tps(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds else 0.0

    def summary(self) -> str:
        return (f"prompt: {self.prompt_tokens} tokens in {self.prefill_seconds * 1e3:.1f} ms "
                f"({self.prompt_tps:.1f} tok/s); generation: {self.generated_tokens} tokens, "
                f"{self.decode_steps} decode steps in {self.decode_seconds * 1e3:.1f} ms "
                f"({self.generation_tps:.1f} tok/s); finish: {self.finish_reason}")
