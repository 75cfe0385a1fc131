#!/usr/bin/env bash
# Runs the commands of README.md and kvsim/README.md as written, from a fresh clone of this
# checkout, and the ./llmbench-bin lines of BENCHMARKS.md with --requests 40 appended (their full
# runs take minutes to hours; this checks that every flag, path and workload they name exists).
# It fails on the first command that fails. The long runs it skips are named at the end.
#
#   scripts/check-docs.sh            # clones into a temporary directory
#   KEEP=1 scripts/check-docs.sh     # keeps the clone and the logs
#
# Needs: go, git, curl, python3 (the README's examples use them), free ports 8080, 2019, 2020,
# 2021, 2022, 8081, 8082, 4222 and 9001-9004.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
log=$work/check-docs.log
pids=()
# bg starts a command in the background in a process group of its own, so
# that stop ends it with its children (go run leaves the built binary
# running when only it is killed).
bg() {
	step "$* &"
	setsid "$@" >>"$log" 2>&1 &
	pids+=($!)
}
stop() {
	for p in "${pids[@]}"; do kill -- "-$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	pids=()
}
cleanup() {
	stop
	if [[ -z ${KEEP:-} ]]; then rm -rf "$work"; else echo "kept $work"; fi
}
trap cleanup EXIT
step() { echo "== $*" | tee -a "$log"; }
run() { step "$*"; bash -c "$*" >>"$log" 2>&1 || { echo "FAILED: $*"; tail -20 "$log"; exit 1; }; }
expect() { # expect <pattern> <command>: the command's output must match the pattern
	step "$2   (expect /$1/)"
	out=$(bash -c "$2" 2>&1) || { echo "FAILED: $2"; echo "$out" | tail -20; exit 1; }
	echo "$out" >>"$log"
	grep -qE -- "$1" <<<"$out" || { echo "FAILED: no /$1/ in the output of: $2"; echo "$out" | tail -20; exit 1; }
}
wait_port() { for _ in $(seq 1200); do curl -s -o /dev/null "$1" && return 0; sleep 0.5; done; echo "FAILED: $1 never answered"; exit 1; }

git clone -q "$src" "$work/repo"
cd "$work/repo"

# README: the two commands (the tests are .ci/run's; run it separately), then "Try it".
bg go run ./cmd/caddy run --config caddyfile-examples/quickstart.Caddyfile
wait_port localhost:8080/v1/models
SYS=$(python3 -c "print('You are a helpful assistant for the ACME support desk. ' * 150)")
M=meta-llama/Llama-3.1-8B-Instruct
export SYS M
expect 'reason=cold' 'curl -s -D - -o /dev/null localhost:8080/v1/chat/completions -H "Content-Type: application/json" -d "{\"model\":\"$M\",\"max_tokens\":16,\"messages\":[{\"role\":\"system\",\"content\":\"$SYS\"},{\"role\":\"user\",\"content\":\"My order is late.\"}]}" | grep -iE "x-kvsim|x-llm"'
expect 'reason=warm' 'curl -s localhost:8080/v1/chat/completions -H "Content-Type: application/json" -d "{\"model\":\"$M\",\"max_tokens\":16,\"messages\":[{\"role\":\"system\",\"content\":\"$SYS\"},{\"role\":\"user\",\"content\":\"My order is late.\"},{\"role\":\"assistant\",\"content\":\"Sorry to hear that.\"},{\"role\":\"user\",\"content\":\"Order 1234.\"}]}" -D - | grep -iE "x-kvsim|x-llm|cached_tokens"'
run "python3 -c \"
import json
p='You are a code reviewer. Follow the style guide. '*1300
for i in range(48):
    json.dump({'model':'meta-llama/Llama-3.1-8B-Instruct','prompt':p+' Review change %d: '%i+('diff line %d; '%i)*600,'max_tokens':200}, open('/tmp/hot%02d.json'%i,'w'))\""
expect 'warm' "ls /tmp/hot*.json | xargs -P 48 -I{} curl -s -o /dev/null -D - localhost:8080/v1/completions -H 'Content-Type: application/json' -d @{} | grep -i x-llm-affinity | sed 's/.*upstream=\([^;]*\); reason=\([a-z]*\).*/\1 \2/' | sort | uniq -c"
# The Responses API: previous_response_id stays where the response was stored (three
# conversations: a router that did not pin them would pass only by a 1-in-64 chance).
for q in "My order is late." "My parcel is lost." "My bill is wrong."; do
	export Q="$q"
	run 'curl -s localhost:8080/v1/responses -H "Content-Type: application/json" -D /tmp/resp1.headers -o /tmp/resp1.json -d "{\"model\":\"$M\",\"instructions\":\"$SYS\",\"input\":\"$Q\",\"max_output_tokens\":8}"'
	REPLICA=$(grep -i x-kvsim-replica /tmp/resp1.headers | tr -d '\r' | awk '{print $2}')
	R=$(python3 -c 'import json; print(json.load(open("/tmp/resp1.json"))["id"])')
	export R
	expect "X-Kvsim-Replica: $REPLICA" 'curl -s -o /dev/null -D - localhost:8080/v1/responses -H "Content-Type: application/json" -d "{\"model\":\"$M\",\"previous_response_id\":\"$R\",\"input\":\"Order 1234.\",\"max_output_tokens\":8}" | grep -iE "x-kvsim|x-llm"'
done
expect '"dial":"127.0.0.1:9004"' 'curl -s localhost:2019/llm_affinity/upstreams'
expect 'caddy_llm_affinity_time_to_first_token_seconds_count\{reason="[a-z]+",upstream="127.0.0.1:900[1-4]"\}' "curl -s localhost:2019/metrics | grep -E '^caddy_llm_affinity_time_to_first_token_seconds_count'"
expect '<html' 'curl -s localhost:2020/llm_affinity/'
run "sed 's|\t\tlb_policy llm_affinity {|\t\tlb_policy llm_affinity {\n\t\t\tdrain 127.0.0.1:9004|' caddyfile-examples/quickstart.Caddyfile > /tmp/drained.Caddyfile"
run "curl -sf localhost:2019/load -H 'Content-Type: text/caddyfile' --data-binary @/tmp/drained.Caddyfile"
expect '"drain_cause":"config"' "curl -s localhost:2019/llm_affinity/upstreams | grep -o '\"dial\":\"127.0.0.1:9004\"\|\"drain\":\"[a-z]*\"\|\"drain_cause\":\"[a-z]*\"'"
run "curl -sf localhost:2019/load -H 'Content-Type: text/caddyfile' --data-binary @caddyfile-examples/quickstart.Caddyfile"
# Draining through the admin API.
run "curl -sf -X POST 'localhost:2019/llm_affinity/upstreams/127.0.0.1:9001/drain?deadline=30s'"
expect '"drain":"(draining|drained)"' 'curl -s localhost:2019/llm_affinity/upstreams'
run "curl -sf -X DELETE localhost:2019/llm_affinity/upstreams/127.0.0.1:9001/drain"
stop

# README: building.
run "go build -o caddy ./cmd/caddy"
expect 'llm_affinity' "./caddy list-modules | grep -E 'llm_affinity|kvsim'"
run "go run ./cmd/build -print"

# README: several routers (the cluster example).
bg go run github.com/nats-io/nats-server/v2@v2.15.2 -a 127.0.0.1 -p 4222
bg go run ./cmd/kvsim --replicas 4 --listen 127.0.0.1:9001
wait_port localhost:9001/v1/models
bg env ROUTER=router-1 PORT=8081 ADMIN=localhost:2021 STATUS=2031 ./caddy run --config caddyfile-examples/cluster.Caddyfile
bg env ROUTER=router-2 PORT=8082 ADMIN=localhost:2022 STATUS=2032 ./caddy run --config caddyfile-examples/cluster.Caddyfile
wait_port localhost:2021/config/
wait_port localhost:2022/config/
for _ in $(seq 100); do curl -s localhost:2021/llm_affinity/sync | grep -q '"connected":true' && break; sleep 0.2; done
expect '"connected":true' 'curl -s localhost:2021/llm_affinity/sync'
expect '<html' 'curl -s localhost:2031/llm_affinity/'
expect '<html' 'curl -s localhost:2032/llm_affinity/'
stop

# kvsim/README.md.
bg go run ./cmd/kvsim --replicas 2 --listen 127.0.0.1:9001 --speed 10
wait_port localhost:9001/v1/models
expect '"usage"' "curl -s localhost:9001/v1/completions -H 'Content-Type: application/json' -d '{\"model\":\"meta-llama/Llama-3.1-8B-Instruct\",\"prompt\":\"Hello there\",\"max_tokens\":8}'"
expect 'Llama-3.1-8B-Instruct' 'curl -s localhost:9001/v1/models'
expect 'vllm:num_requests_running' "curl -s 'localhost:9001/metrics/?name[]=vllm:num_requests_running&name[]=vllm:kv_cache_usage_perc'"
run 'curl -sf localhost:9001/kvsim/state'
run 'go run ./cmd/kvsim --help'
run "curl -sf -X POST localhost:9001/kvsim/faults -d '{\"unhealthy\":true}'"
expect '^503' "curl -s -o /dev/null -w '%{http_code}\n' localhost:9001/health"
run "curl -sf -X POST localhost:9001/kvsim/faults -d '{\"unhealthy\":false}'"
stop

# README: benchmarks and llmbench.
run "go test -run '^\$' -bench 'XXH3Raw|HashBlocks|HandlerParse|Decision|Select\$|ResponseUsage' -benchmem -count 1 ./prefixindex/ ./caddyllm/"
run "go test -v -run TestMemoryPerEntry ./prefixindex/"
run "go run ./cmd/llmbench --mode sim --workload gsp --replicas 8 --json out.json"
run "go run ./cmd/llmbench --mode sim --workload traces/mooncake_conversation_trace.jsonl --replicas 8 --kv-blocks 32768 --requests 200"
run "go run ./cmd/llmbench --mode sim --workload gsp --replicas 8 --routers 4 --sync on --sync-delay 1ms"
run "go run ./cmd/llmbench --mode http --workload gsp --replicas 4 --requests 300 --rate 32"
run "go run ./cmd/llmbench --help"
run "ROUNDS=1 DURATION=3s scripts/overhead.sh"

# BENCHMARKS.md: every ./llmbench-bin line, cut to 40 requests.
run "go build -o llmbench-bin ./cmd/llmbench"
# The variables the sections set before their loops, at one of their values.
export TRACE=traces/mooncake_conversation_trace.jsonl P=llm_affinity/ttft,round_robin R=2 s=1
export W="--workload gsp --replicas 4 --requests 40"
export WL=gsp RESTART="--restart-router-at 300ms --restart-snapshot on"
grep -oE '^\s*\./llmbench-bin [^#]*' BENCHMARKS.md | sed 's/\\$//' | sort -u | while read -r line; do
	line=${line//--speed \$S/--speed 2}
	line=${line//--sync \$S/--sync on}
	run "$line --requests 40 --progress=false"
done

echo "all documented commands ran; skipped as too long here: the full BENCHMARKS.md runs, scripts/quality.sh, xcaddy's full build (go run ./cmd/build -o caddy), scripts/overhead.sh with its default rounds"
