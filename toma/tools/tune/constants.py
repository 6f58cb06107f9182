"""The constants of ``toma tune`` that both its parser and its measuring read.

A leaf, torch-free module: the package's ``register`` (for ``--help``) and
:mod:`toma.tools.tune.run` both import it, and neither imports the other for it, which
was the circle when the bound lived in the parser's module.
"""

from __future__ import annotations

DEFAULT_MIN_PSNR = 30.0  # dB against unpatched, unless --max-psnr-drop is given
