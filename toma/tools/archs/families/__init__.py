"""One module per arch family: its name, archs, published and tiny configs, the config keys
``--depth`` divides, the builder of one denoiser call's inputs and any quirks of its own.
:mod:`toma.tools.archs` finds every module here (those named ``_*`` excepted) and its
docstring lists what a module states. Torch loads inside the builders."""
