"""ml_collections configs: ``default`` (the demo, and every field's default), ``paper`` (the paper's
setups), ``eval`` (pass@k evaluation).

Importable (``from configs import paper; paper.get_config("qwen25_7b,pacs_beta1")``) and loadable by
path as ``--config=configs/paper.py:qwen25_7b,pacs_beta1``.
"""
