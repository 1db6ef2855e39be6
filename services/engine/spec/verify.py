"""Which proposed tokens a request keeps, exact in distribution.

A request with k proposals d_0..d_{k-1} is verified by k + 1 target rows: row j holds the target's
distribution p_j after the prefix extended by d_0..d_{j-1}.
- Deterministic proposals (n-gram lookup, a greedy draft): the target samples every row as it
  would without speculation (noise keyed on the request's seed and the output index), and d_j is
  kept while it equals the target's own sample t_j. The emitted tokens t_0..t_m are then exactly
  the tokens sequential decoding emits, so this is rejection sampling against a point mass and
  independent of whatever else runs in the batch (`accept_matching`).
- Sampled proposals (a draft model at temperature > 0, drawn from q_j): keep d_j with probability
  min(1, p_j(d_j) / q_j(d_j)); at the first rejection emit a sample of the normalised residual
  max(0, p_j - q_j); when all k are kept, emit a sample of p_k (`rejection_sample`)."""

from __future__ import annotations

import numpy as np
import torch

from services.engine.sampler import race


def accept_matching(targets: np.ndarray, proposals: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Tokens kept per request: the length of the run of proposals equal to the target's samples.
    targets [N, K + 1] (the target's token at every verify row), proposals [N, K] and lengths [N]
    (request i proposed lengths[i] <= K tokens; the rest is padding)."""
    k = proposals.shape[1]
    valid = np.arange(k)[None, :] < lengths[:, None]
    match = (targets[:, :k] == proposals) & valid
    # The first False of each row (a sentinel column guarantees one) is the number kept.
    kept: np.ndarray = np.argmin(np.concatenate([match, np.zeros((len(match), 1), bool)], axis=1), axis=1)
    return kept


def rejection_sample(
    p_logw: torch.Tensor,
    q: torch.Tensor,
    draft: torch.Tensor,
    lengths: torch.Tensor,
    u_accept: torch.Tensor,
    u_race: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify sampled proposals. p_logw [N, K + 1, V]: the target's log-weights at each row (-inf
    outside its kept set); q [N, K, V]: the draft's probabilities that drew draft [N, K]; lengths
    [N]: proposals per request (the rest padding); u_accept [N, K] and u_race [N, K + 1, V]:
    uniforms in (0, 1). Returns (tokens [N, K + 1], emitted [N]): request i emits
    tokens[i, :emitted[i]], its kept proposals followed by one corrected or bonus token."""
    n, k1, v = p_logw.shape
    k = k1 - 1
    p = torch.softmax(p_logw.float(), dim=-1)
    # Padded rows and the bonus row are a draft of probability zero: never kept, residual = p.
    valid = torch.arange(k, device=q.device)[None, :] < lengths[:, None]
    q_full = torch.zeros_like(p)
    q_full[:, :k] = q.float() * valid[:, :, None]
    d = draft.clamp(min=0)
    p_d = p[:, :k].gather(2, d[:, :, None]).squeeze(2)
    q_d = q_full[:, :k].gather(2, d[:, :, None]).squeeze(2)
    keep = valid & (u_accept * q_d <= p_d) & (q_d > 0)
    kept = torch.cumprod(keep.int(), dim=1).sum(dim=1)  # [N]: leading run of kept proposals
    residual = (p - q_full).clamp(min=0)
    # p == q to the last bit leaves no residual; a rejection is then impossible, p is a safe stand-in.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)
    last = race(residual.log(), u_race).view(n, k1)  # the token each row would emit on rejection
    tokens = torch.cat([d, torch.zeros(n, 1, dtype=d.dtype, device=d.device)], dim=1)
    tokens = tokens.scatter(1, kept[:, None], last.gather(1, kept[:, None]))
    return tokens, kept + 1
