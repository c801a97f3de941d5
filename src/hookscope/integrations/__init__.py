"""hookscope inside the trainers people use. Each module imports its host framework when it is
imported itself (never by ``import hookscope``):

- :mod:`hookscope.integrations.lightning`: ``HookscopeCallback`` for PyTorch Lightning;
- :mod:`hookscope.integrations.transformers`: ``HookscopeTrainerCallback`` for the Hugging Face
  ``Trainer``;
- Accelerate needs no module: call ``mon.step(optimizer)`` when ``accelerator.sync_gradients``
  (see :class:`hookscope.Monitor`).
"""

__all__: list[str] = []
