#!/usr/bin/env bash
# Splits what the llm_affinity router costs per request, next to plain Caddy, by function.
#
# Three Caddy processes run under valgrind's cachegrind at once: one with the llm_affinity
# handler and policy, one with lb_policy round_robin, both in front of the same four trivial
# upstreams (scripts/trivial-upstream), and one serving nothing, whose count (start-up, timers)
# is subtracted from the other two. The load generator (scripts/loadgen) loads the first two
# side by side for DURATION; the script then prints each one's instructions per request, their
# difference by group (the plugin's own code, garbage collection, allocation, maps, ...) and
# the functions that differ most. cachegrind attributes each instruction to the function it
# lies in; callgrind (scripts/overhead.sh INSTRUCTIONS=1) follows calls, which Go's goroutine
# switches confuse, so its per-function figures are not to be trusted, only its totals.
#
#   scripts/overhead-split.sh
#   DURATION=40s API=responses TOP=40 scripts/overhead-split.sh
#   STREAM_TOKENS=64 scripts/overhead-split.sh
#   CACHE_SIM=1 scripts/overhead-split.sh   # also each one's cache misses a request
#
# Environment: DURATION (40s), CONCURRENCY (32), PROMPT_BYTES (512), API (completions or
# responses), STREAM_TOKENS (unset: not streamed; N: streamed in N one-token events, as in
# scripts/overhead.sh), TOKEN_INTERVAL (as in scripts/overhead.sh), TOP (30 functions), CACHE_SIM (1: cachegrind simulates the
# caches too, a 32 KiB first-level instruction cache among them, and the script prints each site's
# misses a request and the functions whose instruction-cache misses differ most), BASE_PORT (18180: uses BASE_PORT..BASE_PORT+6). Keep DURATION
# at 10s or more: in a 3 s run the scheduler's spinning (runtime.lock2, findRunnable) differed by
# tens of thousands of instructions a request between the two processes.
# The whole difference moves by several thousand instructions from run to run (garbage
# collection and the scheduler, which depend on how the two processes were loaded); the other
# groups repeat within a few instructions, and their sum is printed on its own line: compare
# that one between two builds.
# Needs Go and valgrind (Debian's package); takes about DURATION plus a minute.
set -euo pipefail

DURATION=${DURATION:-40s}
CONCURRENCY=${CONCURRENCY:-32}
PROMPT_BYTES=${PROMPT_BYTES:-512}
API=${API:-completions}
STREAM_TOKENS=${STREAM_TOKENS:-}
TOP=${TOP:-30}
CACHE_SIM=${CACHE_SIM:-}
cache_sim=no
[ "$CACHE_SIM" = 1 ] && cache_sim=yes
BASE_PORT=${BASE_PORT:-18180}
case "$API" in
completions | responses) ;;
*)
	echo "API must be completions or responses, not $API" >&2
	exit 2
	;;
esac
command -v valgrind >/dev/null || { echo "needs valgrind (apt-get install valgrind)" >&2; exit 1; }

cd "$(dirname "$0")/.."
work=$(mktemp -d)
pids=()
cleanup() {
	for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
	wait 2>/dev/null || true
	rm -rf "$work"
}
trap cleanup EXIT

llm_port=$BASE_PORT
rr_port=$((BASE_PORT + 1))
idle_port=$((BASE_PORT + 2))
up_ports=($((BASE_PORT + 3)) $((BASE_PORT + 4)) $((BASE_PORT + 5)) $((BASE_PORT + 6)))
ups=""
for p in "${up_ports[@]}"; do ups+="127.0.0.1:$p "; done
ups=${ups% }
# shellcheck source=scripts/bench-common.sh
. scripts/bench-common.sh
ports_free "$llm_port" "$rr_port" "$idle_port" "${up_ports[@]}"
build_bench_tools "$work"
"$work/upstream" -addr "$(echo "$ups" | tr ' ' ',')" -chunks "${STREAM_TOKENS:-16}" -token-interval "${TOKEN_INTERVAL:-0}" 2>"$work/upstream.log" &
pids+=($!)

site() { # site PORT POLICY-LINES
	cat <<EOF
{
	admin off
	persist_config off
}
http://:$1 {
$2
}
EOF
}
site "$llm_port" "	llm_affinity
	reverse_proxy $ups {
		lb_policy llm_affinity
	}" >"$work/llm.Caddyfile"
site "$rr_port" "	reverse_proxy $ups {
		lb_policy round_robin
	}" >"$work/rr.Caddyfile"
site "$idle_port" "	respond 404" >"$work/idle.Caddyfile"
for s in llm rr idle; do
	GODEBUG=asyncpreemptoff=1 valgrind --tool=cachegrind --cache-sim=$cache_sim --cachegrind-out-file="$work/$s.cg" \
		"$work/caddy" run --config "$work/$s.Caddyfile" --adapter caddyfile >"$work/$s.log" 2>&1 &
	pids+=($!)
done

write_body "$work/body.json"
# Caddy takes seconds to start under valgrind: wait until each listens, then warm it up.
for p in "$llm_port" "$rr_port" "$idle_port"; do
	for i in $(seq 1 600); do
		(exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null && break
		if [ "$i" = 600 ]; then
			echo "nothing listens on port $p after 2 minutes; the Caddy logs:" >&2
			cat "$work"/*.log >&2
			exit 1
		fi
		sleep 0.2
	done
done
for p in "$llm_port" "$rr_port"; do
	"$work/loadgen" -url "http://127.0.0.1:$p/v1/$API" -body "$work/body.json" -c 1 -d 1s -warmup 0 >"$work/warm.$p"
	if ! grep -q ' errors=0 ' "$work/warm.$p"; then
		echo "the warm-up against port $p failed: $(cat "$work/warm.$p")" >&2
		exit 1
	fi
done
"$work/loadgen" -url "http://127.0.0.1:$rr_port/v1/$API" -body "$work/body.json" -c "$CONCURRENCY" -d "$DURATION" -warmup 0 >"$work/rr.load" &
rr_load=$!
"$work/loadgen" -url "http://127.0.0.1:$llm_port/v1/$API" -body "$work/body.json" -c "$CONCURRENCY" -d "$DURATION" -warmup 0 >"$work/llm.load"
wait "$rr_load"
# Stop the three at once (interrupted, valgrind writes its counts), so the idle one lived as long.
for pid in "${pids[@]:1}"; do kill -INT "$pid" 2>/dev/null || true; done
for pid in "${pids[@]:1}"; do wait "$pid" 2>/dev/null || true; done
pids=("${pids[0]}")
cat "$work/llm.load" "$work/rr.load" | sed 's/^/loadgen: /'
# Failed requests cost instructions too, and the load generator counts only the served.
for f in llm rr; do
	if ! grep -q ' errors=0 ' "$work/$f.load"; then
		echo "requests to the $f site failed: no instructions a request reported" >&2
		exit 1
	fi
done
for s in llm rr idle; do
	[ -s "$work/$s.cg" ] || { echo "cachegrind wrote no counts for the $s Caddy; its log:" >&2; cat "$work/$s.log" >&2; exit 1; }
done
field() { tr ' ' '\n' <"$1" | sed -n "s/^$2=//p"; }
# Requests served: the measured ones and the warm-up's.
n_llm=$(($(field "$work/llm.load" requests) + $(field "$work/warm.$llm_port" requests)))
n_rr=$(($(field "$work/rr.load" requests) + $(field "$work/warm.$rr_port" requests)))

# The awk programs read all their input: one that stopped early would end cg_annotate with
# SIGPIPE, which pipefail makes this script's failure.
functions() { # functions FILE [COLUMN]: "count<TAB>function" for every function, the count of
	# the COLUMNth event (1, the default, is instructions; with CACHE_SIM, 2 is I1 misses)
	cg_annotate --threshold=0 --show-percs=no "$1" | awk -v col="${2:-1}" '
		/file:function/ { on = 1; next }
		on && /^-+$/ { next }
		on && NF == 0 { if (n) on = 0; next }
		on { c = $col; gsub(",", "", c); while (sub(/^ *[0-9,.]+ +/, "")) {}; printf "%s\t%s\n", c + 0, $0; n++ }'
}
total() { cg_annotate "$1" | awk '/PROGRAM TOTALS/ && !done { gsub(",", "", $1); print $1; done = 1 }'; }
for s in llm rr idle; do functions "$work/$s.cg" >"$work/$s.fn"; done
awk -F'\t' -v nl="$n_llm" -v nr="$n_rr" -v tl="$(total "$work/llm.cg")" -v tr="$(total "$work/rr.cg")" \
	-v ti="$(total "$work/idle.cg")" -v top="$TOP" '
	FILENAME ~ /llm.fn$/ { l[$2] += $1; names[$2] = 1; next }
	FILENAME ~ /rr.fn$/ { r[$2] += $1; names[$2] = 1; next }
	{ i[$2] += $1 }
	function group(f) {
		if (f ~ /llmaffinity/) return "the plugin'"'"'s own code"
		if (f ~ /runtime\/(mgc|mbitmap|mheap|mwbbuf|mspanset|mcentral|mcache|mfinal)|gc\/scan/) return "garbage collection"
		if (f ~ /runtime\/(malloc|mbarrier)|memclr|gcWriteBarrier|newobject|makeslice|growslice/) return "allocation"
		if (f ~ /internal\/runtime\/maps|aeshash|strhash|mapaccess|mapassign/) return "map lookups"
		if (f ~ /bytealg|bytes\/bytes|strings\/strings|memmove/) return "byte searches, copies"
		if (f ~ /context\/context/) return "contexts"
		if (f ~ /prometheus/) return "Prometheus client"
		if (f ~ /runtime\/(proc|lock|sema|chan|select|netpoll|time|stack|symtab|traceback|stkframe|mgcstack|preempt|os_linux|sys_linux|signal)|internal\/sync|sync\//) return "scheduler, locks, stacks"
		return "other"
	}
	END {
		printf "instructions a request: llm_affinity %.0f (%d requests), round_robin %.0f (%d requests), difference %+.0f\n",
			(tl - ti) / nl, nl, (tr - ti) / nr, nr, (tl - ti) / nl - (tr - ti) / nr
		for (f in names) {
			d = (l[f] - i[f]) / nl - (r[f] - i[f]) / nr
			g[group(f)] += d
			printf "%.0f\t%.0f\t%.0f\t%s\n", d, (l[f] - i[f]) / nl, (r[f] - i[f]) / nr, f > diff
		}
		print "difference by group:"
		for (k in g) printf "  %+8.0f  %s\n", g[k], k | "sort -g -r"
		close("sort -g -r")
		for (k in g) if (k != "garbage collection" && k != "scheduler, locks, stacks") steady += g[k]
		printf "difference without garbage collection and the scheduler (what repeats run to run): %+.0f\n", steady
	}' diff="$work/diff" "$work/llm.fn" "$work/rr.fn" "$work/idle.fn"
# awk cuts the sorted lists (head would end sort with SIGPIPE, a failure under pipefail).
echo "functions that differ most (difference, llm_affinity, round_robin):"
show='NR <= n { printf "  %+8.0f %8.0f %8.0f  %s\n", $1, $2, $3, substr($4, 1, 140) }'
sort -t$'\t' -k1,1 -g -r "$work/diff" | awk -F'\t' -v n="$TOP" "$show"
echo "  ..."
sort -t$'\t' -k1,1 -g "$work/diff" | awk -F'\t' -v n=8 "$show"
[ "$CACHE_SIM" = 1 ] || exit 0

# Each event's count a request: instructions (Ir), first-level instruction-cache misses (I1mr),
# data reads and their misses (Dr, D1mr), writes and theirs (Dw, D1mw); the last-level ones (IL,
# DL) are all but zero. A miss costs cycles an instruction count does not show.
echo "cache simulation, a request (llm_affinity, round_robin, difference):"
events() { cg_annotate "$1" | awk '/PROGRAM TOTALS/ && !done { for (i = 1; i <= 9; i++) { c = $(2 * i - 1); gsub(",", "", c); printf "%s ", c }; done = 1 }'; }
awk -v l="$(events "$work/llm.cg")" -v r="$(events "$work/rr.cg")" -v i="$(events "$work/idle.cg")" \
	-v nl="$n_llm" -v nr="$n_rr" 'BEGIN {
	split("Ir I1mr ILmr Dr D1mr DLmr Dw D1mw DLmw", name, " ")
	split(l, a, " "); split(r, b, " "); split(i, c, " ")
	for (k = 1; k <= 9; k++) {
		x = (a[k] - c[k]) / nl; y = (b[k] - c[k]) / nr
		printf "  %-5s %10.0f %10.0f %+10.0f\n", name[k], x, y, x - y
	}
}'
for s in llm rr idle; do functions "$work/$s.cg" 2 >"$work/$s.i1"; done
awk -F'\t' -v nl="$n_llm" -v nr="$n_rr" '
	FILENAME ~ /llm.i1$/ { l[$2] += $1; names[$2] = 1; next }
	FILENAME ~ /rr.i1$/ { r[$2] += $1; names[$2] = 1; next }
	{ i[$2] += $1 }
	END {
		for (f in names) {
			d = (l[f] - i[f]) / nl - (r[f] - i[f]) / nr
			if (f ~ /llmaffinity/) own += d; else rest += d
			printf "%.1f\t%.1f\t%.1f\t%s\n", d, (l[f] - i[f]) / nl, (r[f] - i[f]) / nr, f > diff
		}
		printf "instruction-cache misses a request over round robin: the plugin'"'"'s own code %+.0f, the rest %+.0f\n", own, rest
	}' diff="$work/i1diff" "$work/llm.i1" "$work/rr.i1" "$work/idle.i1"
echo "functions whose instruction-cache misses differ most (difference, llm_affinity, round_robin):"
show1='NR <= n { printf "  %+8.1f %8.1f %8.1f  %s\n", $1, $2, $3, substr($4, 1, 140) }'
sort -t$'\t' -k1,1 -g -r "$work/i1diff" | awk -F'\t' -v n="$TOP" "$show1"
