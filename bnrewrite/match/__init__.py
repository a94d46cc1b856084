"""Matching: find batch-norm sites, the live work and the towers, and line the layers up
across towers; what a scan found (`census`). It reads graphs, never edits them.

May import: bnrewrite.graph, bnrewrite.errors.
"""
