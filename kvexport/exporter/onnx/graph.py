"""Small edits of an ONNX graph (``onnx`` protobuf) that several rewrites share."""

from __future__ import annotations


def attribute(node, name: str, default):
    """The value of the node's attribute ``name``, or ``default`` where it has none."""
    from onnx import helper

    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def prune(graph) -> None:
    """Drop the nodes and initializers nothing reads any more (the graph is in topological order)."""
    live = {v.name for v in graph.output}
    kept = []
    for node in reversed(graph.node):
        if any(out in live for out in node.output):
            live.update(i for i in node.input if i)
            kept.append(node)
    initializers = [i for i in graph.initializer if i.name in live]
    del graph.node[:]
    graph.node.extend(reversed(kept))
    del graph.initializer[:]
    graph.initializer.extend(initializers)
