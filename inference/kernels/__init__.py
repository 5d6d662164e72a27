"""CPU kernels the engine calls: the bf16 linear (cpu_linear, C++ source in csrc/) and masked GQA attention
(attention). They import nothing else from inference."""
