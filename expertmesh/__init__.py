"""expertmesh: Mixture-of-Experts inference over data, tensor, pipeline and expert parallel
processes, with vLLM's offline API."""

from expertmesh.entrypoints.llm import LLM
from expertmesh.outputs import CompletionOutput, Logprob, RequestOutput
from expertmesh.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
