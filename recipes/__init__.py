"""TorchTitan glue for UniEP: train specs, the [uniep] config section, CPU shims, data.

The only package that imports torchtitan; ``uniep`` itself never does.
"""
