"""KV offload to host memory with selective prefetch, for dense GQA models
(InfiniGen-style, arXiv 2406.19707), in SGLang 0.5.17.

K of every token stays in the GPU's KV pool; V of every token of the sparse
layers lives in a pinned host pool; each request keeps a small hot buffer of
V rows on the GPU (sink, a recent window, and its most recently selected
rows). A decode step scores all of a request's K exactly, attends to the
sink, the window and the top-k rows (:mod:`.policy`), and copies the V rows
it misses from host memory on the GPU.
"""
