"""
Look at shapes: ``trace`` and ``summary``
=========================================

Two ways to see what a model does with its input, layer by layer, without editing it:

* :func:`hookscope.trace` prints every call as it happens (and keeps them as
  :class:`~hookscope.TraceEvent` records);
* :func:`hookscope.summary` runs the model once and returns a table: shapes, parameters,
  FLOPs, time and memory per call, with totals.

We use the demo CNN that ships with hookscope: it tells circles, squares, triangles and
crosses apart in 64×64 pictures.
"""

# %%
import torch
import torch.nn as nn

import hookscope as hs

model = hs.load_demo_model()
data = hs.make_demo_dataset(8, seed=1)
x = data.images[:2]
print(model.classes, tuple(x.shape))

# %%
# Find layers
# -----------
# Every ``layers=`` argument in hookscope takes the same selectors: exact dotted names, globs
# (``*`` spans dots), module classes, instances or predicates. :func:`hookscope.find` shows what
# a selector picks; a typo raises an error listing the closest names.
print(list(hs.find(model, "stage2.*", nn.Linear)))
try:
    hs.find(model, "stage4")
except hs.LayerNotFoundError as e:
    print(e)

# %%
# Trace every call
# ----------------
# A header, then one line per call in the order the calls *started*, so a container comes
# before its children: name (indented by depth), call index, type, the call's inclusive time,
# dtype, device, input and output shapes. A line appears as soon as its call (and every call
# started before it) has returned.
with hs.trace(model) as tr:
    model(x)

# %%
# The same information is kept as data:
ev = tr.events[1]
print(ev.layer, ev.type, ev.input_shapes, ev.output_shapes)

# %%
# Trace only some layers; globs work here too.
with hs.trace(model, "stage3.*"):
    model(x)

# %%
# The summary table
# -----------------
# ``params`` and ``time`` of a container *include* its children; ``flops`` are those of the
# operators the call ran itself, so the rows add up to the total (a container that only calls
# children shows ``--``). The legend under the table says which column is which.
s = hs.summary(model, x)
print(s)

# %%
# Fold the deeper rows into their stage with ``depth=1`` (the totals stay the same):
print(hs.summary(model, x, depth=1))

# %%
# Rows and totals as data:
row = s.rows[1]
print(row.label, row.type, row.input_shapes, row.output_shapes, row.params, row.flops)
print(s.totals.params, s.totals.flops)

# %%
# Keyword inputs and nested outputs
# ---------------------------------
# ``summary`` passes every keyword it does not know to the model, and describes nested outputs
# (tuples, dicts, dataclasses, Hugging Face ``ModelOutput``). Here a transformer encoder layer
# with a padding mask given by keyword:
layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
tokens = torch.randn(2, 10, 32)
mask = torch.zeros(2, 10, dtype=torch.bool)
print(hs.summary(layer.eval(), tokens, src_key_padding_mask=mask, depth=1))
