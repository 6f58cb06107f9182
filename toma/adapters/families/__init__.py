"""The model families on the engine, one module each.

A family module declares ``SPEC`` (:class:`toma.adapters.spec.FamilySpec`) and, where data
cannot say it all, ``QUIRKS`` (:class:`toma.adapters.spec.Quirks`); the registry
(:mod:`toma.adapters`) builds the engine's adapter from them. A family imports the spec,
the shared grid readers (:mod:`toma.adapters.grids`) and attention's bias forms, never the
engine or its state; a family derived from another imports only that family's ``SPEC``
(``tests/test_imports.py`` holds both rules). Nothing here is imported until a model of
the family is patched.
"""
