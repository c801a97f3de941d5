"""Helpers shared by the test suite (on ``sys.path`` through ``pythonpath = ["tests"]``):
``lm`` (small random-weight language models, a local tokenizer), ``dist`` (gloo ranks on
loopback), ``saved_ref`` (a ``saved_tensors_hooks`` reference count), ``zoo`` (building the
model zoo cheaply), ``trainers`` (the Hugging Face Trainer as the trainer tests run it)."""
