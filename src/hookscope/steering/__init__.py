"""Steering language models: add (or project out) a direction in a layer's output, at chosen token
positions, in plain forwards and in ``generate``; steering vectors from contrastive prompts."""

from ._steer import Steering, steer
from ._vector import steering_vector

__all__ = ["Steering", "steer", "steering_vector"]
