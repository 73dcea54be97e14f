"""Exact speculative decoding: drafters propose, the target verifies, rejected tokens roll back.

The pieces here are model-independent: drafters (`ngram`), lossless acceptance rules
(`acceptance`), draft trees and their attention masks (`tree`) and the adaptive draft-length
controller (`controller`). The verify step itself runs the target model over the draft and rolls
its caches back by replay (kapitsa.engine.cache.hybrid).
"""

from kapitsa.engine.speculative.drafter import Draft, Drafter
from kapitsa.engine.speculative.ngram import NGramDrafter

__all__ = ["Draft", "Drafter", "NGramDrafter"]
