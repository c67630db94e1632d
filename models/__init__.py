"""Model families, one small package each: data (variants, known configs, sample inputs) and real quirks only.

Installed as `nndf.models`; the registry in `nndf.registry` maps family names to these packages.
"""
