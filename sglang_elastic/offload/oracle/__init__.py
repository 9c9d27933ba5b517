"""The accuracy oracle of the KV offload policy on a real pretrained model
(SmolLM2-135M-Instruct, converted by ``scripts/offload/convert_smollm2.py``):

- :mod:`.tasks`: RULER-style retrieval tasks on a Shakespeare haystack and
  natural-text windows, as token ids;
- :mod:`.reference`: a float32/float64 CPU forward whose decode steps attend as
  :func:`sglang_elastic.offload.policy.attend_reference` says, beside dense;
- :mod:`.score`: the accuracy rows (``{task, context, samples, dense, offload,
  kept, kl, budget_frac}``) and the acceptance gate;
- ``python -m sglang_elastic.offload.oracle``: the sweep, to a JSON file.

``scripts/gpu/offload_accuracy.py`` runs the same tasks through SGLang servers.
"""
