"""Evaluation on Ray: SGLang servers in placement groups, workloads timed on
the client side, result JSON, plots and tables, and the reserve advisor.

- :mod:`.config`: the experiment YAML (pydantic).
- :mod:`.launcher`: Ray placement groups and the per-server launcher actor.
- :mod:`.ray_entry`: ``launch_server --use-ray`` inside a reserved placement group.
- :mod:`.client`: streaming ``/generate`` with ``input_ids``; TTFT, ITL, decode-only time.
- :mod:`.experiments`: the runners (E1-E4).
- :mod:`.report`: plots and ``docs/eval.md`` tables from the committed JSON.
- :mod:`.advisor`: reserve, lendable bytes and a recommendation from SGLang's own sizing.
- :mod:`.standin`: a CPU stand-in for ``launch_server`` (tests, launcher dry runs).
"""
