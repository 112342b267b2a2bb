#!/usr/bin/env bash
# Render an eval's report.html in headless Chromium: scripts/screenshot_report.sh reports/<eval-id> [out.png]
# Checks that the self-contained report (inline CSS, plots as data URIs) renders offline.
set -euo pipefail
dir=${1:?usage: $0 reports/<eval-id> [out.png]}
png=${2:-$dir/report.png}
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
[ -n "$browser" ] || { echo "error: no chromium / google-chrome on PATH" >&2; exit 2; }
html=$(cd "$dir" && pwd)/report.html
[ -f "$html" ] || { echo "error: $html not found: run \`trtspec decide $dir\` first" >&2; exit 2; }
timeout 120 "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars \
  --window-size=1200,4200 --screenshot="$png" "file://$html" >/dev/null 2>&1
[ -s "$png" ] || { echo "error: chromium wrote no screenshot" >&2; exit 1; }
echo "$png"
