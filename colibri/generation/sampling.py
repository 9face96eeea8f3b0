"""Choosing the next token from a row of logits: small functions, composed by `Sampler`.

Each filter takes float logits (V,) and returns a new array where the tokens it rules out are
-inf; nothing here mutates its input. The order is the one transformers' `generate` uses:
repetition penalty, then temperature, top-k, top-p, min-p, then a draw. Sampling is done in
float64 so that a long tail of tiny probabilities never sums to NaN or 0.

Conventions that match transformers (and, for the two additive penalties, the OpenAI API):
  - repetition penalty: for every token already seen (prompt included), a negative logit is
    multiplied by the penalty and a positive one divided by it;
  - presence / frequency penalty (OpenAI): logit[j] -= c[j] * frequency + (c[j] > 0) * presence,
    c[j] = how often j occurs among the tokens generated so far (the prompt does not count);
    applied after the repetition penalty, as vLLM does;
  - top-p keeps the smallest set of most probable tokens whose probability reaches p
    (the token that crosses p is kept), and always at least one token;
  - min-p keeps the tokens whose probability is at least min_p times the top probability.
Switches that mean "off": temperature 0 (greedy), top_k 0, top_p 1, min_p 0, repetition
penalty 1, presence / frequency penalty 0.
log_softmax / top_logprobs give the log-probabilities a server reports beside each token.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from ..errors import ColibriError
from .constraints import ConstraintSpec

__all__ = [
    "Sampler",
    "SamplingParams",
    "REAL_BOUNDS",
    "MAX_LOGPROBS",
    "SettingTypeError",
    "check_real",
    "check_top_k",
    "check_seed",
    "apply_repetition_penalty",
    "apply_presence_frequency_penalty",
    "apply_temperature",
    "top_k_filter",
    "top_p_filter",
    "min_p_filter",
    "greedy",
    "sample_from_logits",
    "sample_from_probs",
    "softmax",
    "log_softmax",
    "top_logprobs",
]


# ---------------------------------------------------------------------------------------------
# the one set of rules for sampling settings: colibri.generate, Sampler, SamplingParams (the
# scheduler) and the server (server.schemas takes its bounds from REAL_BOUNDS) all check these
# ---------------------------------------------------------------------------------------------

# name: (low, high, low excluded); the OpenAI API's ranges, and vLLM's / llama-server's for the
# settings OpenAI does not have
REAL_BOUNDS: dict[str, tuple[float, float, bool]] = {
    "temperature": (0.0, 2.0, False),           # 0: greedy
    "top_p": (0.0, 1.0, True),                  # 1: off
    "min_p": (0.0, 1.0, False),                 # 0: off
    "repetition_penalty": (0.0, 10.0, True),    # 1: off
    "presence_penalty": (-2.0, 2.0, False),     # 0: off
    "frequency_penalty": (-2.0, 2.0, False),    # 0: off
}
MAX_TOP_K = 2**31 - 1                 # top_k in [0, MAX_TOP_K]; 0: off
SEED_LIMIT = 2**63                    # seed None or in [0, SEED_LIMIT)
MAX_LOGPROBS = 20                     # top log-probabilities per token, as the OpenAI API allows
MAX_STOPS = 16                        # stop strings per request
MAX_STOP_CHARS = 256                  # characters per stop string


class SettingTypeError(TypeError, ValueError):
    """A setting of the wrong type: a TypeError to Python callers, and a ValueError (a bad value,
    400 at the server) to code that checks a request's settings."""


def _real(name: str, value) -> float:
    """value as a float when it is a real number (not a bool, not a string); SettingTypeError
    naming the argument otherwise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                     np.floating)):
        raise SettingTypeError(f"{name} must be a number, got {value!r} "
                               f"({type(value).__name__})")
    return float(value)


def _integer(name: str, value) -> int:
    """value as an int when it is an integer (a float such as 2.7 is refused, not truncated);
    SettingTypeError naming the argument otherwise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise SettingTypeError(f"{name} must be an integer, got {value!r} "
                               f"({type(value).__name__})")
    return int(value)


def check_real(name: str, value) -> float:
    """A REAL_BOUNDS setting as a float; SettingTypeError / ValueError naming the setting, the
    value and its range otherwise (NaN and infinities are out of every range)."""
    lo, hi, lo_open = REAL_BOUNDS[name]
    v = _real(name, value)
    if not (math.isfinite(v) and v <= hi and (v > lo if lo_open else v >= lo)):
        raise ValueError(f"{name} must be a finite number in {'(' if lo_open else '['}{lo:g}, "
                         f"{hi:g}], got {value!r}")
    return v


def check_top_k(value) -> int:
    k = _integer("top_k", value)
    if not 0 <= k <= MAX_TOP_K:
        raise ValueError(f"top_k must be an integer in [0, 2**31 - 1] (0 = off), got {value!r}")
    return k


def check_seed(value) -> int | None:
    if value is None:
        return None
    s = _integer("seed", value)
    if not 0 <= s < SEED_LIMIT:
        raise ValueError(f"seed must be None or an integer in [0, 2**63), got {value!r}")
    return s


def _check_row(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits)
    if x.ndim != 1:
        raise ValueError(f"sampling works on one row of logits (V,), got shape {x.shape}")
    if x.size == 0:
        raise ValueError("sampling got an empty row of logits (vocabulary size 0)")
    return x


def softmax(logits: np.ndarray) -> np.ndarray:
    """float64 probabilities (V,) of logits (V,); -inf entries get probability exactly 0."""
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x)
    if not np.isfinite(m):
        raise ColibriError(f"cannot take a softmax: the largest logit is {m}")
    e = np.exp(x - m)
    return e / e.sum()


def apply_repetition_penalty(logits: np.ndarray, history: Iterable[int] | np.ndarray,
                             penalty: float) -> np.ndarray:
    """logits (V,) with every token of `history` penalised (transformers convention).

    A seen token's logit is divided by `penalty` when positive and multiplied when negative, so
    penalty > 1 always makes it less likely. Each token counts once however often it was seen.
    """
    x = _check_row(logits)
    if penalty == 1.0:
        return x
    if penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {penalty}")
    seen = np.unique(np.asarray(list(history) if not isinstance(history, np.ndarray) else history,
                                dtype=np.int64))
    if seen.size == 0:
        return x
    if seen[0] < 0 or seen[-1] >= x.shape[0]:
        raise ValueError(f"repetition history holds token ids outside [0, {x.shape[0]}): "
                         f"min {seen[0]}, max {seen[-1]}")
    out = np.array(x, dtype=np.float32, copy=True)
    s = out[seen]
    # a penalty near 0 (5e-324 is > 0) makes a seen logit huge, not inf: softmax stays defined
    big = np.finfo(np.float32).max
    with np.errstate(over="ignore", divide="ignore"):
        out[seen] = np.clip(np.where(s < 0, s * penalty, s / penalty), -big, big)
    return out


def apply_presence_frequency_penalty(logits: np.ndarray, generated: Iterable[int] | np.ndarray,
                                     presence: float, frequency: float) -> np.ndarray:
    """logits (V,) less the OpenAI penalties: logit[j] -= c[j] * frequency + (c[j] > 0) * presence,
    c[j] the count of token j in `generated` (the ids generated so far, prompt excluded).

    Positive values make repeats less likely, negative ones more; 0 and 0 return the input.
    Returns float32 (a new array) when a penalty applies.
    """
    x = _check_row(logits)
    if presence == 0.0 and frequency == 0.0:
        return x
    gen = np.asarray(list(generated) if not isinstance(generated, np.ndarray) else generated,
                     dtype=np.int64)
    if gen.size == 0:
        return x
    if gen.min() < 0 or gen.max() >= x.shape[0]:
        raise ValueError(f"generated ids outside [0, {x.shape[0]}): min {gen.min()}, max {gen.max()}")
    seen, counts = np.unique(gen, return_counts=True)
    out = np.array(x, dtype=np.float32, copy=True)
    out[seen] -= (counts * np.float32(frequency) + np.float32(presence)).astype(np.float32)
    return out


def apply_temperature(logits: np.ndarray, temperature: float) -> np.ndarray:
    """float64 logits (V,) / temperature; temperature > 0 (0 means greedy, handled by the caller)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 here (0 means greedy), got {temperature}")
    x = _check_row(logits)
    # float64: a large float32 logit divided by a small temperature must not overflow to inf
    return np.asarray(x, dtype=np.float64) / float(temperature)


def top_k_filter(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep the k largest logits (ties at the k-th value are all kept), -inf elsewhere; k <= 0 is off."""
    x = _check_row(logits)
    if k <= 0 or k >= x.shape[0]:
        return x
    kth = np.partition(x, x.shape[0] - k)[x.shape[0] - k]       # the k-th largest value
    return np.where(x >= kth, x, -np.inf).astype(x.dtype, copy=False)


def top_p_filter(logits: np.ndarray, p: float) -> np.ndarray:
    """Nucleus filter: keep the most probable tokens until their probability reaches p; p >= 1 is off."""
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    x = _check_row(logits)
    if p >= 1.0:
        return x
    # sort only the tokens still in play (after top-k that is a handful, not the vocabulary)
    live = np.flatnonzero(np.isfinite(x))
    probs = softmax(x[live])
    order = np.argsort(-probs, kind="stable")                   # most probable first
    before = np.cumsum(probs[order]) - probs[order]             # mass strictly before each token
    keep_sorted = before < p                                    # the crossing token is kept
    keep_sorted[0] = True
    keep = np.zeros(x.shape[0], dtype=bool)
    keep[live[order[keep_sorted]]] = True
    return np.where(keep, x, -np.inf).astype(x.dtype, copy=False)


def min_p_filter(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Keep tokens with probability >= min_p * (top probability); min_p <= 0 is off."""
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    x = _check_row(logits)
    if min_p <= 0.0:
        return x
    probs = softmax(x)
    keep = probs >= min_p * probs.max()
    return np.where(keep, x, -np.inf).astype(x.dtype, copy=False)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities (V,) of logits (V,); -inf entries stay -inf."""
    x = np.asarray(_check_row(logits), dtype=np.float64)
    m = np.max(x)
    if not np.isfinite(m):
        raise ColibriError(f"cannot take a log-softmax: the largest logit is {m}")
    z = x - m
    return z - np.log(np.exp(z).sum())


def top_logprobs(logprobs: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, log-probability) of a row (V,), best first (ties: lower id
    first)."""
    lp = _check_row(logprobs)
    return [(i, float(lp[i])) for i in top_ids(lp, k)]


def top_ids(row: np.ndarray, k: int) -> list[int]:
    """The ids of the k largest values of a row (V,), best first; of equal values the lower
    ids, also where the tie straddles the k-th place (argpartition alone picks any)."""
    k = min(int(k), row.shape[0])
    if k <= 0:
        return []
    if k == 1:
        return [int(np.argmax(row))]                       # the first largest
    kth = row[np.argpartition(-row, k - 1)[k - 1]]          # the k-th largest value
    above = np.flatnonzero(row > kth)
    pick = np.concatenate([above, np.flatnonzero(row == kth)[:k - above.size]])
    return pick[np.lexsort((pick, -row[pick]))].tolist()


def greedy(logits: np.ndarray) -> int:
    """Index of the largest logit (the first one on ties, like torch.argmax on CPU)."""
    x = _check_row(logits)
    i = int(np.argmax(x))                    # a NaN is argmax's maximum: one pass checks too
    if np.isnan(x[i]):
        raise ColibriError(f"logits hold {int(np.isnan(x).sum())} NaN values; cannot pick a token")
    return i


def sample_from_logits(logits: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token from softmax(logits) with `rng` (inverse CDF on float64 probabilities)."""
    return sample_from_probs(softmax(_check_row(logits)), rng)


def sample_from_probs(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token from probabilities float64 (V,) (any positive total) with `rng`."""
    cdf = np.cumsum(probs)
    u = rng.random() * cdf[-1]
    i = int(np.searchsorted(cdf, u, side="right"))
    i = min(i, probs.shape[0] - 1)
    # a draw can land on a zero-probability slot only through rounding at the very end of the
    # CDF: step back to the last token that has mass
    while probs[i] == 0.0 and i > 0:
        i -= 1
    return i


class Sampler:
    """Next-token chooser with fixed settings and its own seeded random generator.

    `Sampler(temperature=0.8, top_k=40, top_p=0.95, seed=0)(logits, history)` -> token id.
    The same settings and seed give the same sequence of draws. `penalise` and `choose` are
    the two halves of a call (a server reports log-probabilities of the penalised logits).
    """

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0, repetition_penalty: float = 1.0, seed: int | None = None,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0):
        temperature, top_p, min_p = (check_real("temperature", temperature),
                                     check_real("top_p", top_p), check_real("min_p", min_p))
        repetition_penalty = check_real("repetition_penalty", repetition_penalty)
        presence_penalty = check_real("presence_penalty", presence_penalty)
        frequency_penalty = check_real("frequency_penalty", frequency_penalty)
        top_k, seed = check_top_k(top_k), check_seed(seed)
        self.temperature = float(temperature)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.min_p = float(min_p)
        self.repetition_penalty = float(repetition_penalty)
        self.presence_penalty = float(presence_penalty)
        self.frequency_penalty = float(frequency_penalty)
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def __call__(self, logits: np.ndarray, history: Iterable[int] | np.ndarray = (),
                 generated: Iterable[int] | np.ndarray = ()) -> int:
        """Token id for logits (V,), float32; `history` = ids seen so far (prompt included, for
        the repetition penalty), `generated` = ids generated so far (presence / frequency)."""
        return self.choose(self.penalise(logits, history, generated))

    def penalise(self, logits: np.ndarray, history: Iterable[int] | np.ndarray = (),
                 generated: Iterable[int] | np.ndarray = ()) -> np.ndarray:
        """logits (V,) after the repetition, presence and frequency penalties (the input
        itself when all are off); NaN logits are a ColibriError."""
        x = _check_row(logits)
        if np.isnan(x).any():
            raise ColibriError(f"logits hold {int(np.isnan(x).sum())} NaN values; cannot pick a token")
        x = apply_repetition_penalty(x, history, self.repetition_penalty)
        return apply_presence_frequency_penalty(x, generated, self.presence_penalty,
                                                self.frequency_penalty)

    def choose(self, x: np.ndarray) -> int:
        """The token for penalised logits x (V,): greedy, or temperature, filters and a draw."""
        if self.is_greedy:
            return greedy(x)
        x = apply_temperature(x, self.temperature)
        x = top_k_filter(x, self.top_k)
        x = top_p_filter(x, self.top_p)
        x = min_p_filter(x, self.min_p)
        return sample_from_logits(x, self.rng)

    def distribution(self, x: np.ndarray) -> np.ndarray:
        """float64 probabilities (V,) that `choose` draws from for penalised logits x (V,):
        temperature, top-k, top-p and min-p applied (greedy: all mass on greedy(x)).
        Speculative decoding (colibri.generation.speculative) compares these for target and
        draft."""
        if self.is_greedy:
            p = np.zeros(np.shape(x)[-1], dtype=np.float64)
            p[greedy(x)] = 1.0
            return p
        x = apply_temperature(x, self.temperature)
        x = top_k_filter(x, self.top_k)
        x = top_p_filter(x, self.top_p)
        x = min_p_filter(x, self.min_p)
        return softmax(x)

    def __repr__(self) -> str:
        return (f"Sampler(temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}, "
                f"min_p={self.min_p}, repetition_penalty={self.repetition_penalty}, "
                f"presence_penalty={self.presence_penalty}, "
                f"frequency_penalty={self.frequency_penalty}, seed={self.seed})")


# ---------------------------------------------------------------------------------------------
# a request's settings: what the scheduler, colibri.generate and the server pass around
# ---------------------------------------------------------------------------------------------

@dataclass
class SamplingParams:
    """How one request is sampled and when it stops; the defaults are colibri.generate's
    (greedy, the model's end-of-sequence ids). The ranges are REAL_BOUNDS and the MAX_*
    constants above, the same for every caller.

    stop: text stop sequences (matched across token boundaries, not part of the output);
    stop_ids: stop token ids (None: the model's end-of-sequence ids; [] none);
    logprobs: None none, 0 the chosen token's, k (<= MAX_LOGPROBS) also the k most likely;
    prompt_logprobs: the same for the prompt's own tokens (colibri.generation.prompt_logprobs: the
    handle's prompt_logprobs, complete at the first event);
    return_routing: each TokenEvent carries the experts its token was routed to;
    constraint: a colibri.generation.constraints.ConstraintSpec (JSON schema, regex, grammar) the
    output must follow: masked before each draw, the request stops when the grammar is complete;
    detokenize: False leaves every TokenEvent's text empty (no incremental decoding: a
    caller that decodes the ids itself, as colibri.generate for one prompt; no stop strings).
    max_tokens 0 generates nothing: the prompt is prefilled (and scored) and the request
    ends with finish_reason "length".
    """
    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_ids: list[int] | None = None
    logprobs: int | None = None
    return_routing: bool = False
    prompt_logprobs: int | None = None
    constraint: ConstraintSpec | None = None
    detokenize: bool = True

    def check(self) -> None:
        """ValueError naming the field, the value and the allowed range (SettingTypeError, a
        ValueError too, for a value of the wrong type)."""
        def bad(name, rng):
            raise ValueError(f"{name} must be {rng}, got {getattr(self, name)!r}")

        def is_int(v) -> bool:
            return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))

        if not is_int(self.max_tokens) or not 0 <= self.max_tokens <= 2**31 - 1:
            bad("max_tokens", "an integer in [0, 2**31 - 1]")
        for name in REAL_BOUNDS:
            check_real(name, getattr(self, name))
        check_top_k(self.top_k)
        check_seed(self.seed)
        if (not isinstance(self.stop, (list, tuple)) or len(self.stop) > MAX_STOPS
                or any(not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS
                       for s in self.stop)):
            bad("stop", f"a list of at most {MAX_STOPS} non-empty strings of at most "
                        f"{MAX_STOP_CHARS} characters")
        if self.stop_ids is not None and (not isinstance(self.stop_ids, (list, tuple))
                                          or any(not is_int(i) or i < 0 for i in self.stop_ids)):
            bad("stop_ids", "None or a list of non-negative token ids")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                bad(name, f"None or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("return_routing", "detokenize"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                bad(name, "a bool")
        if self.stop and not self.detokenize:
            bad("stop", "empty when detokenize is False (stop strings are matched in the text)")
        if self.constraint is not None and not isinstance(self.constraint, ConstraintSpec):
            bad("constraint", "None or a colibri.generation.constraints.ConstraintSpec (compile_spec)")

    def sampler(self) -> Sampler:
        """A Sampler of these settings (its own seeded random generator)."""
        return Sampler(self.temperature, self.top_k, self.top_p, self.min_p,
                       self.repetition_penalty, self.seed, self.presence_penalty,
                       self.frequency_penalty)
