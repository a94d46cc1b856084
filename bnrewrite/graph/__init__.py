"""The graph model: a read-only index over a GraphDef's nodes (`index`), their order, edits
and assembly back into a GraphDef, static shapes, NodeDef building, names, op types, what
TensorFlow would reject (`opcheck`) and imports into C graphs.

Every other layer reads and writes graphs through it; it knows nothing of batch norm, towers
or sessions. May import: bnrewrite.errors (and TensorFlow's protobufs and C API).
"""
