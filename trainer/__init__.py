"""The trainer: the model, its data, the inner loop and the outer step (docs/design.md)."""

import logging

# torchao (the memory modes' optimizers; transformers imports it too when it builds a model) logs
# a warning for each CUDA-only kernel library a host cannot load and torch a deprecation per enum
# torchao registers: noise at every start, about nothing the node uses.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
