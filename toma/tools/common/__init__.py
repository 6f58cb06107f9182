"""What several ``toma`` commands share: their options, pipelines, images and report helpers.

Kept out of the commands so that one command using a helper does not import another
command for it (these lived in ``generate.py`` and ``bench_report.py`` before). Nothing here
imports torch at module level: the parsers are built from it for ``--help``.
"""
