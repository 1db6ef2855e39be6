"""Speculative decoding: proposers (n-gram prompt lookup in `ngram.py`, a draft model in `draft.py`),
exact verification (`acceptance.py`: which proposals a request keeps; `verifier.py`: one step's
verification), the measured rule that sizes each request's proposal (`adaptive.py`) and the per-step
orchestration with its counters (`speculator.py`)."""
