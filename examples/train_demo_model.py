"""Regenerate the weights of hookscope's built-in demo model (``src/hookscope/demo/demo_weights.pt``).

Deterministic: the same seed, thread count and torch version give the same file. Takes a few
minutes on two CPU cores::

    python examples/train_demo_model.py                 # writes src/hookscope/demo/demo_weights.pt
    python examples/train_demo_model.py --out w.pt --epochs 2 --per-epoch 1000   # a quick try

It trains :class:`hookscope.DemoNet` on freshly drawn :func:`hookscope.make_demo_dataset`
pictures (new ones every epoch), prints the accuracy on a fresh test set and writes the weights,
which :func:`hookscope.load_demo_model` reads with ``torch.load(..., weights_only=True)``.
"""

import sys

from hookscope.demo._model import _main

if __name__ == "__main__":
    sys.exit(_main(["train", *sys.argv[1:]]))
