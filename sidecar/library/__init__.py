"""The conversation library: snapshots indexed by their token content, and the decisions over them."""
