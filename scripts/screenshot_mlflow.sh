#!/usr/bin/env bash
# Screenshots of what a reviewer sees of trtspec's evals in the MLflow UI, taken with headless
# Chromium: the experiment's runs table, the newest eval run's speedup-vs-concurrency chart
# (the metric page, x = step = concurrency), and that run's page (its dataset inputs).
#
#   scripts/screenshot_mlflow.sh STORE_URI OUT_DIR [EXPERIMENT]
#
# STORE_URI: the backend store the evals were logged to (sqlite:////abs/mlflow.db, …).
# Starts `mlflow server` on a free port against it (artifacts served from ./mlartifacts under
# OUT_DIR unless the runs name their own), and stops it when done. Needs `chromium` (Debian's
# package). MLFLOW (the mlflow executable) and PYTHON default to the repo's .venv.
set -euo pipefail

if [ $# -lt 2 ]; then
  echo "usage: $0 STORE_URI OUT_DIR [EXPERIMENT]" >&2
  exit 2
fi
store=$1
out=$2
experiment=${3:-}
here=$(cd "$(dirname "$0")/.." && pwd)
mlflow=${MLFLOW:-$here/.venv/bin/mlflow}
python=${PYTHON:-$here/.venv/bin/python}
browser=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}
if [ -z "$browser" ]; then
  echo "error: no chromium here (apt-get install chromium)" >&2
  exit 2
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
port=$("$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
url="http://127.0.0.1:$port"

setsid "$mlflow" server --backend-store-uri "$store" --artifacts-destination "$out/mlartifacts" \
  --host 127.0.0.1 --port "$port" --workers 1 >"$out/mlflow-server.log" 2>&1 &
server=$!
stop() { kill -TERM -- "-$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; }
trap stop EXIT

for _ in $(seq 240); do
  curl -fsS "$url/health" >/dev/null 2>&1 && break
  kill -0 "$server" 2>/dev/null || { echo "error: mlflow server exited:" >&2; tail -5 "$out/mlflow-server.log" >&2; exit 2; }
  sleep 0.5
done

# the pages: the experiment (named, or the newest eval's), its newest eval run, a speedup metric
pages=$("$python" - "$url" "$experiment" <<'PY'
import json, sys, urllib.parse
from mlflow.tracking import MlflowClient

url, name = sys.argv[1], sys.argv[2]
client = MlflowClient(tracking_uri=url)
experiments = [client.get_experiment_by_name(name)] if name else client.search_experiments()
runs = [r for e in experiments if e for r in client.search_runs(
    [e.experiment_id], "tags.`trtspec.level` = 'eval'", order_by=["attributes.start_time DESC"])]
if not runs:
    sys.exit("no trtspec eval run in this store")
run = max(runs, key=lambda r: r.info.start_time)
eid, rid = run.info.experiment_id, run.info.run_id
keys = sorted(k for k in run.data.metrics if k.startswith("speedup/"))
if not keys:
    sys.exit(f"run {rid} has no speedup/<method>_D<d> metrics (logged by an older trtspec?)")
q = lambda v: urllib.parse.quote(json.dumps(v))
metric = (f"{url}/#/metric?runs={q([rid])}&metric={q(keys[0])}&experiments={q([eid])}"
          f"&plot_metric_keys={q(keys)}&plot_layout={q({})}&x_axis=step&y_axis_scale=linear"
          f"&line_smoothness=1&show_point=true&deselected_curves={q([])}"
          f"&last_linear_y_axis_range={q([])}")
print(f"runs-table {url}/#/experiments/{eid}/runs")
print(f"speedup-vs-concurrency {metric}")
print(f"run-datasets {url}/#/experiments/{eid}/runs/{rid}")
print(f"run-charts {url}/#/experiments/{eid}/runs/{rid}/model-metrics")
PY
)

profile=$(mktemp -d)
while read -r name page; do
  "$browser" --headless=new --no-sandbox --disable-gpu --hide-scrollbars \
    --user-data-dir="$profile" --window-size=1600,1000 --virtual-time-budget=15000 \
    --screenshot="$out/$name.png" "$page" >/dev/null 2>&1 || true
  if [ -s "$out/$name.png" ]; then echo "$out/$name.png  ($page)"; else echo "error: no screenshot of $page" >&2; fi
done <<<"$pages"
rm -rf "$profile"
