"""The tensor maths of ToMA, with no diffusers import.

``tiling`` cuts a token grid into tiles, ``selection`` picks destinations inside them,
``merge`` holds the merge and unmerge operators, and ``plan`` ties these together into
reusable merge plans.
"""
