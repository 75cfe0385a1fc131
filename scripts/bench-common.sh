# Shell functions for scripts/overhead.sh and scripts/overhead-split.sh (sourced, not run).

# ports_free PORT...: exits the script when a port is taken. Another process there would answer
# in Caddy's stead and be measured (under valgrind Caddy takes seconds to listen, so a readiness
# check would pass at once).
ports_free() {
	local p
	for p in "$@"; do
		if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
			echo "port $p is in use: stop what listens there, or set BASE_PORT" >&2
			exit 1
		fi
	done
}

# build_bench_tools DIR: builds Caddy with the plugin, the load generator and the trivial
# upstream into DIR.
build_bench_tools() {
	echo "building caddy, loadgen and trivial-upstream ..." >&2
	go build -o "$1/caddy" ./cmd/caddy
	go build -o "$1/loadgen" ./scripts/loadgen
	go build -o "$1/upstream" ./scripts/trivial-upstream
}
