#!/usr/bin/env bash
# Measures what the llm_affinity router costs per request compared with plain Caddy.
#
# One Caddy (built from ./cmd/caddy) serves two sites in front of the same four trivial
# upstreams (scripts/trivial-upstream, which answer at once with a small JSON completion):
#   A  reverse_proxy with lb_policy round_robin
#   B  the llm_affinity handler + reverse_proxy with lb_policy llm_affinity
# A closed-loop Go load generator (scripts/loadgen) sends POST /v1/completions (or, with
# API=responses, /v1/responses) with a small JSON body to each, interleaved A B A B ..., and
# the script prints requests per second for
# each round and the ratio B/A of the means, and (on Linux) Caddy's CPU time per request for
# each, as means and as medians over the rounds, and its read and write system calls per request.
# Needs only Go.
#
#   scripts/overhead.sh
#   ROUNDS=3 DURATION=10s CONCURRENCY=32 scripts/overhead.sh
#
# Environment: ROUNDS (default 3), DURATION per measurement (10s), WARMUP (2s),
# CONCURRENCY (32), PROMPT_BYTES (512), BASE_PORT (18080: uses BASE_PORT..BASE_PORT+6),
# MIN_RATIO (unset; when set, exit 1 if the ratio is below it).
#
# STREAM_TOKENS=N (unset: not streamed) has every request stream its answer, as LLM clients
# mostly do: the upstream sends N one-token events, each flushed, then the usage and [DONE], so
# that the router's reading of each event is measured beside Caddy's copying of it.
# TOKEN_INTERVAL (a Go duration, e.g. 2ms; default none) has the upstream pace its token events
# as an engine does: each then reaches Caddy, and the router, in a read and a write of its own
# (without it Caddy reads several at once).
#
# API=responses (default: completions) sends the same prompt to POST /v1/responses as `input`
# (max_output_tokens, stream), and the upstream answers as vLLM's Responses API does (with
# STREAM_TOKENS, its typed events: N output_text.delta events between the ones that open and
# close the response).
#
# INSTRUCTIONS=1 runs Caddy under valgrind's callgrind and reports, for each site, the
# instructions Caddy executed per request (user space only: the kernel's share, its system calls,
# is reported beside as before). Unlike time, the count does not move with the neighbours' load,
# so one run settles what the router's own code costs; requests per second under valgrind mean
# nothing and are not compared. Use DURATION=20s or more: shorter runs spread fixed costs over
# fewer requests and count high. Needs valgrind (Debian's package).
set -euo pipefail

ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-10s}
WARMUP=${WARMUP:-2s}
CONCURRENCY=${CONCURRENCY:-32}
PROMPT_BYTES=${PROMPT_BYTES:-512}
BASE_PORT=${BASE_PORT:-18080}
MIN_RATIO=${MIN_RATIO:-}
INSTRUCTIONS=${INSTRUCTIONS:-}
STREAM_TOKENS=${STREAM_TOKENS:-}
API=${API:-completions}
case "$API" in
completions | responses) ;;
*)
	echo "API must be completions or responses, not $API" >&2
	exit 2
	;;
esac
if [ -n "$INSTRUCTIONS" ] && [ -n "$MIN_RATIO" ]; then
	echo "MIN_RATIO compares requests per second, which INSTRUCTIONS=1 does not measure" >&2
	exit 2
fi

cd "$(dirname "$0")/.."
work=$(mktemp -d)
pids=()
cleanup() {
	for pid in "${pids[@]}"; do
		kill "$pid" 2>/dev/null || true
	done
	for pid in "${pids[@]}"; do
		wait "$pid" 2>/dev/null || true
	done
	rm -rf "$work"
}
trap cleanup EXIT

rr_port=$((BASE_PORT + 1))
llm_port=$((BASE_PORT + 2))
up_ports=($((BASE_PORT + 3)) $((BASE_PORT + 4)) $((BASE_PORT + 5)) $((BASE_PORT + 6)))
upstreams=""
for p in "${up_ports[@]}"; do
	upstreams+="127.0.0.1:$p "
done
upstreams=${upstreams% }

# shellcheck source=scripts/bench-common.sh
. scripts/bench-common.sh
ports_free "$rr_port" "$llm_port" "${up_ports[@]}"
build_bench_tools "$work"

"$work/upstream" -addr "$(echo "$upstreams" | tr ' ' ',')" -chunks "${STREAM_TOKENS:-16}" -token-interval "${TOKEN_INTERVAL:-0}" 2>"$work/upstream.log" &
pids+=($!)

cat >"$work/Caddyfile" <<EOF
{
	admin off
	persist_config off
}

http://:$rr_port {
	reverse_proxy $upstreams {
		lb_policy round_robin
	}
}

http://:$llm_port {
	llm_affinity
	reverse_proxy $upstreams {
		lb_policy llm_affinity
	}
}
EOF
if [ -n "$INSTRUCTIONS" ]; then
	command -v valgrind >/dev/null || { echo "INSTRUCTIONS=1 needs valgrind (apt-get install valgrind)" >&2; exit 1; }
	# callgrind fails an assertion on the signals Go uses to preempt goroutines: turn them off.
	GODEBUG=asyncpreemptoff=1 valgrind --tool=callgrind --callgrind-out-file="$work/callgrind.out" \
		"$work/caddy" run --config "$work/Caddyfile" --adapter caddyfile >"$work/caddy.log" 2>&1 &
else
	"$work/caddy" run --config "$work/Caddyfile" --adapter caddyfile >"$work/caddy.log" 2>&1 &
fi
caddy_pid=$!
pids+=("$caddy_pid")

write_body "$work/body.json"

wait_for() {
	local url=$1
	# Caddy takes seconds to start under valgrind.
	for _ in $(seq 1 "$([ -n "$INSTRUCTIONS" ] && echo 1200 || echo 100)"); do
		if curl -fsS -o /dev/null -X POST -H 'Content-Type: application/json' \
			--data-binary @"$work/body.json" "$url" 2>/dev/null; then
			return 0
		fi
		sleep 0.1
	done
	echo "no answer from $url; caddy log:" >&2
	cat "$work/caddy.log" >&2
	return 1
}
# curl may be absent on a bare CI image: fall back to the load generator itself.
if command -v curl >/dev/null; then
	wait_for "http://127.0.0.1:$rr_port/v1/$API"
	wait_for "http://127.0.0.1:$llm_port/v1/$API"
else
	sleep 2
fi
# Another process on the ports would answer in Caddy's stead, and be measured.
if ! kill -0 "$caddy_pid" 2>/dev/null; then
	echo "caddy exited; its log:" >&2
	cat "$work/caddy.log" >&2
	exit 1
fi

# Caddy's CPU time in clock ticks (Linux), to report CPU per request beside throughput:
# on a shared machine req/s moves with the neighbours' load, CPU per request much less.
clk_tck=$(getconf CLK_TCK 2>/dev/null || echo 100)
caddy_cpu() {
	if [ -r "/proc/$caddy_pid/stat" ]; then
		awk '{ print $14 + $15 }' "/proc/$caddy_pid/stat"
	else
		echo 0
	fi
}
# Caddy's read and write system calls so far (Linux): unlike time, their count per request does
# not move with the neighbours' load.
caddy_syscalls() {
	if [ -r "/proc/$caddy_pid/io" ]; then
		awk '/^syscr:/ { r = $2 } /^syscw:/ { w = $2 } END { print r + 0, w + 0 }' "/proc/$caddy_pid/io"
	else
		echo - -
	fi
}
measure() { # measure PORT: prints loadgen's line plus caddy_cpu_us_per_req= and system calls per request
	local url="http://127.0.0.1:$1/v1/$API" line t0 t1 s0 s1
	"$work/loadgen" -url "$url" -body "$work/body.json" -c "$CONCURRENCY" -d "$WARMUP" -warmup 0 >/dev/null
	[ -z "$INSTRUCTIONS" ] || callgrind_control --zero "$caddy_pid" >/dev/null
	t0=$(caddy_cpu)
	s0=$(caddy_syscalls)
	line=$("$work/loadgen" -url "$url" -body "$work/body.json" -c "$CONCURRENCY" -d "$DURATION" -warmup 0)
	t1=$(caddy_cpu)
	s1=$(caddy_syscalls)
	local instructions=""
	if [ -n "$INSTRUCTIONS" ]; then
		instructions=" instructions_per_req=$(instructions_since_zero "$(field requests "$line")")"
	fi
	echo "$line caddy_cpu_us_per_req=$(awk -v d=$((t1 - t0)) -v hz="$clk_tck" -v n="$(field requests "$line")" \
		'BEGIN { printf "%.1f", (n > 0 ? d * 1e6 / hz / n : 0) }')" \
		"$(echo "$s0 $s1" | awk -v n="$(field requests "$line")" \
			'$1 != "-" && n > 0 { printf "reads_per_req=%.2f writes_per_req=%.2f", ($3 - $1) / n, ($4 - $2) / n }')$instructions"
}
# instructions_since_zero REQUESTS: dumps callgrind's counts since the last --zero and prints
# the instructions per request.
instructions_since_zero() {
	local before after dump
	before=$(ls "$work"/callgrind.out.* 2>/dev/null | wc -l)
	callgrind_control --dump "$caddy_pid" >/dev/null
	for _ in $(seq 1 600); do
		after=$(ls "$work"/callgrind.out.* 2>/dev/null | wc -l)
		[ "$after" -gt "$before" ] && break
		sleep 0.1
	done
	dump=$(ls -t "$work"/callgrind.out.* | head -1)
	awk -v n="$1" '/^(summary|totals):/ { if (n > 0) printf "%.0f", $2 / n; exit }' "$dump"
}
field() { # field NAME LINE
	echo "$2" | tr ' ' '\n' | sed -n "s/^$1=//p"
}

echo "go $(go env GOVERSION), $(nproc) CPUs, concurrency $CONCURRENCY, $DURATION per run, $ROUNDS rounds, POST /v1/$API, body $(wc -c <"$work/body.json") bytes${STREAM_TOKENS:+, streamed in $STREAM_TOKENS events}${TOKEN_INTERVAL:+, $TOKEN_INTERVAL apart}"
# Medians: one round disturbed by a neighbour moves a mean, not a median.
median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }
rr_all=()
llm_all=()
rr_cpu=()
llm_cpu=()
rr_ins=()
llm_ins=()
errors=0
for round in $(seq 1 "$ROUNDS"); do
	a=$(measure "$rr_port")
	echo "round $round  round_robin:  $a"
	b=$(measure "$llm_port")
	echo "round $round  llm_affinity: $b"
	rr_all+=("$(field rps "$a")")
	llm_all+=("$(field rps "$b")")
	rr_cpu+=("$(field caddy_cpu_us_per_req "$a")")
	llm_cpu+=("$(field caddy_cpu_us_per_req "$b")")
	errors=$((errors + $(field errors "$a") + $(field errors "$b")))
	rr_ins+=("$(field instructions_per_req "$a")")
	llm_ins+=("$(field instructions_per_req "$b")")
done
if [ -n "$INSTRUCTIONS" ]; then
	# Failed requests ran instructions too, and loadgen counts only the served: the count would
	# be too high.
	if [ "$errors" -gt 0 ]; then
		echo "$errors failed requests; see the loadgen lines above: instructions per request not reported" >&2
		exit 1
	fi
	# Requests per second under valgrind say nothing about Caddy's own speed: report the counts.
	awk -v a="$(median "${rr_ins[@]}")" -v b="$(median "${llm_ins[@]}")" -v n="$ROUNDS" 'BEGIN {
		printf "instructions per request, medians of %d: round_robin %.0f, llm_affinity %.0f (%+.0f, llm_affinity/round_robin %.3f)\n", n, a, b, b - a, b / a
	}'
	exit 0
fi

awk -v rr="${rr_cpu[*]}" -v llm="${llm_cpu[*]}" 'BEGIN {
	n = split(rr, a, " "); split(llm, b, " ")
	for (i = 1; i <= n; i++) { sa += a[i]; sb += b[i] }
	if (sa > 0) printf "caddy CPU per request: round_robin %.0f us, llm_affinity %.0f us (%+.0f us, llm_affinity/round_robin %.3f)\n", sa / n, sb / n, (sb - sa) / n, sb / sa
}'
rr_med=$(median "${rr_all[@]}")
llm_med=$(median "${llm_all[@]}")
rr_cpu_med=$(median "${rr_cpu[@]}")
llm_cpu_med=$(median "${llm_cpu[@]}")
awk -v a="$rr_med" -v b="$llm_med" -v ca="$rr_cpu_med" -v cb="$llm_cpu_med" -v n="$ROUNDS" 'BEGIN {
	printf "medians of %d: round_robin %.0f req/s, llm_affinity %.0f req/s, ratio %.3f; caddy CPU per request %.0f us vs %.0f us (%+.0f us)\n", n, a, b, b / a, ca, cb, cb - ca
}'
# Paired: each round's two runs are next to each other in time, so the median of the per-round
# ratios and CPU differences shrugs off a neighbour's load that moves between rounds.
pair_ratios=()
pair_cpu=()
for i in "${!rr_all[@]}"; do
	pair_ratios+=("$(awk -v a="${rr_all[$i]}" -v b="${llm_all[$i]}" 'BEGIN { printf "%.4f", (a > 0 ? b / a : 0) }')")
	pair_cpu+=("$(awk -v a="${rr_cpu[$i]}" -v b="${llm_cpu[$i]}" 'BEGIN { printf "%.1f", b - a }')")
done
echo "paired, median over $ROUNDS rounds: ratio $(median "${pair_ratios[@]}" | awk '{ printf "%.3f", $1 }') (rounds: ${pair_ratios[*]}); caddy CPU per request $(median "${pair_cpu[@]}" | awk '{ printf "%+.0f", $1 }') us (rounds: ${pair_cpu[*]})"
summary=$(awk -v rr="${rr_all[*]}" -v llm="${llm_all[*]}" 'BEGIN {
	n = split(rr, a, " "); split(llm, b, " ")
	for (i = 1; i <= n; i++) { sa += a[i]; sb += b[i] }
	printf "round_robin %.0f req/s, llm_affinity %.0f req/s (means of %d), ratio %.3f", sa / n, sb / n, n, sb / sa
}')
echo "$summary"
if [ "$errors" -gt 0 ]; then
	echo "warning: $errors failed requests; see the loadgen lines above" >&2
fi
if [ -n "$MIN_RATIO" ]; then
	ratio=${summary##* }
	if awk -v r="$ratio" -v m="$MIN_RATIO" 'BEGIN { exit !(r < m) }'; then
		echo "ratio $ratio is below MIN_RATIO $MIN_RATIO" >&2
		exit 1
	fi
fi
