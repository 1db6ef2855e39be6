"""Accuracy of a (quantized) model: teacher-forced logits for every position through the engine's own
forward pass and paged KV cache, perplexity, greedy agreement, and a held-out text to measure them on.

The text is generated here (simple children's-story English from templates, seeded), so no data set
is needed and nothing the model was trained on is reused verbatim.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pipeserve.engine.kv.metadata import AttentionMetadata
from pipeserve.engine.kv.pool import KVPool

from .llama import LlamaForCausalLM

NAMES = ["Lily", "Tom", "Sue", "Ben", "Mia", "Max", "Anna", "Sam", "Lucy", "Tim", "Zoe", "Jack"]
ANIMALS = ["dog", "cat", "bird", "bunny", "frog", "duck", "bear", "fish", "mouse", "puppy"]
THINGS = ["ball", "kite", "box", "hat", "book", "toy car", "flower", "cake", "boat", "drum"]
PLACES = ["park", "garden", "forest", "house", "school", "beach", "yard", "river", "farm", "shop"]
ADJECTIVES = ["big", "small", "red", "happy", "shiny", "soft", "old", "pretty", "funny", "little"]
FEELINGS = ["happy", "sad", "scared", "proud", "tired", "excited", "surprised", "kind"]
LIKES = ["play", "run", "sing", "dance", "jump", "read", "swim", "draw", "help", "laugh"]
SENTENCES = [
    "Once upon a time, there was a {adj} {animal} named {name}.",
    "{name} liked to {like} in the {place} every day.",
    "One day, {name} saw a {adj} {thing} near the {place}.",
    '"Look at this {thing}!" said {name} to {friend}.',
    "{friend} smiled and said, \"Let's {like} together.\"",
    "They went to the {place} and played with the {thing}.",
    "{name} felt {feeling} when the {thing} fell down.",
    "Then {friend} came and helped {name} find the {thing}.",
    "The sun was warm and the sky was blue.",
    "{name} and {friend} were best friends.",
    "Mom said, \"{name}, it is time to go home.\"",
    "{name} said, \"Thank you, {friend}. You are very {feeling}.\"",
    "The {adj} {animal} wanted to {like} with the other animals.",
    "At the end of the day, {name} was very {feeling}.",
    "From that day on, {name} always shared the {thing} with {friend}.",
]


def story_text(num_stories: int = 40, seed: int = 0) -> str:
    """Simple children's stories, one paragraph each (~150 tokens for stories260K's tokenizer)."""
    rng = random.Random(seed)
    stories = []
    for _ in range(num_stories):
        name, friend = rng.sample(NAMES, 2)
        words = {"name": name, "friend": friend, "animal": rng.choice(ANIMALS), "thing": rng.choice(THINGS),
                 "place": rng.choice(PLACES), "adj": rng.choice(ADJECTIVES), "feeling": rng.choice(FEELINGS),
                 "like": rng.choice(LIKES)}
        middle = rng.sample(SENTENCES[1:-1], 5)
        stories.append(" ".join(s.format(**words) for s in [SENTENCES[0], *middle, SENTENCES[-1]]))
    return "\n".join(stories)


def windows(ids: Sequence[int], length: int, bos: int | None) -> list[list[int]]:
    """Consecutive windows of `length` tokens (a leading BOS counted), the last one possibly shorter."""
    body = length - (bos is not None)
    head = [] if bos is None else [bos]
    return [head + list(ids[i : i + body]) for i in range(0, len(ids), body) if len(ids[i : i + body]) > 1]


@torch.inference_mode()
def teacher_forced_logits(model: LlamaForCausalLM, seqs: Sequence[Sequence[int]],
                          kv_cache_dtype: str = "auto", page_size: int = 16) -> list[torch.Tensor]:
    """fp32 logits [len, vocab] for every position of each sequence: one flat prefill of all of them
    through the model, attending over a fresh paged KV cache of `kv_cache_dtype` (so a quantized
    cache is read back quantized, as in serving)."""
    weight = model.embed_tokens.weight
    lens = torch.tensor([len(s) for s in seqs])
    pages = -(-int(lens.max()) // page_size)
    pool = KVPool(model.config, len(seqs) * pages, page_size, weight.dtype, weight.device, len(seqs),
                  int(lens.max()), kv_cache_dtype)
    tables = torch.arange(len(seqs) * pages, dtype=torch.int32).view(len(seqs), pages)
    if pool.seq_of_page is not None:  # what KVPool.grow records for each request's first page
        pool.seq_of_page[tables[:, 0].long()] = torch.arange(len(seqs), dtype=torch.int32,
                                                              device=weight.device)
    seq_of_row = torch.repeat_interleave(torch.arange(len(seqs)), lens)
    cu = F.pad(lens.cumsum(0), (1, 0))
    positions = torch.arange(int(lens.sum())) - cu[seq_of_row]
    slots = tables[seq_of_row, positions // page_size].long() * page_size + positions % page_size
    dev = weight.device
    meta = AttentionMetadata(slots.to(dev), 0, torch.zeros(0, pages, dtype=torch.int32, device=dev),
                             torch.zeros(0, dtype=torch.int32, device=dev), tables.to(dev),
                             cu.to(device=dev, dtype=torch.int32), lens.to(device=dev, dtype=torch.int32),
                             int(lens.max()), int(lens.max()))
    ids = torch.tensor([t for s in seqs for t in s], device=dev)
    hidden = model(ids, positions.to(dev), meta, pool.layers)
    return list(torch.split(model.compute_logits(hidden), lens.tolist()))


def perplexity(logits: Sequence[torch.Tensor], seqs: Sequence[Sequence[int]]) -> float:
    """exp(mean negative log-likelihood of every token after the first of each sequence)."""
    nll = sum(F.cross_entropy(lg[:-1].float(), torch.tensor(s[1:], device=lg.device), reduction="sum").item()
              for lg, s in zip(logits, seqs, strict=True))
    return math.exp(nll / sum(len(s) - 1 for s in seqs))


def logits_error(logits: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> float:
    """Relative RMS error of the logits against the reference model's, over every position."""
    diff = torch.cat([(a - b).flatten() for a, b in zip(logits, reference, strict=True)])
    ref = torch.cat([b.flatten() for b in reference])
    return float(diff.norm() / ref.norm())


def token_agreement(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> float:
    """Fraction of greedy positions where the tokens equal the reference's (over the reference length)."""
    pairs = zip(outputs, reference, strict=True)
    same = sum(sum(a == b for a, b in zip(o, r, strict=False)) for o, r in pairs)
    return same / sum(len(r) for r in reference)
