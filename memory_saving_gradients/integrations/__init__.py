"""The ways in: patching tf.gradients, and hooks into the frameworks users train with.
"""
