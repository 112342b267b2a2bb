"""`trtspec serve`: the OpenAI-compatible server on the scheduler.

``server`` is the FastAPI app and the step thread that owns the models; ``openai_api`` the
request schemas, error bodies and incremental text; ``metrics`` the Prometheus metrics, named
like vLLM's so its dashboards carry over.
"""
