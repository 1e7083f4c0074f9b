"""pdserve: a prefill/decode-disaggregated LLM inference server."""

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from pdserve.llm import LLM
    from pdserve.sampling_params import SamplingParams


def __getattr__(name: str):
    # Lazy so that torch-free parts (router, bench) can import pdserve without torch.
    if name == "LLM":
        from pdserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pdserve.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
