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
  max(0, p_j - q_j). When all k are kept, row k decides the same way with one more draft sample,
  so every output index is decided alike whatever k was (`rejection_sample`)."""

from __future__ import annotations

import numpy as np
import torch

from pipeserve.engine.sampler import race


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
    """Verify sampled proposals. Every row j decides its token the same way: the draft's sample d_j
    of q_j if kept (probability min(1, p_j(d_j) / q_j(d_j))), else a sample of the normalised
    residual max(0, p_j - q_j); rows before lengths[i] are the proposals the target saw, and the run
    goes on while they are kept. Row lengths[i] has a draft sample too (one the target did not
    see), so the token at every output index is the same function of (prefix, seed, index) however
    many tokens were proposed: seeded outputs do not depend on the adaptive proposal sizes.

    p_logw [N, K + 1, V]: the target's log-weights at each row (-inf outside its kept set); q
    [N, K + 1, V]: the draft's probabilities that drew draft [N, K + 1]; lengths [N] <= K; u_accept
    [N, K + 1] and u_race [N, K + 1, V]: uniforms in (0, 1). Returns (tokens [N, K + 1], emitted
    [N]): request i emits tokens[i, :emitted[i]], its kept proposals and one more token."""
    n, k1, v = p_logw.shape
    p = torch.softmax(p_logw.float(), dim=-1)
    q = q.float()
    d = draft.clamp(min=0)
    p_d = p.gather(2, d[:, :, None]).squeeze(2)
    q_d = q.gather(2, d[:, :, None]).squeeze(2)
    keep = (u_accept * q_d <= p_d) & (q_d > 0)
    proposed = torch.arange(k1, device=q.device)[None, :] < lengths[:, None]
    kept = torch.cumprod((keep & proposed).int(), dim=1).sum(dim=1)  # [N]: leading run of kept proposals
    residual = (p - q).clamp(min=0)
    # p == q to the last bit leaves no residual; a rejection is then impossible, p is a safe stand-in.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)
    rejected = race(residual.log(), u_race).view(n, k1)
    row_token = torch.where(keep, d, rejected)  # what each row emits when the run reaches it
    tokens = d.scatter(1, kept[:, None], row_token.gather(1, kept[:, None]))
    return tokens, kept + 1
