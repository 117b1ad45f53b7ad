"""Structured outputs (JSON schema, regex, choice, grammar, structural tag) through llguidance.

params.py: StructuredOutputsParams (vLLM's names); compiler.py: constraints -> cached matchers;
runtime.py: the per-step mask before sampling and the advance after it; engine.py: the hooks the
engine calls.
"""

from expertmesh.structured_outputs.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
