#!/usr/bin/env bash
# Routing quality goals (issue 17): every workload of BENCHMARKS.md §10, every policy, three
# router seeds each, in sim mode; prints each workload's spread table and the default strategy's
# goal verdicts, and writes one JSON file per workload into $OUT (default quality-results/).
#
#   scripts/quality.sh                 # all workloads
#   ONLY=gsp4 scripts/quality.sh       # one of them (names below)
#   SEEDS=5 scripts/quality.sh         # more router seeds
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS=${SEEDS:-3}
OUT=${OUT:-quality-results}
TRACE=traces/mooncake_conversation_trace.jsonl
mkdir -p "$OUT"
go build -o llmbench-bin ./cmd/llmbench

declare -A W=(
	[gsp64]="--workload gsp --replicas 8"
	[gsp8]="--workload gsp --replicas 8 --gsp-groups 8 --gsp-prompts-per-group 128"
	[gsp4]="--workload gsp --replicas 8 --gsp-groups 4 --gsp-prompts-per-group 256"
	[mrqa]="--workload mrqa --replicas 8"
	[lora]="--workload lora --replicas 8"
	[noprefix]="--workload noprefix --replicas 8"
	[conv8]="--workload $TRACE --replicas 8 --kv-blocks 32768"
	[conv8x4]="--workload $TRACE --replicas 8 --kv-blocks 32768 --speed 4"
	[conv32]="--workload $TRACE --replicas 32 --kv-blocks 32768"
	[conv32x4]="--workload $TRACE --replicas 32 --kv-blocks 32768 --speed 4"
)
ORDER="gsp64 gsp8 gsp4 mrqa lora noprefix conv8 conv8x4 conv32 conv32x4"
missed=0
for name in ${ONLY:-$ORDER}; do
	args=${W[$name]:?unknown workload $name}
	echo "## $name: llmbench-bin --mode sim $args --router-seeds $SEEDS"
	# shellcheck disable=SC2086
	out=$(./llmbench-bin --mode sim $args --router-seeds "$SEEDS" --progress=false --json "$OUT/$name.json" 2>/dev/null)
	echo "$out"
	echo
	missed=$((missed + $(grep -c MISSED <<<"$out" || true)))
done
echo "goals missed: $missed"
