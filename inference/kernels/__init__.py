"""CPU kernels the engine calls: the few-row linear (cpu_linear: bf16, and fp32 on AVX2; C++ source in csrc/) and
masked GQA attention (attention). They import nothing else from inference."""
