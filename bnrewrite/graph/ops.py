"""Op-type names that several layers test for, kept below all of them (it imports nothing).

Matching (`match/`) and the function-library code (`functions.py`, which imports matching)
both need them; defining them here keeps every import pointing down the layers.
"""

IF_OPS = frozenset({"If", "StatelessIf"})
#: Ops whose outputs bring a step's data in: input pipelines, and placeholders.
INPUT_PIPELINE_OPS = frozenset({
    "IteratorGetNext", "IteratorGetNextSync", "QueueDequeue", "QueueDequeueV2", "QueueDequeueMany",
    "QueueDequeueManyV2", "QueueDequeueUpTo", "QueueDequeueUpToV2",
})
DATA_SOURCE_OPS = INPUT_PIPELINE_OPS | frozenset({"Placeholder", "PlaceholderV2", "PlaceholderWithDefault"})
