"""`dllm.likelihood`, the ELBO's public name from before the rooms split (#33), kept: this name is the module
`dllm.engine.likelihood` itself (`elbo`, `is_greedy`, ...)."""
import sys

from .engine import likelihood

sys.modules[__name__] = likelihood
