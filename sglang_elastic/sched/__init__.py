"""The elastic KV pool inside SGLang's server: pool building and scheduler
hooks (:mod:`.hooks`), lend/reclaim decisions and vacating
(:mod:`.controller`), Prometheus metrics (:mod:`.metrics`)."""

from sglang_elastic.sched.controller import ElasticController

__all__ = ["ElasticController"]
