"""roofline: an LLM inference engine that measures every run against its physical floor."""

from roofline.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from roofline.llm import LLM

        return LLM
    raise AttributeError(name)
