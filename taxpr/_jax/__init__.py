"""The JAX adapter layer: what taxpr needs of JAX beyond its public API.

``flags``: the switches taxpr sets while JAX traces (trace-context flags
and the partial-evaluation scopes), in one module. The version adapters
(``taxpr._compat``) and jaxpr building (``taxpr._jaxpr``) belong to this
layer too. Nothing here imports another taxpr layer.
"""
