"""The TF-free core: graph model data, strategies, planning and simulation.

Nothing below this folder imports TensorFlow.
"""
