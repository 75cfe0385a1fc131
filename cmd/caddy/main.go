// Command caddy is Caddy with the llm_affinity plugin and the kvsim simulated inference
// engine compiled in, as xcaddy builds it from xcaddy.json. It runs the quickstart and the
// example Caddyfiles, whose replicas are kvsim sites.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	// The module root registers the plugin's modules, as xcaddy's build does; kvsim is a
	// plugin of its own, which the root package leaves out of production builds.
	_ "github.com/llmaffinity/caddy-llm-affinity"
	_ "github.com/llmaffinity/caddy-llm-affinity/kvsim/caddykvsim"
)

func main() {
	caddycmd.Main()
}
