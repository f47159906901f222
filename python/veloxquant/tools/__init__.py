"""What users run on top of the library: the command line (``veloxquant``),
the end-to-end and kernel benchmarks, the quality evaluation and comparison,
model loading and conversion, the demo and plots. The library itself
(caches, kernels, quantizers, attention) is the package above."""
