"""`--verify`: import every rewritten graph into TensorFlow (never run it) before anything is written."""

from __future__ import annotations

from bnrewrite.errors import InputFormatError, PassError
from bnrewrite.io.model import Entry, Rewrite, one_line


def import_check(entry: Entry) -> str | None:
    """Import the entry into a fresh tf.Graph (a MetaGraph with its collections); the error or None."""
    import tensorflow as tf

    try:
        with tf.Graph().as_default():
            if entry.meta_graph is not None:
                tf.compat.v1.train.import_meta_graph(entry.meta_graph, clear_devices=False)
            else:
                tf.compat.v1.import_graph_def(entry.graph_def, name="")
    except Exception as exc:  # noqa: BLE001 - TensorFlow raises many kinds; all mean "does not import"
        return one_line(str(exc)) or type(exc).__name__
    return None


def verify(rewrite: Rewrite) -> int:
    """Import every rewritten graph into TensorFlow. Raises PassError when one does not import
    (or InputFormatError when the input graph itself does not). Returns how many were checked."""
    checked = 0
    for outcome in rewrite.outcomes:
        if outcome.result is None:
            continue
        error = import_check(outcome.result)
        if error is not None:
            where = f"MetaGraph {outcome.entry.label}: " if outcome.entry.tags is not None else ""
            own = import_check(outcome.entry)
            if own is not None:
                raise InputFormatError(
                    f"{where}the rewritten graph does not import into TensorFlow, and neither does the input graph "
                    f"itself ({own}); fix or re-export the input"
                )
            raise PassError(f"{where}the rewritten graph does not import into TensorFlow ({error}); nothing was written (a bnrewrite bug: please report it)")
        checked += 1
    return checked
