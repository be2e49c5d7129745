"""The demo: a small GPT (``model``), its text, the Python standard library's own source
(``corpus``), and a one-process AdamW-against-Gefen run (``python -m gefen_dist.demo.train``)."""
