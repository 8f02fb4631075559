"""Helpers shared by the optimizations: model structure, metrics, meta-model recording, tensor parallelism.

Import the submodules directly (e.g. `from atorch.utils.manual_tp_utils import TPInfo`); this
package imports nothing, so importing one helper never pulls in the others.
"""
