"""The tools around the library: the ``toma`` command line (bench, generate, eval), the
peer baselines, full-size architecture configs, metrics and the built-in models.

Nothing here is imported by ``import toma``.
"""
