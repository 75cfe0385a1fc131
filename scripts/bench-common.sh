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

# write_body FILE: writes the request both overhead scripts send to FILE: PROMPT_BYTES of shared
# text (about PROMPT_BYTES/4 tokens), then a request number (loadgen fills in {{seq}}), like
# chats that share a system prompt; for API=responses as the Responses API's input; with
# STREAM_TOKENS set, asking for a stream of that many tokens (with its usage).
write_body() {
	local prompt
	prompt=$(head -c "$PROMPT_BYTES" </dev/zero | tr '\0' 'a' | sed 's/a\{8\}/lorem a /g')
	if [ "$API" = responses ]; then
		printf '{"model":"meta-llama/Llama-3.1-8B-Instruct","input":"%s Question {{seq}}?","max_output_tokens":%d%s}' \
			"$prompt" "${STREAM_TOKENS:-16}" "${STREAM_TOKENS:+,\"stream\":true}" >"$1"
	elif [ -n "$STREAM_TOKENS" ]; then
		printf '{"model":"meta-llama/Llama-3.1-8B-Instruct","prompt":"%s Question {{seq}}?","max_tokens":%d,"stream":true,"stream_options":{"include_usage":true}}' \
			"$prompt" "$STREAM_TOKENS" >"$1"
	else
		printf '{"model":"meta-llama/Llama-3.1-8B-Instruct","prompt":"%s Question {{seq}}?","max_tokens":16}' \
			"$prompt" >"$1"
	fi
}
