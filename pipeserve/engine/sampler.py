"""On-device sampling, vectorised over the batch.

Per-slot parameters live in persistent device buffers written once per request (`set_request`);
`sample` reads them by slot and never syncs with the host: every branch it takes is decided by
numpy mirrors of the same parameters, and host arrays reach the device by non-blocking copies.
Order per step: structured-output token mask (constrained
rows only) -> logit_bias (biased rows only; one scatter-add over the step's rows) -> repetition /
presence / frequency penalties -> min_tokens mask -> greedy argmax, or
temperature -> top-k -> top-p -> min-p -> exponential race. Logprobs are of the raw model logits.

Randomness is a counter-based hash of (seed, tokens generated so far, vocab index), so a seeded
request draws the same stream whatever batch or slot it sits in, and resumes it after preemption.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from pipeserve.engine.executor.buffers import upload
from pipeserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pipeserve.engine.structured import TokenMask

# Temperatures below this are treated as greedy: dividing by them overflows float32 logits.
MIN_TEMPERATURE = 1e-5

_MASK32 = 0xFFFFFFFF
_STEP_SALT = 0x9E3779B9
_VOCAB_SALT = 0x85EBCA6B


def _signed32(c: int) -> int:
    """c mod 2**32 as a value in [-2**31, 2**31): x * it stays inside int64 for every x < 2**32 and
    has the same low 32 bits as x * c, so no product ever overflows."""
    return c - (1 << 32) if c >= 1 << 31 else c


_MUL1 = _signed32(0x7FEB352D)
_MUL2 = _signed32(0x846CA68B)


# What the hash runs on: int64 torch tensors, or int64 numpy arrays (the same ops give the same bits).
Bits = TypeVar("Bits", torch.Tensor, np.ndarray)


def mix32(x: Bits) -> Bits:
    """lowbias32 (Wellons' hash prospector), a bijection on 32-bit values held in int64 [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK32
    return x ^ (x >> 16)


def vocab_keys(vocab_size: int, device: torch.device) -> torch.Tensor:
    """Hashed vocab indices: rows keyed k1, k2 then share values only by chance (about V**2 / 2**32
    of them), never a whole shifted copy as with raw indices when k1 ^ k2 < V."""
    return mix32(torch.arange(vocab_size, dtype=torch.int64, device=device) ^ _VOCAB_SALT)


def row_keys(seeds: Bits, steps: Bits) -> Bits:
    """Each row's key [B] from its (seed, step), int64: on the device, or on the host (numpy), where
    these few ops over B values cost a fraction of as many device op launches."""
    return mix32((seeds & _MASK32) ^ mix32((seeds >> 32) ^ mix32((steps & _MASK32) ^ _STEP_SALT)))


def uniform(seeds: torch.Tensor, steps: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """float32 [B, V] in (0, 1): a pure function of (seed, step, vocab index) per element."""
    return uniform_rows(row_keys(seeds, steps), keys)


def uniform_rows(row: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`uniform` of the rows' keys (`row_keys`)."""
    bits = mix32(row[:, None] ^ keys[None, :])
    # The top 24 bits fit float32 exactly; the half offset keeps u away from 0 and 1.
    return ((bits >> 8).to(torch.float32) + 0.5) * 2.0**-24


def race(log_weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """argmax of w / E with E = -log(u) exponential, in log space: a sample of softmax(log_weights)
    per row (an exponential race), decided by the uniforms u alone."""
    return (log_weights - (-u.log()).log()).argmax(-1)


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor | None = None  # float32 [B], of the sampled token
    top_ids: torch.Tensor | None = None  # int64 [B, K]
    top_logprobs: torch.Tensor | None = None  # float32 [B, K]


class Sampler:
    def __init__(
        self,
        max_num_seqs: int,
        vocab_size: int,
        device: torch.device,
        max_logprobs: int = 20,
        seed: int | None = None,
    ):
        n, v = max_num_seqs, vocab_size
        self.vocab_size = v
        self.device = torch.device(device)
        self.max_logprobs = max_logprobs
        dev, f32, i64 = self.device, torch.float32, torch.int64
        # Device state, one row per slot. Greedy rows keep neutral sampling values (temperature 1,
        # no top-k/p/min-p) so mixed batches can run the random path over every row.
        self.greedy = torch.zeros(n, dtype=torch.bool, device=dev)
        self.temperature = torch.ones(n, dtype=f32, device=dev)
        self.top_k = torch.full((n,), v, dtype=i64, device=dev)
        self.top_p = torch.ones(n, dtype=f32, device=dev)
        self.min_p = torch.zeros(n, dtype=f32, device=dev)
        self.repetition_penalty = torch.ones(n, dtype=f32, device=dev)
        self.presence_penalty = torch.zeros(n, dtype=f32, device=dev)
        self.frequency_penalty = torch.zeros(n, dtype=f32, device=dev)
        self.seed = torch.zeros(n, dtype=i64, device=dev)
        self.min_tokens = torch.zeros(n, dtype=i64, device=dev)
        self.generated = torch.zeros(n, dtype=i64, device=dev)
        # Stop ids padded by repeating the row's first id, so a scatter writes one value per column.
        self.stop_ids = torch.zeros(n, 4, dtype=i64, device=dev)
        # logit_bias, sparse: each row's token ids and biases, padded with (id 0, bias 0) so one
        # scatter-add applies every row (an unbiased row adds zeros: exact); widened as requests need.
        self.bias_ids = torch.zeros(n, 8, dtype=i64, device=dev)
        self.bias_values = torch.zeros(n, 8, dtype=f32, device=dev)
        # [n, V] penalty state, allocated on the first request that uses a penalty.
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        self.vocab_keys = vocab_keys(v, self.device)
        # Host mirrors: the per-step branches read these, never the device.
        self._greedy = np.zeros(n, dtype=bool)
        self._top_k = np.full(n, v, dtype=np.int64)
        self._top_p = np.ones(n, dtype=np.float32)
        self._min_p = np.zeros(n, dtype=np.float32)
        self._penalized = np.zeros(n, dtype=bool)
        self._biased = np.zeros(n, dtype=bool)
        self._bias_written = np.zeros(n, dtype=bool)  # the slot's device row holds nonzero biases
        self._logprobs = np.full(n, -1, dtype=np.int64)  # -1: no logprobs
        self._min_tokens = np.zeros(n, dtype=np.int64)
        self._generated = np.zeros(n, dtype=np.int64)
        self._seed = np.zeros(n, dtype=np.int64)
        if dev.type == "cpu":  # one counter: the device tensor is a view of the host mirror
            self.generated = torch.from_numpy(self._generated)
        self._rng = np.random.default_rng(seed)

    def set_request(
        self,
        slot: int,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        stop_ids: Sequence[int],
    ) -> None:
        """Write row `slot` for a newly admitted (or re-admitted, with its output so far) request.
        stop_ids (eos + stop_token_ids) are used only to enforce min_tokens."""
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(f"logprobs must be <= {self.max_logprobs}, got {params.logprobs}")
        v = self.vocab_size
        greedy = params.temperature < MIN_TEMPERATURE
        top_k = v if greedy or not 0 < params.top_k < v else params.top_k
        top_p = 1.0 if greedy else params.top_p
        min_p = 0.0 if greedy else params.min_p
        stops = [t for t in stop_ids if 0 <= t < v]
        min_tokens = params.min_tokens if stops else 0
        penalized = (
            params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
        )
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**63))

        self.greedy[slot] = greedy
        self.temperature[slot] = 1.0 if greedy else params.temperature
        self.top_k[slot] = top_k
        self.top_p[slot] = top_p
        self.min_p[slot] = min_p
        self.repetition_penalty[slot] = params.repetition_penalty
        self.presence_penalty[slot] = params.presence_penalty
        self.frequency_penalty[slot] = params.frequency_penalty
        self.seed[slot] = seed
        self.min_tokens[slot] = min_tokens
        self.generated[slot] = len(output_ids)
        if stops:
            self._write_stop_ids(slot, stops)
        if penalized:
            self._write_penalty_state(slot, prompt_ids, output_ids)
        biased = bool(params.logit_bias)
        if biased:
            assert params.logit_bias is not None
            self._write_logit_bias(slot, params.logit_bias)
        elif self._bias_written[slot]:  # the scatter-add reads every row of a step: clear a past bias
            self.bias_values[slot].zero_()
        self._bias_written[slot] = biased

        self._greedy[slot] = greedy
        self._top_k[slot] = top_k
        self._top_p[slot] = top_p
        self._min_p[slot] = min_p
        self._penalized[slot] = penalized
        self._biased[slot] = biased
        self._logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        self._min_tokens[slot] = min_tokens
        self._generated[slot] = len(output_ids)
        self._seed[slot] = seed

    def free(self, slot: int) -> None:
        """Neutralise the slot's host mirrors; device rows are rewritten by the next set_request."""
        self._greedy[slot] = False
        self._top_k[slot] = self.vocab_size
        self._top_p[slot] = 1.0
        self._min_p[slot] = 0.0
        self._penalized[slot] = False
        self._biased[slot] = False
        self._logprobs[slot] = -1
        self._min_tokens[slot] = 0
        self._generated[slot] = 0

    def _write_stop_ids(self, slot: int, stops: list[int]) -> None:
        width = self.stop_ids.shape[1]
        if len(stops) > width:
            grown = self.stop_ids[:, :1].repeat(1, max(len(stops), 2 * width))
            grown[:, :width] = self.stop_ids
            self.stop_ids, width = grown, grown.shape[1]
        row = stops + [stops[0]] * (width - len(stops))
        self.stop_ids[slot] = upload(np.asarray(row, dtype=np.int64), self.device)

    def _write_logit_bias(self, slot: int, bias: dict[int, float]) -> None:
        width = self.bias_ids.shape[1]
        if len(bias) > width:  # widen every row; the new columns pad with (0, 0)
            new = max(len(bias), 2 * width)
            ids = torch.zeros(len(self._greedy), new, dtype=torch.int64, device=self.device)
            values = torch.zeros(len(self._greedy), new, dtype=torch.float32, device=self.device)
            ids[:, :width], values[:, :width] = self.bias_ids, self.bias_values
            self.bias_ids, self.bias_values, width = ids, values, new
        pad = width - len(bias)
        self.bias_ids[slot] = upload(np.asarray([*bias, *[0] * pad], dtype=np.int64), self.device)
        self.bias_values[slot] = upload(np.asarray([*bias.values(), *[0.0] * pad], dtype=np.float32),
                                        self.device)

    def _apply_logit_bias(self, x: torch.Tensor, slots: np.ndarray, slots_t: torch.Tensor) -> torch.Tensor:
        """x plus the rows' logit_bias, when any row has one (an out-of-place scatter-add)."""
        if not self._biased[slots].any():
            return x
        ids, values = self.bias_ids.index_select(0, slots_t), self.bias_values.index_select(0, slots_t)
        return x.scatter_add(1, ids, values)

    def _write_penalty_state(self, slot: int, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        if self.output_counts is None or self.prompt_mask is None:
            shape = (len(self._greedy), self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        prompt = upload(np.asarray(prompt_ids, dtype=np.int64), self.device)
        output = upload(np.asarray(output_ids, dtype=np.int64), self.device)
        self.prompt_mask[slot].zero_()
        self.prompt_mask[slot, prompt] = True
        self.output_counts[slot].zero_()
        self.output_counts[slot].scatter_add_(0, output, torch.ones_like(output, dtype=torch.int32))

    def sample(
        self,
        logits: torch.Tensor,
        slots: np.ndarray,
        slots_t: torch.Tensor,
        mask: TokenMask | None = None,
        offsets: tuple[np.ndarray, torch.Tensor] | None = None,
    ) -> SampleOutput:
        """Sample one token per row of logits [B, V]; row i belongs to slot slots[i] (== slots_t[i]).
        mask: the structured-output constraint of some rows. Tokens stay on the device. Updates the
        slots' output counts and generated counts.

        offsets (host, device) int64 [B]: speculative verification, where a slot has several rows and
        row i stands at output index generated + offsets[i]: its noise and min_tokens mask are that
        index's, and nothing advances (the caller calls `advance` with the tokens it accepts). Rows
        of penalized slots must have offset 0 (their counts would need the proposals)."""
        # Never modified in place: logits may be float32 already. Each op here is a few microseconds
        # of a small model's step, so the common cases (greedy, no penalties) take as few as they can.
        x = logits if logits.dtype == torch.float32 else logits.float()
        if mask is not None:
            if x.data_ptr() == logits.data_ptr():
                x = x.clone()
            mask.apply(x)
        x = self._apply_logit_bias(x, slots, slots_t)
        penalized = self.output_counts is not None and bool(self._penalized[slots].any())
        if penalized:
            x = self._apply_penalties(x, slots_t)
        host_steps = self._generated[slots] if offsets is None else self._generated[slots] + offsets[0]
        blocked = self._min_tokens[slots] > host_steps  # rows before their min_tokens: stops masked
        if blocked.any():
            x = self._mask_stop_ids(x, slots_t, blocked)
        greedy = self._greedy[slots]
        if greedy.all():
            tokens = x.argmax(-1)
        else:
            tokens = self._race(self.filtered_logits(x, slots, slots_t), slots, host_steps)
            if greedy.any():
                tokens = torch.where(self.greedy[slots_t], x.argmax(-1), tokens)
        out = SampleOutput(tokens)
        num_top = int(self._logprobs[slots].max(initial=-1))
        if num_top >= 0:
            # Of the raw model distribution, before penalties and temperature (vLLM's default).
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            out.logprobs = logprobs.gather(1, tokens[:, None]).squeeze(1)
            out.top_logprobs, out.top_ids = logprobs.topk(num_top, dim=-1)
        if offsets is None:
            self._advance(slots, slots_t, tokens, penalized)
        return out

    def is_greedy(self, slots: np.ndarray) -> np.ndarray:
        """Host view: which of these slots decode greedily."""
        greedy: np.ndarray = self._greedy[slots]
        return greedy

    def advance(self, slots: np.ndarray, slots_t: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count tokens accepted after a `sample` with offsets: one entry per token, slots repeating."""
        penalized = self.output_counts is not None and bool(self._penalized[slots].any())
        self._advance(slots, slots_t, tokens, penalized)

    def processed_logits(
        self, logits: torch.Tensor, slots: np.ndarray, slots_t: torch.Tensor, steps: torch.Tensor
    ) -> torch.Tensor:
        """The log-weights [B, V] `sample` races over for non-greedy rows (min_tokens mask at output
        index `steps`, logit_bias, temperature, top-k, top-p, min-p; -inf outside the kept set): the
        distribution speculative rejection sampling compares. Slots must not be penalized or
        constrained."""
        x = self._apply_logit_bias(logits.float(), slots, slots_t)
        if (self._min_tokens[slots] > 0).any():  # rows at or past min_tokens pass unchanged
            x = self._mask_stop_ids(x, slots_t, steps < self.min_tokens[slots_t])
        return self.filtered_logits(x, slots, slots_t)

    def noise(self, slots_t: torch.Tensor, steps: torch.Tensor, salt: int = 0) -> torch.Tensor:
        """The uniforms [B, V] a row's race draws at output index `steps`; salt != 0: an independent
        stream of the same seed (the draft's proposals, the acceptance test)."""
        return uniform(self.seed[slots_t] ^ salt, steps, self.vocab_keys)

    def _apply_penalties(self, x: torch.Tensor, slots_t: torch.Tensor) -> torch.Tensor:
        assert self.output_counts is not None and self.prompt_mask is not None
        counts = self.output_counts[slots_t]
        seen_output = counts > 0
        # HF repetition penalty over prompt + output; neutral rows (penalty 1) are exact identities.
        rep = self.repetition_penalty[slots_t, None]
        x = torch.where(self.prompt_mask[slots_t] | seen_output, torch.where(x > 0, x / rep, x * rep), x)
        # OpenAI presence / frequency penalties over output tokens only.
        penalized: torch.Tensor = (
            x
            - self.frequency_penalty[slots_t, None] * counts
            - self.presence_penalty[slots_t, None] * seen_output
        )
        return penalized

    def _mask_stop_ids(self, x: torch.Tensor, slots_t: torch.Tensor,
                       blocked: np.ndarray | torch.Tensor) -> torch.Tensor:
        """The rows' stop ids at -inf where blocked [B] (known on the host, or on the device)."""
        ids = self.stop_ids.index_select(0, slots_t)
        if isinstance(blocked, np.ndarray):
            if blocked.all():  # one op
                return x.scatter(1, ids, float("-inf"))
            blocked = upload(blocked, x.device)
        return x.scatter(1, ids, x.gather(1, ids).masked_fill(blocked[:, None], float("-inf")))

    def filtered_logits(self, x: torch.Tensor, slots: np.ndarray, slots_t: torch.Tensor) -> torch.Tensor:
        """Temperature, then top-k, top-p and min-p as -inf: what the race samples from."""
        x = x / self.temperature[slots_t, None]
        use_top_p = bool((self._top_p[slots] < 1.0).any())
        # top-p needs the whole sorted row; top-k alone only the largest max(k) values.
        k_max = self.vocab_size if use_top_p else int(self._top_k[slots].max())
        if k_max < self.vocab_size or use_top_p:
            x = self._top_k_top_p(x, slots_t, k_max, use_top_p)
        if (self._min_p[slots] > 0.0).any():
            # p < min_p * p_max  <=>  logit < max_logit + log(min_p); log(0) = -inf keeps the row.
            floor = x.amax(dim=-1, keepdim=True) + self.min_p[slots_t, None].log()
            x = x.masked_fill(x < floor, float("-inf"))
        return x

    def _race(self, x: torch.Tensor, slots: np.ndarray, host_steps: np.ndarray) -> torch.Tensor:
        # Exponential race (Gumbel-max): argmax p / E with E = -log(u), taken in log space. The noise
        # is `noise`'s, its row keys hashed from the host mirrors.
        rows = upload(row_keys(self._seed[slots], host_steps), x.device)
        return race(x, uniform_rows(rows, self.vocab_keys))

    def _top_k_top_p(
        self, x: torch.Tensor, slots_t: torch.Tensor, k_max: int, use_top_p: bool
    ) -> torch.Tensor:
        values, ids = x.topk(k_max, dim=-1)  # sorted descending
        rank = torch.arange(k_max, device=x.device)
        drop = rank[None, :] >= self.top_k[slots_t, None]
        if use_top_p:
            probs = values.masked_fill(drop, float("-inf")).softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            # Keep the smallest prefix whose mass reaches top_p; rows at 1.0 skip it so float
            # rounding of the cumulative sum never trims their tail.
            top_p = self.top_p[slots_t, None]
            drop |= (mass_before > top_p) & (top_p < 1.0)
        keep = torch.zeros_like(x, dtype=torch.bool).scatter_(1, ids, ~drop)
        return x.masked_fill(~keep, float("-inf"))

    def _advance(
        self, slots: np.ndarray, slots_t: torch.Tensor, tokens: torch.Tensor, penalized: bool
    ) -> None:
        if penalized:
            assert self.output_counts is not None
            flat = slots_t * self.vocab_size + tokens
            self.output_counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        np.add.at(self._generated, slots, 1)  # slots repeat after speculative verification
        if self.generated.device.type != "cpu":  # on the CPU the line above counted both
            self.generated.index_add_(0, slots_t, torch.ones_like(slots_t))
