"""The kernel registry and the implementations it chooses among.

Each op (a quantized matmul, paged attention, the fused MoE, RMSNorm, rotary, the gated activation,
a whole CPU decode layer) has implementation classes that state what they can run
(`can_implement(target, ...)`, from the facts known when a layer is built or its weights or cache
are set) and keep their own crossovers (row counts, split choices) inside. A layer asks
`ember.ops.registry` once and calls the implementation it got; adding a kernel is a class and a
line in the registry's table.

Layering: `ember.quant` (formats) < `ember.kernels`, `ember.cpu_native` < `ember.ops` <
`ember.model`.
"""
