"""ml_collections configs: ``base`` (the schema, every field at a neutral default), ``algorithms`` (the
algorithm setups), and as overrides of ``base``: ``default`` (the demo), ``demo_objectives``, ``paper``
(the paper's setups), ``eval`` (pass@k evaluation).

Importable (``from configs import paper; paper.get_config("qwen25_7b,pacs_beta1")``) and loadable by
path as ``--config=configs/paper.py:qwen25_7b,pacs_beta1``.
"""
