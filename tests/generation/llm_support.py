"""What the generation tests share: the tiny random-weight ``codegen`` spec (2 layers; seconds to build)."""

from aiworks.lifecycle.llm import LlmSpec

TINY = LlmSpec(layers=2, heads=2, dim=64, context=256, vocab=1024, corpus_mb=0.5, random=True)
