"""refit: move a trainer's fresh weights into live rollout engines, through one checked state machine.

`from refit import protocol; result = protocol.run(ctx)` drives a whole refit. Importing `refit`
stays light: torch, ray, sglang and megatron are imported only by the drivers that need them.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
