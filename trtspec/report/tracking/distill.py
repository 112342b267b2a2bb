"""A distill run in MLflow: the loss curve, held-out agreement and AL per epoch, and the heads
(in their own experiment, so training runs never mix with the evals a reviewer compares)."""

from __future__ import annotations

import time
from typing import Any

from trtspec.report.tracking.client import TrackingUnavailable, check_reachable, tracking_uri
from trtspec.report.tracking.views import EXPERIMENT_KIND

MAX_ARTIFACT = 50 << 20  # weights larger than this stay out of MLflow


def log_distill(result: Any, uri: str | None = None,
                experiment: str | None = None) -> str:
    """One MLflow run for a distill: params, the step-wise loss, held-out agreement and AL per
    epoch, and the output folder (weights only when ≤ 50 MB). Returns the run id; raises
    TrackingUnavailable when the store fails (the heads are already on disk)."""
    from mlflow.entities import Metric, Param
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    uri = tracking_uri(uri)
    check_reachable(uri)
    info = result.info
    name = experiment or f"trtspec-distill-{info.get('recipe') or 'model'}"
    try:
        client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(name)
        experiment_id = found.experiment_id if found else client.create_experiment(name)
        if not (found and EXPERIMENT_KIND[0] in found.tags):
            client.set_experiment_tag(experiment_id, *EXPERIMENT_KIND)
        run = client.create_run(experiment_id, run_name=f"{result.method} {result.out.name}",
                                tags={"trtspec.level": "distill", "method": result.method})
        run_id = run.info.run_id
        config = info["config"]
        params = {"method": result.method, "target": info["target"], "prompts": info["prompts"],
                  "sequences": result.sequences, "tokens": result.tokens,
                  "epochs": result.epochs, "lr": config["lr"], "draft_vocab": result.draft_vocab,
                  "temperature": info["temperature"], "stopped": result.stopped,
                  **{k: config[k] for k in ("max_new_tokens", "max_len", "top_k", "num_heads",
                                            "head_layers", "shared_head", "batch_tokens")}}
        stamp = int(time.time() * 1000)
        metrics = [Metric("train/loss", v, stamp, s) for s, v in result.loss_curve]
        for h in result.history:
            metrics += [Metric(f"heldout/agreement_{k + 1}", a, stamp, h["epoch"])
                        for k, a in enumerate(h["agreement"])]
            metrics += [Metric(f"heldout/{k}", v, stamp, h["epoch"]) for k, v in h.items()
                        if k.startswith("al_d")]
        client.log_batch(run_id, params=[Param(k, str(v)[:500]) for k, v in params.items()])
        for i in range(0, len(metrics), 1000):
            client.log_batch(run_id, metrics=metrics[i: i + 1000])
        files = [p for p in sorted(result.out.iterdir()) if p.is_file()]
        small = sum(p.stat().st_size for p in files) <= MAX_ARTIFACT
        for p in files:
            if small or p.suffix not in (".safetensors", ".pt", ".bin"):
                client.log_artifact(run_id, str(p), artifact_path="heads")
        client.set_terminated(run_id, "FINISHED")
    except (MlflowException, OSError) as e:
        cause = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise TrackingUnavailable(f"MLflow at {uri} failed: {cause}") from e
    return run_id
