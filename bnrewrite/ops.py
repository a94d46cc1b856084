"""Op-type names that several layers test for, kept below all of them (it imports nothing).

Matching (`match/`) and the function-library code (`functions.py`, which imports matching)
both need them; defining them here keeps every import pointing down the layers.
"""

IF_OPS = frozenset({"If", "StatelessIf"})
