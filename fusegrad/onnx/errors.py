"""The exceptions of the ONNX front end: every one says which file, input or node is at fault and why."""


class OnnxError(Exception):
    """Base of every error the ONNX runner raises."""


class OnnxLoadError(OnnxError):
    """The model can't be read: a missing, truncated or corrupt file, or a graph that is not well formed."""


class OnnxInputError(OnnxError, ValueError):
    """The inputs given to a run don't match the graph's inputs (name, dtype or shape)."""


class OnnxNodeError(OnnxError):
    """A node failed: bad attributes or inputs for its op. Names the node and its op type."""

    def __init__(self, node_name: str, op_type: str, message: str):
        self.node_name, self.op_type = node_name, op_type
        super().__init__(f"node {node_name!r} ({op_type}): {message}")


class OnnxUnsupportedError(OnnxNodeError, NotImplementedError):
    """The node uses an op, an attribute or an attribute value that this runner doesn't implement."""


class Unsupported(Exception):
    """An attribute value, input or dtype this runner doesn't implement, raised inside an op (the runner turns it into
    an OnnxUnsupportedError naming the node)."""
