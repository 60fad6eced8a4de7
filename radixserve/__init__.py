"""radixserve: a small, faithful LLM serving engine built around SGLang's RadixAttention."""

from radixserve.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs
from radixserve.version import __version__

__all__ = ["Engine", "SamplingParams", "ServerArgs", "__version__"]


def __getattr__(name: str):
    # NOTE: Engine pulls in torch and the model code; keep `import radixserve` light.
    if name == "Engine":
        from radixserve.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)
