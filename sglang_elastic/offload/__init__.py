"""KV offload to host memory with selective prefetch, for dense GQA models
(InfiniGen-style, arXiv 2406.19707), in SGLang 0.5.17.

K of every token stays in the GPU's KV pool; V of every token of the sparse
layers lives in a pinned host pool; each request keeps a small hot buffer of
V rows on the GPU (sink, a recent window, and its most recently selected
rows). A decode step scores all of a request's K exactly, attends to the
sink, the window and the top-k rows (:mod:`.policy`), and copies the V rows
it misses from host memory on the GPU.
"""

NAME = "kvoffload"


def create_offload_backend(model_runner):
    """SGLang attention-registry factory for ``kvoffload`` (``ATTENTION_BACKENDS[NAME](model_runner)``)."""
    from sglang_elastic.offload.backend import OffloadAttnBackend

    return OffloadAttnBackend(model_runner)


def register() -> None:
    """Register ``kvoffload`` in SGLang's attention registry and ``--attention-backend`` choices (idempotent)."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if NAME not in ATTENTION_BACKENDS:
        register_attention_backend(NAME)(create_offload_backend)
    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])
