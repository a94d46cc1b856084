"""The session layer: `enable()`, `rewrite_graph(g, in_place=True)` and TensorFlow's patched
session class, which runs a rewritten copy (a shadow) of the script's graph, moves a session
with its variables when the graph grows, bounds steps that meet all-reduces and checks the
first training step (`--verify`: `stepcheck`, `step_verdict`).

May import: bnrewrite.rewrite, bnrewrite.match, bnrewrite.graph, bnrewrite.errors.
"""
