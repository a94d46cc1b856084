"""Models on disk: GraphDef (.pb, .pbtxt), MetaGraphDef (.meta) and SavedModel directories.

Protocol buffers are parsed and written only in this package:

- `model`: the in-memory model (Model, Entry) and what a rewrite did to it (Rewrite, Outcome)
- `sniff`: telling the format from the content, and naming what is not a model
- `load`: reading a model (path checks first, no TensorFlow needed for them) and validating it
- `convert`: rewriting a model MetaGraph by MetaGraph (--tags), signatures kept resolving
- `save`: output formats, serialising, staging a SavedModel directory
- `staging`: what may be replaced, and all-or-nothing writes (staged beside the targets, committed with rollback)
- `verify`: TensorFlow's import of a graph (in C++ for every graph rewritten; --verify as a user imports it)
- `step`: the training step `bnrewrite verify` runs with the step check
- `visualize`: Graphviz pictures of a layer before/after, TensorBoard runs, `diff`'s node diff

May import: bnrewrite.session (the step check), bnrewrite.rewrite, bnrewrite.match,
bnrewrite.graph, bnrewrite.errors.
"""

from bnrewrite.io.convert import located, meta_references, nothing_rewritten, parse_tags, rewrite, select
from bnrewrite.io.load import check_input, load, make_model, validate
from bnrewrite.io.model import DESCRIPTIONS, FORMATS, Entry, Model, Outcome, Rewrite
from bnrewrite.io.save import as_format, model_tree, output_entries, serialize, stage_model
from bnrewrite.io.sniff import parse_bytes
from bnrewrite.io.staging import FILE, LOGDIR, SAVED_MODEL, Outputs, check_output, clear_leftovers, same_or_nested
from bnrewrite.io.verify import import_check, verify

__all__ = [
    "DESCRIPTIONS", "FILE", "FORMATS", "LOGDIR", "SAVED_MODEL", "Entry", "Model", "Outcome", "Outputs", "Rewrite",
    "as_format", "check_input", "check_output", "clear_leftovers", "import_check", "load", "located", "make_model", "meta_references",
    "model_tree", "nothing_rewritten", "output_entries", "parse_bytes", "parse_tags", "rewrite", "same_or_nested",
    "select", "serialize", "stage_model", "validate", "verify",
]
