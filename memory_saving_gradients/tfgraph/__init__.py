"""The TensorFlow room: reading a graph into the core's model, and rewriting it.
"""
