"""roofline: an LLM inference engine that measures every run against its physical floor."""

# First: sets the OpenMP wait policy (PASSIVE, GOMP_SPINCOUNT=100000) before anything loads torch (libgomp reads it
# once; see roofline.cpu).
import roofline.cpu  # noqa: F401, I001
from roofline.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from roofline.llm import LLM

        return LLM
    raise AttributeError(name)
