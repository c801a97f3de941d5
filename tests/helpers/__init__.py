"""Helpers shared by the test suite (on ``sys.path`` through ``pythonpath = ["tests"]``):
``common`` (small nets, output-folder bytes, one thread, the resnet34 FX reference), ``lm`` (small
random-weight language models, a local tokenizer, generate's final-sequence inputs), ``dist``
(gloo ranks on loopback), ``trainers`` (the Hugging Face Trainer as the trainer tests run it),
``saved_ref`` (a ``saved_tensors_hooks`` reference count), ``patch_refs`` (activation patching by
hand), ``faults`` (models with single-module faults, for ``hs.compare``), ``zoo`` (building the
model zoo cheaply)."""
