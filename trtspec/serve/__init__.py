"""`trtspec serve`: the OpenAI-compatible server on the scheduler.

``server`` is the FastAPI app and the step thread that owns the models; ``intake`` what a
request must pass before any work is done for it (key, body size, prompt bounds, limits);
``openai_api`` the request schemas, error bodies and incremental text; ``metrics`` the
Prometheus metrics (named like vLLM's), vLLM-shaped per-request metrics and the access log.
"""
