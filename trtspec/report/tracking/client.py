"""Where MLflow is: the tracking URI every command logs to, and a fast check that a server
answers before a run starts logging to it. Apart from the eval sync (``tracking``) because
approve and distill need where MLflow is, not how an eval is logged."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

DEFAULT_URI = "sqlite:///mlflow.db"


class TrackingUnavailable(RuntimeError):
    """The tracking server cannot be reached or refused a call (the eval's files are intact)."""


def tracking_uri(explicit: str | None = None) -> str:
    """The store to log to: ``explicit``, else $MLFLOW_TRACKING_URI, else ./mlflow.db. A local
    store given relative to the working directory is made absolute, so the URI printed (and
    kept in the receipt) names the same store from any folder."""
    return absolute_uri(explicit or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI)


def absolute_uri(uri: str) -> str:
    """``sqlite:///mlflow.db`` → ``sqlite:////abs/mlflow.db``, ``file:mlruns`` or ``mlruns`` →
    ``file:///abs/mlruns``; servers and absolute paths unchanged."""
    if uri.startswith("sqlite:///"):
        path, sep, query = uri.removeprefix("sqlite:///").partition("?")
        if path and not path.startswith("/") and path != ":memory:":
            return f"sqlite:///{os.path.abspath(path)}{sep}{query}"
        return uri
    if uri.startswith("file:") and not uri.startswith("file://"):
        return Path(os.path.abspath(uri.removeprefix("file:"))).as_uri()
    if "://" not in uri and ":" not in uri.partition("/")[0]:  # a bare folder: a file store
        return Path(os.path.abspath(uri)).as_uri()
    return uri


def check_reachable(uri: str, timeout: float = 3.0) -> None:
    """Fail fast (instead of MLflow's minutes of retries) when an HTTP server is down."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout) as r:
            if r.status != 200:
                raise TrackingUnavailable(f"MLflow at {uri} answered {r.status}")
    except OSError as e:
        raise TrackingUnavailable(f"MLflow at {uri} is unreachable ({e})") from None
